"""Shared fixtures: tiny offline models and data; strict settings for the whole suite."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

# No network anywhere in the suite: the hub code paths must fail fast instead of downloading.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch

from car_fl.settings.compose import load_settings
from car_fl.settings.schema import Settings
from car_fl.testing.tiny import (
    build_bert,
    build_llama,
    synthetic_examples,
    tiny_overrides,
    write_corpus,
    write_tsv,
)

SHARED_SMS = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "sms_spam" / ("SMSSpamCollection.tsv")
)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _share_the_cores() -> None:
    """An xdist worker takes its share of the cores (at least one) for torch and for the
    processes it starts, unless OMP_NUM_THREADS is set: three workers on two cores, each with
    two threads, spin-wait on one another (a MiniLM test took 94 s in the suite, 18 s alone)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM to pytest (a CI timeout, ``kill PID``) ends the suite as Ctrl-C does: pytest
    then tears the running test's fixtures down, so the SuperLinks, SuperNodes and workers a
    deployment test started are stopped by PID instead of left running."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    _share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_mps = pytest.mark.skip(reason="needs Apple's MPS device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "mps" in item.keywords and not torch.backends.mps.is_available():
            item.add_marker(skip_mps)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test leaves the process's signal handlers as it found them. Code run in-process
    replaces them (Ray's init installs a SIGTERM handler in the driver; Flower's entry points
    install exit handlers for SIGINT, SIGTERM and SIGQUIT), and a handler left behind turns a
    later Ctrl-C or SIGTERM to pytest into a SystemExit inside some other test, so the
    suite goes on instead of stopping."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _node_cache_in_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node writes under its own default cache (the run config's cache_dir is ignored on a
    node): in tests that default is a temporary folder of each test, never the real
    ``~/.cache/car-fl`` and never one that an earlier test filled (a warm cache would hide
    whether a test's node encoded its shard)."""
    monkeypatch.setenv("CAR_FL_CACHE", str(tmp_path / "node-cache"))
    # the owner's ledger registry (car_fl.client.ledger_registry): each test's own
    monkeypatch.setenv("CAR_FL_STATE", str(tmp_path / "owner-state"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def normed_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a random final norm: a node that skipped it would be caught."""
    import torch
    from transformers import AutoModel

    folder = build_llama(tmp_path_factory.mktemp("models") / "normed-llama", layers=3)
    model = AutoModel.from_pretrained(folder)
    with torch.no_grad():
        model.norm.weight.copy_(torch.rand_like(model.norm.weight) + 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_generator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its LM head (``LlamaForCausalLM``): a generator for RAG."""
    return build_llama(tmp_path_factory.mktemp("models") / "tiny-generator", causal=True)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="session")
def synthetic_tsv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 examples of a 4-label learnable task, in the SMS Spam Collection's format."""
    return write_tsv(tmp_path_factory.mktemp("data") / "synthetic.tsv", synthetic_examples(400))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 12-document corpus with 8 queries each (``car_fl.testing.tiny.write_corpus``)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def make_corpus_settings(make_settings, tiny_corpus: tuple[Path, Path]):
    """Settings for the tiny Llama on the tiny corpus, plus any overrides."""
    documents, queries = tiny_corpus

    def make(*overrides: str) -> Settings:
        return make_settings(
            "dataset=corpus",
            f"dataset.path={queries}",
            f"dataset.documents_path={documents}",
            "dataset.new_fraction=0.25",
            *overrides,
        )

    return make


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh folder with a short path: a Unix socket's path must stay under 100 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="cf-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def owner_policy() -> Iterator[Path]:
    """A node owner's privacy policy that admits every mode, in a folder of the owner's alone
    (a worker confined for another account's SuperNode needs one)."""
    folder = Path(tempfile.mkdtemp(prefix="cf-policy-", dir="/tmp"))
    try:
        policy = folder / "policy.toml"
        policy.write_text(
            'modes = ["none", "fixed", "adaptive", "record"]\npublic-example-count = false\n'
        )
        policy.chmod(0o600)
        yield policy
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def make_settings(tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path):
    """Settings for the tiny Llama and the synthetic data, plus any overrides."""

    def make(*overrides: str, model_dir: Path | None = None) -> Settings:
        base = tiny_overrides(model_dir or tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache")
        return load_settings([*base, *overrides])

    return make
