"""Record-level DP accounting: DP-SGD's plan, its ε, and σ calibrated for a target ε.

Each step is one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` under replace-one (a reply
carries n un-noised), composed by :class:`car_fl.privacy.accountant.Accountant`. σ is found by
bisection, like Opacus's ``get_noise_multiplier`` (Opacus is not a dependency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from car_fl.privacy.accountant import (
    Accountant,
    Release,
    ReleaseKind,
    check_delta,
    check_sample_rate,
)

#: Beyond this noise multiplier a target ε is treated as unreachable (the model learns nothing).
MAX_NOISE_MULTIPLIER = 100.0
#: A calibrated σ gives ε in [target · (1 − CALIBRATION_TOLERANCE), target].
CALIBRATION_TOLERANCE = 0.005


def _check(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> None:
    check_sample_rate(sample_rate)
    if not noise_multiplier > 0:
        raise ValueError(f"dp.noise_multiplier (σ) must be > 0, got {noise_multiplier}")
    if steps < 0:
        raise ValueError(f"the number of DP-SGD steps must be >= 0, got {steps}")
    check_delta(delta)


def epsilon(*, sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """ε at δ after ``steps`` Poisson-sampled Gaussian steps."""
    _check(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps, delta=delta)
    if steps == 0:
        return 0.0
    step = Release(
        ReleaseKind.DPSGD, steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate
    )
    return Accountant([step]).get_epsilon(delta)


@lru_cache(maxsize=256)
def calibrate_noise_multiplier(
    *, target_epsilon: float, sample_rate: float, steps: int, delta: float
) -> float:
    """The smallest σ (to within :data:`CALIBRATION_TOLERANCE` in ε) whose ε ≤ the target;
    ``ValueError`` naming the smallest reachable ε when even :data:`MAX_NOISE_MULTIPLIER` fails."""
    if not target_epsilon > 0:
        raise ValueError(f"dp.target_epsilon must be > 0, got {target_epsilon}")
    if steps < 1:
        raise ValueError(f"cannot calibrate σ for {steps} planned steps")

    def eps(sigma: float) -> float:
        return epsilon(sample_rate=sample_rate, noise_multiplier=sigma, steps=steps, delta=delta)

    floor = eps(MAX_NOISE_MULTIPLIER)
    if floor > target_epsilon:
        raise ValueError(
            f"dp.target_epsilon={target_epsilon:g} cannot be reached in {steps} planned DP-SGD "
            f"steps (q = {sample_rate:g}, δ = {delta:g}) with a noise multiplier up to "
            f"{MAX_NOISE_MULTIPLIER:g}; the smallest reachable is ε ≈ {floor:.3g}: set "
            f"dp.target_epsilon={_round_up(floor)} or plan fewer steps (fl.rounds, "
            "fl.local_epochs, or a larger dp.sample_rate)"
        )
    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:  # bracket: ε(low) > target >= ε(high)
        low, high = high, 2 * high
    while True:
        if eps(high) >= target_epsilon * (1 - CALIBRATION_TOLERANCE) or high - low < 1e-6:
            return high
        middle = (low + high) / 2
        if eps(middle) > target_epsilon:
            low = middle
        else:
            high = middle


def _round_up(value: float) -> str:
    """A value slightly above ``value``, written short (for error messages)."""
    digits = max(0, 2 - math.floor(math.log10(abs(value)))) if value > 0 else 2
    return f"{math.ceil(value * 10**digits) / 10**digits:g}"


def steps_per_epoch(sample_rate: float) -> int:
    """Poisson-sampled steps that make one expected pass over the data: ⌈1/q⌉."""
    check_sample_rate(sample_rate)
    return math.ceil(1 / sample_rate - 1e-9)


@dataclass(frozen=True)
class RecordPlan:
    """A client's DP-SGD schedule and noise, fixed before training from the configuration."""

    sample_rate: float
    noise_multiplier: float
    clip: float
    steps_per_round: int
    rounds: int
    delta: float
    target_epsilon: float | None

    @property
    def planned_steps(self) -> int:
        return self.rounds * self.steps_per_round

    def epsilon(self, steps: int) -> float:
        return epsilon(
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            steps=steps,
            delta=self.delta,
        )


#: The most DP-SGD steps one run may plan (the accountant takes ~13 s for 10⁷ steps).
MAX_PLANNED_STEPS = 1_000_000


def record_plan(
    *,
    sample_rate: float,
    noise_multiplier: float,
    clip: float,
    delta: float,
    target_epsilon: float | None,
    rounds: int,
    local_epochs: int,
) -> RecordPlan:
    """σ, q and the planned steps (rounds × local_epochs × ⌈1/q⌉) of record-level DP-SGD; with
    ``target_epsilon`` σ is calibrated to spend at most it (``noise_multiplier`` unused)."""
    per_round = local_epochs * steps_per_epoch(sample_rate)
    if rounds * per_round > MAX_PLANNED_STEPS:  # before any accounting: it would take minutes
        raise ValueError(
            f"dp.sample_rate={sample_rate:g} plans {rounds * per_round:,} DP-SGD steps "
            f"(fl.rounds x fl.local_epochs x 1/q), more than {MAX_PLANNED_STEPS:,}; raise "
            "dp.sample_rate (e.g. dp.sample_rate=0.05)"
        )
    if target_epsilon is not None:
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            sample_rate=sample_rate,
            steps=rounds * per_round,
            delta=delta,
        )
    else:
        sigma = noise_multiplier
    _check(sample_rate=sample_rate, noise_multiplier=sigma, steps=per_round, delta=delta)
    return RecordPlan(
        sample_rate=sample_rate,
        noise_multiplier=sigma,
        clip=clip,
        steps_per_round=per_round,
        rounds=rounds,
        delta=delta,
        target_epsilon=target_epsilon,
    )


def trained_cap(delta: float) -> int:
    """The most examples one DP-SGD round trains on: ⌈1/δ⌉ − 1, so δ < 1/n holds. A node with
    more trains on a random subset instead of failing, which would tell the server about n."""
    check_delta(delta)
    return max(1, math.ceil(1 / delta - 1e-9) - 1)
