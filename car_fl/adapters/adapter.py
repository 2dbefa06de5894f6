"""The interface of a soft-embedding adapter: what the retriever, the optimiser and DP-SGD ask.

A kind implements :meth:`Adapter.affine`, :meth:`Adapter.deviation` (‖ADP − I‖²_F),
:meth:`Adapter.is_identity`, and DP-SGD's batched clipping, :meth:`Adapter.example_squares`
(‖∇ᵢ‖²) and :meth:`Adapter.clipped_sum` (Σᵢ cᵢ ∇ᵢ), which must equal per-example autograd
(``tests/privacy/test_ghost.py`` checks every kind). A kind starts as exactly the identity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from car_fl.adapters.config import AdapterConfig, AdapterKind

Tensors = dict[str, torch.Tensor]


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
