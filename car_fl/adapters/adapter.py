"""The interface of a soft-embedding adapter: what the retriever, the optimiser and DP-SGD ask.

A kind implements :meth:`Adapter.affine`, :meth:`Adapter.deviation` (‖ADP − I‖²_F),
:meth:`Adapter.is_identity`, and DP-SGD's batched clipping, :meth:`Adapter.example_squares`
(‖∇ᵢ‖²) and :meth:`Adapter.clipped_sum` (Σᵢ cᵢ ∇ᵢ), which must equal per-example autograd
(``tests/privacy/test_ghost.py`` checks every kind). A kind starts as exactly the identity.

The method's own kind, ``adapter.kind=full`` (:class:`FullAdapter`): x ↦ x Wᵀ with a d×d W,
the identity at start. Its per-example gradient Gᵢ = Σₜ gₜ xₜᵀ is d×d, so DP-SGD never builds
it: ‖Gᵢ‖² = Σₜ,ₛ (gₜ·gₛ)(xₜ·xₛ) (ghost clipping, Li et al. 2022) and Σᵢ cᵢ Gᵢ is one
contraction.

An adapter is built from its ``adapter.kind`` (:func:`build_adapter`): the class its
registration names (:data:`car_fl.adapters.config.ADAPTERS`), imported only then; a server's
adapter is checked against the run's kind.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from car_fl.adapters.config import AdapterConfig, AdapterKind
from car_fl.privacy.mechanism import ADAPTER_PREFIX


class Adapter(nn.Module, ABC):
    """``(batch, seq, d)`` → ``(batch, seq, d)``; parameters in float32 (they train), inputs of
    another dtype computed in float32 and cast back, so a bf16 encoder sees its own dtype."""

    kind: ClassVar[AdapterKind]

    def __init__(self, dim: int, cfg: AdapterConfig | None = None) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"adapter dimension must be >= 1, got {dim}")
        cfg = cfg if cfg is not None else AdapterConfig(kind=self.kind)
        self.cfg = cfg
        self.dropout = nn.Dropout(cfg.dropout)

    @classmethod
    @abstractmethod
    def build(cls, dim: int, cfg: AdapterConfig, generator: torch.Generator) -> Adapter:
        """A new adapter of width ``dim``, the identity; random parts drawn from ``generator``."""

    @classmethod
    @abstractmethod
    def shapes(cls, cfg: AdapterConfig, dim: int) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape for width ``dim``, by name; a ``ValueError`` for settings that
        do not fit it (a rank above d)."""

    @property
    @abstractmethod
    def dim(self) -> int:
        """d, the width of the token embeddings."""

    @abstractmethod
    def affine(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The map itself in the parameters' dtype (no dropout): ``(..., d)`` → ``(..., d)``."""

    @abstractmethod
    def deviation(self) -> torch.Tensor:
        """‖ADP − I‖²_F (and a shift's ‖b‖²): 0 at start, differentiable."""

    @abstractmethod
    def at_start(self) -> bool:
        """Whether the parameters are exactly their identity values."""

    @abstractmethod
    def example_squares(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per example, ‖∇ᵢ‖² over this adapter's tensors: ``(batch,)``, from ``x`` ``(b, t, d)``
        (the token embeddings, zero at pads) and ``g`` ``(b, t, d)`` (∂ℓᵢ/∂ADP(x) of example i's
        own row, zero at pads), both float64."""

    @abstractmethod
    def clipped_sum(self, factors: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        """Σᵢ factorsᵢ · ∇ᵢ per tensor (names as in :meth:`named_parameters`), float64;
        ``x`` and ``g`` as in :meth:`example_squares`, zero for an example whose factor is 0."""

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """ADP(x): the map, then dropout on the soft embeddings while training."""
        first = next(self.parameters())
        out = self.dropout(self.affine(embeddings.to(first.dtype)))
        return out.to(embeddings.dtype)

    def is_identity(self) -> bool:
        """Whether the map is exactly the identity (then it is skipped); recomputed only after
        a parameter's version changed."""
        try:
            key = tuple((p._version, p.data_ptr()) for p in self.parameters())
        except RuntimeError:  # a torch.func transform's tensor: no storage to key an answer on
            return self.at_start()
        cached: tuple[object, bool] | None = getattr(self, "_identity", None)
        if cached is None or cached[0] != key:
            cached = (key, self.at_start())
            self._identity = cached
        return cached[1]

    def sent_numbers(self) -> int:
        """How many numbers this adapter adds to each reply."""
        return sum(p.numel() for p in self.parameters())


class FullAdapter(Adapter):
    """``weight`` (d×d, float32), the identity at start."""

    kind = AdapterKind.FULL

    def __init__(self, dim: int, cfg: AdapterConfig | None = None) -> None:
        super().__init__(dim, cfg)
        self.weight = nn.Parameter(torch.eye(dim, dtype=torch.float32))

    @classmethod
    def build(cls, dim: int, cfg: AdapterConfig, generator: torch.Generator) -> FullAdapter:
        return cls(dim, cfg)

    @classmethod
    def shapes(cls, cfg: AdapterConfig, dim: int) -> dict[str, tuple[int, ...]]:
        return {"weight": (dim, dim)}

    @property
    def dim(self) -> int:
        return int(self.weight.shape[0])

    def affine(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings @ self.weight.T

    def deviation(self) -> torch.Tensor:
        eye = torch.eye(self.dim, dtype=self.weight.dtype, device=self.weight.device)
        return (self.weight - eye).pow(2).sum()

    def at_start(self) -> bool:
        weight = self.weight.detach()
        return bool(weight.diagonal().eq(1).all()) and int(weight.count_nonzero()) == self.dim

    def example_squares(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return ((g @ g.transpose(1, 2)) * (x @ x.transpose(1, 2))).sum(dim=(1, 2))

    def clipped_sum(self, factors: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        return {"weight": torch.einsum("b,btd,bte->de", factors, g, x)}


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


Tensors = dict[str, torch.Tensor]
