"""``adapter.kind=diagonal``: x ↦ x ⊙ s + b, a scale and a shift per dimension (2·d numbers).

Per example, ∇s = Σₜ gₜ ⊙ xₜ and ∇b = Σₜ gₜ over the real tokens (DP-SGD's caller zeroes g at
pads).
"""

from __future__ import annotations

import torch
from torch import nn

from car_fl.adapters.adapter import Adapter, Tensors
from car_fl.adapters.config import AdapterConfig, AdapterKind


class DiagonalAdapter(Adapter):
    """``scale`` s (d,) and ``shift`` b (d,), float32."""

    kind = AdapterKind.DIAGONAL

    def __init__(self, dim: int, cfg: AdapterConfig | None = None) -> None:
        super().__init__(dim, cfg)
        self.scale = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.shift = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    @classmethod
    def build(cls, dim: int, cfg: AdapterConfig, generator: torch.Generator) -> DiagonalAdapter:
        return cls(dim, cfg)

    @classmethod
    def shapes(cls, cfg: AdapterConfig, dim: int) -> dict[str, tuple[int, ...]]:
        return {"scale": (dim,), "shift": (dim,)}

    @property
    def dim(self) -> int:
        return int(self.scale.shape[0])

    def affine(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings * self.scale + self.shift

    def deviation(self) -> torch.Tensor:
        return (self.scale - 1).pow(2).sum() + self.shift.pow(2).sum()

    def at_start(self) -> bool:
        return bool(self.scale.detach().eq(1).all()) and not bool(self.shift.detach().any())

    def _per_example(self, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        return {"scale": (g * x).sum(dim=1), "shift": g.sum(dim=1)}

    def example_squares(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        per = self._per_example(x, g)
        return per["scale"].pow(2).sum(dim=1) + per["shift"].pow(2).sum(dim=1)

    def clipped_sum(self, factors: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        return {k: factors @ v for k, v in self._per_example(x, g).items()}
