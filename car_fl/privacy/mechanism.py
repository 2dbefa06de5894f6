"""The local DP mechanism as pure functions of tensors and numbers.

Fixed:    send θ + min(1, C/‖Δ‖)·Δ + N(0, σ₀²C²·I), with Δ = θᵢ − θ over all sent tensors.
Adaptive: noise N(0, (z_Δ·Cᵢ)²·I), z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), σ_b = m/20, and after each
          release Cᵢ ← (1 − β)·Cᵢ + β·γ·‖Δ‖ (‖Δ‖ optionally smoothed by an EMA).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

State = Mapping[str, torch.Tensor]


def flat_norm(tensors: State) -> float:
    """L2 norm of all tensors together, computed in float64."""
    total = sum(float(t.detach().double().pow(2).sum()) for t in tensors.values())
    return math.sqrt(total)


def check_finite(tensors: State, *, who: str) -> None:
    """Raise ``FloatingPointError`` naming the first tensor with NaN or inf."""
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise FloatingPointError(
                f"{who}: the update of tensor {name!r} contains NaN or inf; it is neither "
                "clipped nor sent (lower train.lr or check the data)"
            )


def difference(after: State, before: State) -> dict[str, torch.Tensor]:
    """Δ = after − before, tensor by tensor."""
    return {k: after[k] - before[k] for k in before}


def clip_factor(norm: float, bound: float) -> float:
    """min(1, C/‖Δ‖); 1 for a zero update."""
    if bound <= 0:
        raise ValueError(f"clipping bound must be > 0, got {bound}")
    return 1.0 if norm <= bound else bound / norm


def clip(delta: State, bound: float) -> tuple[dict[str, torch.Tensor], float]:
    """Δ scaled to norm at most ``bound``; also returns ‖Δ‖ before clipping."""
    norm = flat_norm(delta)
    factor = clip_factor(norm, bound)
    if factor == 1.0:
        return {k: v.clone() for k, v in delta.items()}, norm
    return {k: v * factor for k, v in delta.items()}, norm


def noise_generator(*, seed: int, client: int, round: int, step: int = 0) -> torch.Generator:
    """A generator seeded from (run seed, client, round, step): reproducible, never shared."""
    digest = hashlib.sha256(f"car-fl-dp:{seed}:{client}:{round}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def gaussian_noise(
    like: State, *, std: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """N(0, std²·I) with the shapes and dtypes of ``like``."""
    if std < 0:
        raise ValueError(f"noise standard deviation must be >= 0, got {std}")
    return {
        k: (torch.randn(v.shape, generator=generator, dtype=torch.float64) * std).to(v.dtype)
        for k, v in like.items()
    }


def privatize(
    before: State,
    after: State,
    *,
    bound: float,
    std: float,
    generator: torch.Generator,
    delta: State | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """θ + clip(θᵢ − θ, C) + N(0, std²·I); returns the release and ‖Δ‖ before clipping.

    When no clipping is needed the update is not recomputed (θ + (θᵢ − θ) may differ from θᵢ
    in the last bit), so a huge C with zero noise gives back θᵢ exactly. ``delta`` may be
    passed when the caller already computed θᵢ − θ.
    """
    delta = delta if delta is not None else difference(after, before)
    norm = flat_norm(delta)
    factor = clip_factor(norm, bound)
    if factor == 1.0:
        released = {k: v.detach().clone() for k, v in after.items()}
    else:
        released = {k: before[k] + delta[k] * factor for k in before}
    if std > 0:
        noise = gaussian_noise(released, std=std, generator=generator)
        released = {k: v + noise[k] for k, v in released.items()}
    return released, norm


# ------------------------------------------------------------------------------ adaptive rule


def sigma_b(num_clients: int) -> float:
    """σ_b = m / 20, the noise of the (conceptual) clipped-count estimate."""
    return num_clients / 20.0


def update_noise_multiplier(z: float, num_clients: int) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2); defined only for 0 < z < 2σ_b."""
    bound = 2.0 * sigma_b(num_clients)
    if not 0 < z < bound:
        raise ValueError(
            f"adaptive DP needs 0 < noise multiplier z < 2·σ_b = m/10 = {bound:g} with m = "
            f"{num_clients} clients, got z = {z:g}; lower dp.noise_multiplier below {bound:g} "
            f"or use more clients (fl.clients > {10 * z:g})"
        )
    return float((z**-2 - bound**-2) ** -0.5)


def smoothed_norm(previous: float | None, norm: float, decay: float) -> float:
    """EMA of ‖Δ‖: decay·previous + (1 − decay)·norm; the raw norm first, or with decay 0."""
    if previous is None or decay == 0:
        return norm
    return decay * previous + (1.0 - decay) * norm


def next_clip(clip_bound: float, norm: float, *, rate: float, target: float) -> float:
    """Cᵢ ← (1 − β)·Cᵢ + β·γ·‖Δ‖."""
    return (1.0 - rate) * clip_bound + rate * target * norm


def bound_noise_std(
    z_delta: float, clip_bound: float, norm: float, *, rate: float, target: float
) -> float:
    """Algorithm 1's variance bound as a standard deviation:
    sqrt(2·z_Δ²·((1 − β)²·Cᵢ² + β²·γ²·‖Δ‖²))."""
    return math.sqrt(
        2.0 * z_delta**2 * ((1 - rate) ** 2 * clip_bound**2 + rate**2 * target**2 * norm**2)
    )
