"""The adapters by ``adapter.kind``: the one place a new adapter is registered."""

from __future__ import annotations

import torch

from car_fl.adapters.adapter import Adapter
from car_fl.adapters.diagonal import DiagonalAdapter
from car_fl.adapters.full import FullAdapter
from car_fl.adapters.lowrank import LowRankAdapter
from car_fl.settings.schema import AdapterConfig, AdapterKind

#: ``adapter.kind`` → its adapter.
ADAPTERS: dict[AdapterKind, type[Adapter]] = {
    adapter.kind: adapter for adapter in (FullAdapter, LowRankAdapter, DiagonalAdapter)
}


def build_adapter(cfg: AdapterConfig, dim: int, *, seed: int) -> Adapter:
    """The identity adapter of ``adapter.kind`` and width ``dim``; its random parts (a low-rank
    V) depend on ``seed`` alone, so every party builds the same one from the settings."""
    generator = torch.Generator().manual_seed(seed)
    return ADAPTERS[cfg.kind].build(dim, cfg, generator)
