"""An adapter built from its ``adapter.kind``: the class its registration names
(:data:`car_fl.adapters.config.ADAPTERS`), imported only now; a server's adapter checked
against the run's kind."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

from car_fl.adapters.adapter import Adapter
from car_fl.adapters.config import AdapterConfig, AdapterKind
from car_fl.privacy.mechanism import ADAPTER_PREFIX


def adapter_class(kind: AdapterKind) -> type[Adapter]:
    """The class ``kind``'s registration names (``module:Class``), checked to be an
    :class:`~car_fl.adapters.adapter.Adapter` of that kind."""
    module, _, name = kind.module_class.partition(":")
    adapter = getattr(importlib.import_module(module), name)
    if not (isinstance(adapter, type) and issubclass(adapter, Adapter) and adapter.kind is kind):
        raise TypeError(f"adapter.kind={kind}: {kind.module_class} is no Adapter of kind {kind}")
    return adapter


def build_adapter(cfg: AdapterConfig, dim: int, *, seed: int) -> Adapter:
    """The identity adapter of ``adapter.kind`` and width ``dim``; its random parts (a low-rank
    V) depend on ``seed`` alone, so every party builds the same one from the settings."""
    generator = torch.Generator().manual_seed(seed)
    return adapter_class(cfg.kind).build(dim, cfg, generator)


def state_refusal(cfg: AdapterConfig, state: Mapping[str, torch.Tensor]) -> str | None:
    """Why a global state's adapter tensors (``adapter.*``) cannot be this run's adapter, or
    None: another kind's names, shapes not of one width, values not finite. A node asks before
    its ledger is charged, so an ill-formed adapter costs its owner nothing."""
    sent = {
        k.removeprefix(ADAPTER_PREFIX): v for k, v in state.items() if k.startswith(ADAPTER_PREFIX)
    }
    if not sent:
        return None
    kind = adapter_class(cfg.kind)
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
