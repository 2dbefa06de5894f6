"""``adapter.kind=lowrank``: x ↦ x + (x V) Uᵀ, i.e. W = I + U Vᵀ of rank ``adapter.rank``.

U (d×r) starts at zero, so an untrained adapter is the identity; V (d×r) starts random
(N(0, 1/d), from the run's seed) so that U's first gradient is not zero (as LoRA starts).
Soft prompts have low intrinsic rank (DePT, DPT); a rank-r adapter sends 2·d·r numbers
instead of d² and takes DP noise on that many. Per-example gradients are d×r, small enough
to form for a batch: ∇U = Σₜ gₜ zₜᵀ with z = x V, ∇V = Σₜ xₜ (Uᵀ gₜ)ᵀ.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from car_fl.adapters.adapter import Adapter, Tensors
from car_fl.settings.schema import AdapterConfig, AdapterKind


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
        return int(self.up.detach().count_nonzero()) == 0

    def _per_example(self, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        up, down = self.up.detach().to(x), self.down.detach().to(x)
        z = x @ down  # (b, t, r)
        back = g @ up  # (b, t, r): Uᵀ gₜ
        return {
            "up": torch.einsum("btd,btr->bdr", g, z),
            "down": torch.einsum("btd,btr->bdr", x, back),
        }

    def example_squares(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return sum(v.pow(2).sum(dim=(1, 2)) for v in self._per_example(x, g).values())  # type: ignore[return-value]

    def clipped_sum(self, factors: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Tensors:
        return {
            k: torch.einsum("b,bdr->dr", factors, v) for k, v in self._per_example(x, g).items()
        }


def check_rank(rank: int, dim: int) -> None:
    """``adapter.rank`` fits the encoder, or a ``ValueError`` that says how to fix it."""
    if not 1 <= rank <= dim:
        raise ValueError(
            f"adapter.rank={rank} must be in [1, d={dim}] (the encoder's hidden size); lower "
            "adapter.rank"
        )
