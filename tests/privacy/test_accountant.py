"""car_fl.privacy.accountant: heterogeneous releases composed into one lifetime ε."""

from __future__ import annotations

import math
import time

import dp_accounting
import pytest
from dp_accounting import pld

from car_fl.privacy.accountant import (
    MECHANISM,
    VALUE_DISCRETIZATION,
    Accountant,
    Release,
    ReleaseKind,
    grouped,
    non_private_count,
)
from car_fl.privacy.accountant import epsilon as gaussian_epsilon
from car_fl.privacy.accountant import private_epsilon as epsilon
from car_fl.privacy.record_accounting import epsilon as record_epsilon

GAUSSIAN, DPSGD, NONE = ReleaseKind.GAUSSIAN, ReleaseKind.DPSGD, ReleaseKind.NON_PRIVATE


def pld_epsilon(event: dp_accounting.DpEvent, relation: object, delta: float = 1e-5) -> float:
    accountant = pld.PLDAccountant(relation, value_discretization_interval=VALUE_DISCRETIZATION)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def test_a_gaussian_release_costs_what_client_level_accounting_says() -> None:
    # Client-level accounting: multiplier μ = σ₀/2 w.r.t. sensitivity 2C, add-or-remove style
    # (sensitivity 1). Replace-one reads GaussianDpEvent(s) with sensitivity 2: the same
    # release is GaussianDpEvent(2μ) there, and must cost exactly the same ε.
    mu, k = 0.6, 4
    ours = epsilon([Release(GAUSSIAN, k, noise_multiplier=mu)], 1e-5)
    reference = pld_epsilon(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(mu), k),
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    assert ours == pytest.approx(reference, rel=1e-3)


def test_dpsgd_steps_cost_what_record_accounting_says() -> None:
    steps = Release(DPSGD, 120, noise_multiplier=1.3, sample_rate=0.1)
    ours = epsilon([steps], 1e-5)
    assert ours == pytest.approx(
        record_epsilon(sample_rate=0.1, noise_multiplier=1.3, steps=120, delta=1e-5), rel=1e-9
    )


def test_mixed_releases_compose_in_one_replace_one_accountant() -> None:
    releases = [
        Release(DPSGD, 50, noise_multiplier=2.0, sample_rate=0.1),
        Release(GAUSSIAN, 3, noise_multiplier=1.5),
        Release(DPSGD, 50, noise_multiplier=2.0, sample_rate=0.1),
    ]
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.0)), 100
            ),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 3),
        ]
    )
    reference = pld_epsilon(event, dp_accounting.NeighboringRelation.REPLACE_ONE)
    assert epsilon(releases, 1e-5) == pytest.approx(reference, rel=1e-6)
    # more releases never cost less; order does not matter
    assert epsilon(releases[:2], 1e-5) < epsilon(releases, 1e-5)
    assert epsilon(list(reversed(releases)), 1e-5) == epsilon(releases, 1e-5)


def test_non_private_releases_are_counted_apart_and_empty_is_zero() -> None:
    assert epsilon([], 1e-5) == 0.0
    releases = [Release(NONE, 2), Release(GAUSSIAN, 1, noise_multiplier=1.0), Release(NONE, 1)]
    assert non_private_count(releases) == 3
    assert epsilon(releases, 1e-5) == epsilon(releases[1:2], 1e-5)
    assert epsilon([Release(NONE, 5)], 1e-5) == 0.0


@pytest.mark.slow
def test_grouping_makes_a_long_ledger_cheap() -> None:
    many = [Release(GAUSSIAN, 1, noise_multiplier=1.0) for _ in range(2000)]
    assert grouped(many) == [Release(GAUSSIAN, 2000, noise_multiplier=1.0)]
    tick = time.perf_counter()
    value = epsilon(many, 1e-5)
    # grouped: one composition of 2,000 steps; 15 s bounds it on a loaded 2-core machine
    assert time.perf_counter() - tick < 15.0 and math.isfinite(value)


def test_the_accountant_steps_saves_and_refuses_another_mechanisms_state() -> None:
    accountant = Accountant()
    assert accountant.get_epsilon(1e-5) == 0.0
    accountant.step(kind="gaussian", noise_multiplier=1.5, count=3)
    accountant.step(kind="dpsgd", noise_multiplier=2.0, sample_rate=0.1, count=100)
    accountant.step(kind=GAUSSIAN, noise_multiplier=1.5)
    assert accountant.history == grouped(
        [
            Release(GAUSSIAN, 4, noise_multiplier=1.5),
            Release(DPSGD, 100, noise_multiplier=2.0, sample_rate=0.1),
        ]
    )
    assert len(accountant) == 104
    value = accountant.get_epsilon(1e-5)
    assert value == epsilon(accountant.history, 1e-5) and 0 < value < math.inf
    again = Accountant()
    again.load_state_dict(accountant.state_dict())
    assert again.get_epsilon(1e-5) == value
    assert accountant.would_spend(1e-5, Release(GAUSSIAN, 1, noise_multiplier=1.5)) > value
    assert accountant.get_epsilon(1e-5) == value  # would_spend adds nothing
    state = {**accountant.state_dict(), "mechanism": "rdp"}
    with pytest.raises(ValueError, match="mechanism 'rdp'"):
        Accountant().load_state_dict(state)
    assert accountant.state_dict()["mechanism"] == MECHANISM
    accountant.step(kind=NONE)  # no noise: not private, the run's ε is infinite
    assert accountant.get_epsilon(1e-5) == math.inf
    assert epsilon(accountant.history, 1e-5) == value  # a ledger counts it apart


def test_local_dp_figures_are_the_accountants_and_tighter_than_renyi_dp() -> None:
    from dp_accounting.rdp import RdpAccountant

    mu, k = 0.5, 5
    ours = gaussian_epsilon({mu: k}, 1e-5)
    assert ours == Accountant([Release(GAUSSIAN, k, noise_multiplier=mu)]).get_epsilon(1e-5)
    rdp = RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(mu), k))
    assert ours < rdp.get_epsilon(1e-5)  # RDP's conversion to (ε, δ) is looser
    assert math.isinf(gaussian_epsilon({0.0: 1}, 1e-5)) and gaussian_epsilon({}, 1e-5) == 0.0


def test_little_noise_is_accounted_in_bounded_memory_and_time_as_a_valid_upper_bound() -> None:
    """A server chooses σ: DP-SGD steps of σ = 0.01 would need a PLD grid of gigabytes (the
    reviewer's MemoryError under 1.5 GiB). They are bounded by the Gaussian without sampling."""
    tick = time.perf_counter()
    small = epsilon([Release(DPSGD, 1, noise_multiplier=0.01, sample_rate=1.0)], 1e-5)
    assert small == gaussian_epsilon_of(0.01 / 2) and time.perf_counter() - tick < 2.0
    # above the floor the PLD stays: q = 1 steps are exactly the Gaussian (within 0.1 %)
    exact = epsilon([Release(DPSGD, 4, noise_multiplier=0.5, sample_rate=1.0)], 1e-5)
    assert exact == pytest.approx(gaussian_epsilon_of(0.5 / 2 / 2), rel=2e-3)
    # the bound is never below what the PLD gives where both run
    sampled = Release(DPSGD, 10, noise_multiplier=0.12, sample_rate=0.1)
    bound = gaussian_epsilon_of(0.12 / 2 / math.sqrt(10))
    assert epsilon([sampled], 1e-5) <= bound


def gaussian_epsilon_of(mu: float) -> float:
    from car_fl.privacy.accountant import gaussian_epsilon

    return gaussian_epsilon(mu, 1e-5)


def test_extreme_multipliers_give_a_figure_or_a_clear_error_not_a_crash() -> None:
    assert epsilon([Release(GAUSSIAN, 3, noise_multiplier=1e200)], 1e-5) == 0.0
    assert epsilon([Release(GAUSSIAN, 3, noise_multiplier=1e-9)], 1e-5) == math.inf
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match=r"finite|> 0"):
            Release(GAUSSIAN, 1, noise_multiplier=bad)


def test_a_dpsgd_step_must_say_it_is_one() -> None:
    """Opacus's step(noise_multiplier, sample_rate=1) read as a Gaussian release's μ would
    credit twice the noise; the kind is required."""
    accountant = Accountant()
    with pytest.raises(TypeError):
        accountant.step(noise_multiplier=1.0, sample_rate=1.0)  # type: ignore[call-arg]
    accountant.step(kind="dpsgd", noise_multiplier=1.0, sample_rate=1.0)
    assert accountant.get_epsilon(1e-5) == pytest.approx(
        record_epsilon(sample_rate=1.0, noise_multiplier=1.0, steps=1, delta=1e-5)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": GAUSSIAN, "count": 1, "noise_multiplier": 0.0}, "non-private"),
        ({"kind": DPSGD, "count": 1, "noise_multiplier": 1.0, "sample_rate": 0.0}, "(0, 1]"),
        ({"kind": GAUSSIAN, "count": -1, "noise_multiplier": 1.0}, ">= 0"),
    ],
)
def test_impossible_releases_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re_escape(message)):
        Release(**kwargs)  # type: ignore[arg-type]


def test_a_release_round_trips_through_its_dict() -> None:
    release = Release(DPSGD, 7, noise_multiplier=1.1, sample_rate=0.05)
    assert Release.from_dict(release.to_dict()) == release


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
