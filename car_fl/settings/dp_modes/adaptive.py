"""``dp=adaptive``: a node's update clipped to its own bound Cᵢ, which moves with a noised
clipped-indicator (Andrew et al. 2021), noised with z_Δ·Cᵢ; the mode and its rules, as pure
functions (no torch: the settings check them).

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
from typing import TYPE_CHECKING

from car_fl.privacy.accountant import combined_multiplier, indicator_multiplier
from car_fl.settings.choices import AdaptiveRule, DPMode, NoiseRule
from car_fl.settings.dp_modes.spec import ClientLevel

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig
    from car_fl.settings.schema import Settings


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


def sigma_b(dp: DPConfig, num_clients: int) -> float:
    """σ_b: ``dp.count_noise``, or the paper's m/20 when it is null."""
    return dp.count_noise if dp.count_noise is not None else paper_sigma_b(num_clients)


class Adaptive(ClientLevel):
    mode = DPMode.ADAPTIVE
    report_name = "FL + DP (adaptive)"
    moves_clip = True

    def check(self, dp: DPConfig) -> None:
        if dp.adaptive_rule is AdaptiveRule.GEOMETRIC and dp.ema_decay:
            raise ValueError(
                f"dp.ema_decay={dp.ema_decay} smooths the raw norms of the non-private linear "
                "rule only; set dp.ema_decay=0 (or dp.adaptive_rule=linear)"
            )

    def check_settings(self, settings: Settings) -> None:
        z, m, dp = settings.dp.noise_multiplier, settings.fl.clients, settings.dp
        bound = sigma_b(dp, m)
        if not z < 2 * bound:
            where = (
                f"dp.count_noise = {bound:g}"
                if dp.count_noise is not None
                else (f"m/20 with m = fl.clients = {m}")
            )
            raise ValueError(
                f"adaptive DP needs dp.noise_multiplier z < 2·σ_b = {2 * bound:g} "
                f"(σ_b = {where}), got z = {z:g}; lower dp.noise_multiplier or raise "
                f"dp.count_noise above {z / 2:g}"
            )

    def non_private_reason(self, dp: DPConfig) -> str | None:
        if dp.noise_multiplier == 0:
            return super().non_private_reason(dp)
        if dp.adaptive_rule is AdaptiveRule.LINEAR:
            return "dp.adaptive_rule=linear moves the clipping bound with the raw update norm"
        if dp.noise_rule is NoiseRule.BOUND:
            return "dp.noise_rule=bound sets the noise from the raw update norm"
        return None

    def update_multiplier(self, dp: DPConfig, num_clients: int) -> float:
        """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the clipped-indicator takes the rest of z's budget."""
        return update_noise_multiplier(dp.noise_multiplier, sigma_b(dp, num_clients))

    def multiplier(self, dp: DPConfig, num_clients: int) -> float:
        """The update (z_Δ/2) and the clipped-indicator (σ_b) composed into one Gaussian."""
        update = self.update_multiplier(dp, num_clients) / 2.0
        return combined_multiplier(update, indicator_multiplier(sigma_b(dp, num_clients)))
