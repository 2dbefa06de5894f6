"""``adapter.kind=lowrank``: x ↦ x + (x V) Uᵀ, i.e. W = I + U Vᵀ of rank ``adapter.rank``.

U starts at zero (the identity) and V random from the run's seed, as LoRA starts; 2·d·r numbers
travel and take DP noise instead of d². DP-SGD never forms the d×r per-example gradients: their
ghost norms come from (t × t) Gram matrices, the clipped sum from one contraction each.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from car_fl.adapters.adapter import Adapter, Tensors
from car_fl.adapters.config import AdapterConfig, AdapterKind


class LowRankAdapter(Adapter):
    """``up`` U and ``down`` V, each d×r (float32); the map is x + (x V) Uᵀ."""

    kind = AdapterKind.LOWRANK

    def __init__(self, dim: int, cfg: AdapterConfig, down: torch.Tensor) -> None:
        super().__init__(dim, cfg)
        check_rank(cfg.rank, dim)
        self.up = nn.Parameter(torch.zeros(dim, cfg.rank, dtype=torch.float32))
        self.down = nn.Parameter(down.to(torch.float32))

    @classmethod
    def build(cls, dim: int, cfg: AdapterConfig, generator: torch.Generator) -> LowRankAdapter:
        check_rank(cfg.rank, dim)
        down = torch.randn(dim, cfg.rank, generator=generator, dtype=torch.float32) / math.sqrt(dim)
        return cls(dim, cfg, down)

    @property
    def dim(self) -> int:
        return int(self.up.shape[0])

    def affine(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings + (embeddings @ self.down) @ self.up.T

    def deviation(self) -> torch.Tensor:
        # ‖U Vᵀ‖²_F = Σ (UᵀU) ⊙ (VᵀV): r×r products, never the d×d matrix
        return ((self.up.T @ self.up) * (self.down.T @ self.down)).sum()

    def at_start(self) -> bool:
        return int(self.up.detach().count_nonzero()) == 0 and bool(
            torch.isfinite(self.down.detach()).all()
        )

    @classmethod
    def shapes(cls, cfg: AdapterConfig, dim: int) -> dict[str, tuple[int, ...]]:
        check_rank(cfg.rank, dim)
        return {"up": (dim, cfg.rank), "down": (dim, cfg.rank)}

    def _inputs(self, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z = x V and Uᵀ g per token, ``(b, t, r)`` each."""
        up, down = self.up.detach().to(x), self.down.detach().to(x)
        return x @ down, g @ up

    def example_squares(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        # ghost norms, as the full adapter's: ‖Σₜ gₜ zₜᵀ‖² = Σₜ,ₛ (gₜ·gₛ)(zₜ·zₛ), and ∇V's alike;
        # (b, t, t) Gram matrices, never a (b, d, r) per-example gradient (r is the server's)
        z, back = self._inputs(x, g)
        grams = (g @ g.transpose(1, 2), x @ x.transpose(1, 2))
        up = (grams[0] * (z @ z.transpose(1, 2))).sum(dim=(1, 2))
        down = (grams[1] * (back @ back.transpose(1, 2))).sum(dim=(1, 2))
        return up + down

    def clipped_sum(self, factors: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        z, back = self._inputs(x, g)
        return {
            "up": torch.einsum("b,btd,btr->dr", factors, g, z),
            "down": torch.einsum("b,btd,btr->dr", factors, x, back),
        }


def check_rank(rank: int, dim: int) -> None:
    """``adapter.rank`` fits the encoder, or a ``ValueError`` that says how to fix it."""
    if not 1 <= rank <= dim:
        raise ValueError(
            f"adapter.rank={rank} must be in [1, d={dim}] (the encoder's hidden size); lower "
            "adapter.rank"
        )
