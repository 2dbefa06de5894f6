"""Privacy spent: Rényi-DP accounting of Gaussian releases with dp-accounting.

The unit is one client's whole data (client-level DP, neighbouring = that data replaced).
A clipped update is a vector of sensitivity 2C (two clipped updates differ by at most 2C);
with noise standard deviation s its noise multiplier is s / (2C). The adaptive rule's
clipped-indicator bᵢ ∈ {0, 1} has sensitivity 1, so with noise σ_b its multiplier is σ_b.
Two Gaussian releases of one round compose exactly into one of multiplier
(μ₁⁻² + μ₂⁻²)^(−1/2). Releases compose over rounds (or steps); there is no subsampling
amplification (every client releases in every round). ε is reported at the configured δ.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Sensitivity of the clipped-indicator bᵢ ∈ {0, 1} when one client's data is replaced.
INDICATOR_SENSITIVITY = 1.0


def release_multiplier(noise_std: float, clip_bound: float) -> float:
    """Noise multiplier of one update release: std / sensitivity, with sensitivity 2C."""
    return noise_std / (2.0 * clip_bound)


def indicator_multiplier(sigma_b: float) -> float:
    """Noise multiplier of one noised clipped-indicator: σ_b / 1."""
    return sigma_b / INDICATOR_SENSITIVITY


def combined_multiplier(*multipliers: float) -> float:
    """The one Gaussian release equivalent to these together: (Σ μⱼ⁻²)^(−1/2); 0 if one is 0."""
    if not multipliers:
        raise ValueError("combined_multiplier needs at least one multiplier")
    if any(m <= 0 for m in multipliers):
        return 0.0
    return float(sum(m**-2 for m in multipliers) ** -0.5)


def epsilon(releases: Mapping[float, int], delta: float) -> float:
    """ε at δ after the given releases (noise multiplier → count); inf if one had no noise.

    A multiplier of 0 also stands for a release that is not private at all (the linear
    adaptive rule, the ``bound`` noise rule), so any such release makes ε infinite.
    """
    if not 0 < delta < 1:
        raise ValueError(f"dp.delta must be in (0, 1), got {delta}")
    if not releases or sum(releases.values()) == 0:
        return 0.0
    if any(m <= 0 for m, count in releases.items() if count > 0):
        return float("inf")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for multiplier, count in releases.items():
        if count > 0:
            accountant.compose(
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(multiplier), count)
            )
    return float(accountant.get_epsilon(delta))


def noise_multiplier_for(target_epsilon: float, *, releases: int, delta: float) -> float:
    """The σ₀ (or z) whose ``releases`` rounds spend ``target_epsilon`` at δ.

    Each round is one Gaussian release of multiplier σ₀/2 (fixed clipping, or the private
    adaptive rule's update and indicator together); calibrated by dp-accounting.
    """
    if not target_epsilon > 0 or releases < 1:
        raise ValueError(f"need target ε > 0 and releases >= 1, got {target_epsilon}, {releases}")
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    def rounds(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(sigma / 2.0), releases
        )

    return float(
        dp_accounting.calibrate_dp_mechanism(RdpAccountant, rounds, target_epsilon, delta, tol=1e-6)
    )
