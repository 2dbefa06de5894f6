"""``dp=adaptive``: a node's update clipped to its own bound Cᵢ, which moves with a noised
clipped-indicator (Andrew et al. 2021), noised with z_Δ·Cᵢ."""

from __future__ import annotations

from typing import TYPE_CHECKING

from car_fl.privacy.accountant import combined_multiplier, indicator_multiplier
from car_fl.privacy.adaptive import paper_sigma_b, update_noise_multiplier
from car_fl.settings.choices import AdaptiveRule, DPMode, NoiseRule
from car_fl.settings.dp_modes.spec import ClientLevel

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig
    from car_fl.settings.schema import Settings


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
