"""car_fl.model.sources: an unreachable encoder or dataset fails in seconds, naming every fix."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from car_fl.model import sources
from car_fl.model.gguf import PRESETS
from car_fl.model.sources import (
    DATASET_FIX,
    MODEL_FIX,
    SourceError,
    check_sources,
    encoder_digest,
)
from car_fl.settings.compose import load_settings


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No Hub cache, the Hub forbidden (as in the whole suite) unless a test allows it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "hf"


def test_local_files_and_folders_must_exist(make_settings, tmp_path: Path) -> None:
    check_sources(make_settings())  # the fixtures exist: nothing from the Hub
    with pytest.raises(SourceError, match=r"dataset.path=.*nope.tsv does not exist on the server"):
        check_sources(make_settings(f"dataset.path={tmp_path / 'nope.tsv'}"), where="on the server")
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path=.*no-model is not a folder"):
        check_sources(make_settings(model_dir=tmp_path / "no-model"))


def test_the_offline_default_names_both_fixes_at_once(empty_cache: Path) -> None:
    tick = time.monotonic()
    with pytest.raises(SourceError) as err:
        check_sources(load_settings())
    assert time.monotonic() - tick < 3.0  # HF_HUB_OFFLINE: no probe (a probe waits 4 s)
    message = str(err.value)
    assert "\n" not in message
    assert "'TinyLlama/TinyLlama-1.1B-Chat-v1.0' and the dataset 'ucirvine/sms_spam'" in message
    assert MODEL_FIX in message and DATASET_FIX in message and "HF_HUB_OFFLINE is set" in message
    assert "model=smollm2" in message and "model=minilm" in message and "dataset.path=" in message
    # With the encoder offline (MiniLM's package) only the dataset's fix is left.
    with pytest.raises(SourceError, match=r"^the dataset 'ucirvine/sms_spam' must.*dataset.path="):
        check_sources(load_settings("model=minilm"))


HUB_CACHE_OF = """
import importlib, json, os, sys
import huggingface_hub.constants as constants
found = []
for env in json.loads(sys.argv[1]):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "CF_VAR"):
        os.environ.pop(name, None)
    os.environ.update(env)
    found.append(importlib.reload(constants).HF_HUB_CACHE)
print(json.dumps(found))
"""


def test_the_hub_cache_is_where_huggingface_hub_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variable huggingface_hub reads, legacy ones too, gives the folder it uses (else a
    cached model would look uncached and its feature space would lose its commit)."""
    import json
    import subprocess
    import sys

    cases = [
        {"HF_HUB_CACHE": "~/hub-a", "HUGGINGFACE_HUB_CACHE": str(tmp_path / "b")},
        {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy")},
        {"CF_VAR": str(tmp_path), "HF_HOME": "$CF_VAR/home"},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
    ]
    theirs = subprocess.run(
        [sys.executable, "-c", HUB_CACHE_OF, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "CF_VAR"):
        monkeypatch.delenv(name, raising=False)
    ours = []
    for env in cases:
        with monkeypatch.context() as patched:
            for name, value in env.items():
                patched.setenv(name, value)
            ours.append(str(sources.hub_cache()))
    assert ours == json.loads(theirs)


def test_what_the_hub_cache_holds_needs_no_hub(empty_cache: Path) -> None:
    model = empty_cache / "hub" / "models--TinyLlama--TinyLlama-1.1B-Chat-v1.0" / "snapshots" / "a"
    model.mkdir(parents=True)
    (empty_cache / "datasets" / "ucirvine___sms_spam" / "default").mkdir(parents=True)
    check_sources(load_settings())


class Hub(BaseHTTPRequestHandler):
    """A stand-in Hub API: 200 for the default model, 404 for anything else."""

    asked: ClassVar[list[str]] = []

    def do_HEAD(self) -> None:
        self.asked.append(self.path)
        known = self.path == "/api/models/TinyLlama/TinyLlama-1.1B-Chat-v1.0"
        self.send_response(200 if known else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    yield endpoint
    server.shutdown()
    server.server_close()


def test_a_hub_that_answers_lets_the_loaders_do_their_work(hub: str) -> None:
    Hub.asked.clear()
    check_sources(load_settings("dataset.path=/dev/null"))  # the model is on the Hub
    check_sources(load_settings("dataset.path=/dev/null"))  # car-fl train, then its run
    assert Hub.asked == ["/api/models/TinyLlama/TinyLlama-1.1B-Chat-v1.0"]  # asked once
    with pytest.raises(SourceError, match=r"answered HTTP 404 for dataset 'ucirvine/sms_spam'"):
        check_sources(load_settings())  # this stand-in Hub has no such dataset


def closed_endpoint() -> str:
    """An endpoint on 127.0.0.1 whose port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_unreachable_hub_fails_in_seconds(empty_cache: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    tick = time.monotonic()
    with pytest.raises(SourceError, match=r"could not be reached.*model=minilm.*dataset.path="):
        check_sources(load_settings())
    assert time.monotonic() - tick < 5.0


def test_a_missing_data_file_names_the_near_names_in_its_folder(
    make_settings, tmp_path: Path
) -> None:
    (tmp_path / "SMSSpamCollection.tsv").write_text("ham\thi\n", encoding="utf-8")
    typo = make_settings(f"dataset.path={tmp_path / 'SMSSpamColection.tsv'}")
    with pytest.raises(
        SourceError, match=r"does not exist here \(did you mean .*SMSSpamCollection"
    ):
        check_sources(typo)
    elsewhere = make_settings(f"dataset.path={tmp_path / 'other.csv'}")
    with pytest.raises(SourceError, match=r"holds: SMSSpamCollection.tsv\)"):
        check_sources(elsewhere)


def test_the_encoder_digest_reads_content_not_paths_or_times(
    make_settings, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy elsewhere (new times) is the same encoder, and so is a folder with a README
    added; one weight changed is another. A large file is sampled: a change at a sample is
    seen, one between samples is not (the limit the docstring states)."""
    copy = Path(shutil.copytree(tiny_llama, tmp_path / "copy"))
    digest = encoder_digest(make_settings().model)
    assert digest is not None and digest == encoder_digest(make_settings(model_dir=copy).model)
    (copy / "README.md").write_text("notes\n")
    assert encoder_digest(make_settings(model_dir=copy).model) == digest
    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert encoder_digest(make_settings(model_dir=copy).model) != digest
    gone = make_settings().model
    gone.name_or_path = str(tmp_path / "not-here")  # on a node without it: the loader's to say
    assert encoder_digest(gone) is None

    monkeypatch.setattr(sources, "WHOLE_BYTES", 1 << 16)
    big = tmp_path / "big.gguf"
    data = bytearray(torch.arange(1 << 22, dtype=torch.int32).numpy().tobytes())  # 16 MiB
    stride = (len(data) - sources.SAMPLE_BYTES) // (sources.SAMPLES - 1)
    big.write_bytes(data)
    cfg = make_settings().model
    cfg.name_or_path = str(big)
    before = encoder_digest(cfg)
    data[(stride + sources.SAMPLE_BYTES) // 2] ^= 1  # between the first two samples
    big.write_bytes(data)
    assert encoder_digest(cfg) == before
    data[0] ^= 1  # in the first sample
    big.write_bytes(data)
    assert encoder_digest(cfg) != before


def test_a_hub_model_is_its_cached_commit_and_a_preset_its_sha256(
    make_settings, empty_cache: Path
) -> None:
    cfg = make_settings().model
    cfg.name_or_path, cfg.revision = "org/model", "main"
    assert encoder_digest(cfg) is None  # not cached: nothing to name it by yet
    repo = empty_cache / "hub" / "models--org--model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert encoder_digest(cfg) == commit
    for revision in ("/proc/self/mem", "../../../../etc/hostname", "main/../../x"):
        cfg.revision = revision  # no ref name: a file outside the cache is never read
        assert encoder_digest(cfg) is None
    cfg.name_or_path = "org/../../elsewhere"  # no repo id, no folder: the loader's to refuse
    assert encoder_digest(cfg) is None
    cfg.name_or_path = "gguf:smollm2"
    assert encoder_digest(cfg) == PRESETS["smollm2"].sha256[:16]
