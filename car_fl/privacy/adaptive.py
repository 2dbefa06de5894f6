"""Adaptive clipping on one client, as pure functions: the private geometric rule and the paper's.

Private (``dp.adaptive_rule=geometric``, the local variant of Andrew et al. 2021):
    bᵢ = 1[‖Δ‖ ≤ Cᵢ],  b̃ᵢ = bᵢ + N(0, σ_b²),  Cᵢ ← Cᵢ·exp(−η_C·(b̃ᵢ − γ))
    The update is sent with noise z_Δ·Cᵢ, z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so update and
    indicator together cost exactly one Gaussian release of noise multiplier z (see
    :func:`car_fl.privacy.accountant.combined_multiplier`). Cᵢ is post-processing of b̃ᵢ.
Not private (``dp.adaptive_rule=linear``, the CaR paper): Cᵢ ← (1 − β)·Cᵢ + β·γ·‖Δ‖ moves
    with the raw norm, and so does the ``bound`` noise rule; both make ε = ∞.
"""

from __future__ import annotations

import math


def paper_sigma_b(num_clients: int) -> float:
    """σ_b = m / 20, the CaR paper's (and Andrew et al.'s) noise of the clipped-count."""
    return num_clients / 20.0


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2); 0 for z = 0; defined only for z < 2σ_b."""
    if z < 0 or sigma_b <= 0:
        raise ValueError(f"need z >= 0 and σ_b > 0, got z = {z:g}, σ_b = {sigma_b:g}")
    if z == 0:
        return 0.0
    if not z < 2.0 * sigma_b:
        raise ValueError(
            f"adaptive DP needs the noise multiplier z < 2·σ_b = {2 * sigma_b:g}, got z = {z:g} "
            "(the clipped-indicator release alone would cost more than the whole budget)"
        )
    return float((z**-2 - (2.0 * sigma_b) ** -2) ** -0.5)


def clipped_indicator(norm: float, bound: float) -> float:
    """bᵢ = 1 when the update was not clipped (‖Δ‖ ≤ Cᵢ), else 0."""
    return 1.0 if norm <= bound else 0.0


def geometric_clip(
    clip_bound: float, noised_indicator: float, *, lr: float, target: float
) -> float:
    """Cᵢ ← Cᵢ·exp(−η_C·(b̃ᵢ − γ)): shrinks when more than a fraction γ goes unclipped."""
    return clip_bound * math.exp(-lr * (noised_indicator - target))


def smoothed_norm(previous: float | None, norm: float, decay: float) -> float:
    """EMA of ‖Δ‖: decay·previous + (1 − decay)·norm; the raw norm first, or with decay 0."""
    if previous is None or decay == 0:
        return norm
    return decay * previous + (1.0 - decay) * norm


def linear_clip(clip_bound: float, norm: float, *, rate: float, target: float) -> float:
    """Cᵢ ← (1 − β)·Cᵢ + β·γ·‖Δ‖ (not private: uses the raw norm)."""
    return (1.0 - rate) * clip_bound + rate * target * norm


def bound_noise_std(
    z_delta: float, clip_bound: float, norm: float, *, rate: float, target: float
) -> float:
    """Algorithm 1's variance bound as a std (not private: uses the raw norm ‖Δ‖)."""
    return math.sqrt(
        2.0 * z_delta**2 * ((1 - rate) ** 2 * clip_bound**2 + rate**2 * target**2 * norm**2)
    )
