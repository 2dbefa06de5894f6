"""Privacy spent: Rényi-DP accounting of Gaussian releases with dp-accounting.

Each release is a Gaussian mechanism on a vector of sensitivity 2C (two clipped updates differ
by at most 2C), with noise standard deviation s, so its noise multiplier is s / (2C). Releases
compose over rounds (or steps); there is no subsampling amplification (every client releases
in every round). ε is reported at the configured δ.
"""

from __future__ import annotations

from collections.abc import Mapping


def release_multiplier(noise_std: float, clip_bound: float) -> float:
    """Noise multiplier of one release: std / sensitivity, with sensitivity 2C."""
    return noise_std / (2.0 * clip_bound)


def epsilon(releases: Mapping[float, int], delta: float) -> float:
    """ε at δ after the given releases (noise multiplier → count); inf if one had no noise."""
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
