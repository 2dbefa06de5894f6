"""The serving tests' checkpoint: a document head on the tiny corpus, titled, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving.test_retrieval_api import corpus_checkpoint


@pytest.fixture(scope="session")
def checkpoint(
    tiny_llama: Path, tiny_corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Read only: every serving test answers from this one checkpoint."""
    return corpus_checkpoint(tmp_path_factory.mktemp("served"), tiny_llama, tiny_corpus)
