"""The adapters by ``adapter.kind``: the one place a new adapter is registered."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from car_fl.adapters.adapter import Adapter
from car_fl.adapters.diagonal import DiagonalAdapter
from car_fl.adapters.full import FullAdapter
from car_fl.adapters.lowrank import LowRankAdapter
from car_fl.privacy.mechanism import ADAPTER_PREFIX
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


def state_refusal(cfg: AdapterConfig, state: Mapping[str, torch.Tensor]) -> str | None:
    """Why a global state's adapter tensors (``adapter.*``) cannot be this run's adapter, or
    None: another kind's names, shapes not of one width, values not finite. A node asks before
    its ledger is charged, so an ill-formed adapter costs its owner nothing."""
    sent = {
        k.removeprefix(ADAPTER_PREFIX): v for k, v in state.items() if k.startswith(ADAPTER_PREFIX)
    }
    if not sent:
        return None
    kind = ADAPTERS[cfg.kind]
    first = next(iter(sent.values()))
    dim = int(first.shape[0]) if first.dim() else 0
    try:
        want = kind.shapes(cfg, dim)
    except ValueError as err:
        return f"the server's adapter does not fit adapter.kind={cfg.kind}: {err}"
    if set(sent) != set(want):
        return (
            f"the server's adapter tensors {sorted(sent)} are not adapter.kind={cfg.kind}'s "
            f"{sorted(want)}"
        )
    for name, shape in want.items():
        if tuple(sent[name].shape) != shape:
            return (
                f"the server's adapter.{name} has shape {tuple(sent[name].shape)}, expected {shape}"
            )
        if not bool(torch.isfinite(sent[name]).all()):
            return f"the server's adapter.{name} has non-finite values"
    return None
