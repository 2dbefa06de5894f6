"""A tiny Llama whose final norm is not the identity, and an in-process blocks service on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from car_fl.blocks.client import IN_PROCESS
from car_fl.blocks.compute import BlocksHandler
from car_fl.settings.schema import ModelConfig

URL = "inprocess://tiny"


def model_cfg(folder: Path, **kw: object) -> ModelConfig:
    return ModelConfig(name="tiny", name_or_path=str(folder), dtype="float32", **kw)  # type: ignore[arg-type]


@pytest.fixture
def service(normed_llama: Path) -> Iterator[BlocksHandler]:
    """The service's handler in this process, at :data:`URL`."""
    from car_fl.serving.blocks_service import load_runner

    handler = BlocksHandler(load_runner(model_cfg(normed_llama), device="cpu"))
    IN_PROCESS[URL] = handler.handle
    yield handler
    IN_PROCESS.pop(URL, None)
