"""``adapter.kind=full``: x ↦ x Wᵀ with a d×d W, the identity at start (the method's adapter).

Its per-example gradient Gᵢ = Σₜ gₜ xₜᵀ is d×d, so DP-SGD never builds it: ‖Gᵢ‖² =
Σₜ,ₛ (gₜ·gₛ)(xₜ·xₛ) (ghost clipping, Li et al. 2022) and Σᵢ cᵢ Gᵢ is one contraction.
"""

from __future__ import annotations

import torch
from torch import nn

from car_fl.adapters.adapter import Adapter, Tensors
from car_fl.adapters.config import AdapterConfig, AdapterKind


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
