"""car_fl.client.policy: the owner's policy file, validated, and what it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from car_fl.client.policy import NodePolicy, PolicyError
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import DPMode

FULL = """\
# the owner of this node accepts record-level DP only
modes = ["record"]
min-noise-multiplier = 1.0
max-clip = 2.0
max-delta = 1e-4
allow-warmup = false
lifetime-epsilon = 30
ledger = "my-ledger"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_full_policy_reads_back_with_its_ledger_beside_it(tmp_path: Path) -> None:
    policy = NodePolicy.load(write(tmp_path, FULL))
    assert policy.modes == frozenset({DPMode.RECORD})
    assert (policy.min_noise_multiplier, policy.max_clip, policy.max_delta) == (1.0, 2.0, 1e-4)
    assert policy.allow_warmup is False and policy.lifetime_epsilon == 30.0
    assert policy.ledger == tmp_path / "my-ledger"


def test_defaults_are_the_strict_ones(tmp_path: Path) -> None:
    policy = NodePolicy.load(write(tmp_path, 'modes = ["fixed"]\n'))
    assert policy.min_noise_multiplier == 0.0 and math.isinf(policy.max_clip)
    assert policy.max_delta == 1e-5 and policy.allow_warmup is False
    assert policy.lifetime_epsilon is None and policy.ledger == tmp_path / "ledger"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("min-noise-multiplier = 1\n", r"'modes' is missing"),
        ('modes = ["record"]\nmax-clip = "big"\n', r"line 2, 'max-clip': must be a number"),
        ('modes = ["record"]\n\nmax-clip = 0\n', r"line 3, 'max-clip': must be in \(0, inf\]"),
        ('modes = ["record"]\nmax-delta = 1\n', r"line 2, 'max-delta': must be in \(0, 1\)"),
        ('modes = ["record"]\nmax_clip = 1\n', r"line 2, 'max_clip': unknown key.*max-clip"),
        ('modes = ["recrod"]\n', r"line 1, 'modes': unknown mode 'recrod'; valid: none, fixed"),
        ("modes = []\n", r"line 1, 'modes': must be a non-empty list"),
        ('modes = ["fixed"]\nallow-warmup = 1\n', r"line 2, 'allow-warmup': must be true or"),
        ('modes = ["fixed"]\nlifetime-epsilon = -3\n', r"'lifetime-epsilon': must be in \(0"),
        ('modes = ["fixed"]\nlifetime-unnoised-rounds = 1.5\n', r"must be a whole number >= 0"),
        ('modes = ["fixed"]\nlifetime-unnoised-rounds = true\n', r"must be a whole number >= 0"),
        ('modes = ["fixed"]\nlifetime-unnoised-rounds = -1\n', r"line 2, 'lifetime-unnoised"),
        ('modes = ["fixed"\n', r"not valid TOML"),
    ],
)
def test_bad_policies_name_the_file_line_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=message) as err:
        NodePolicy.load(path)
    assert str(path) in str(err.value)


def test_a_missing_policy_file_says_where_it_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"nowhere.toml: cannot be read.*privacy-policy="):
        NodePolicy.load(tmp_path / "nowhere.toml")


POLICY = NodePolicy(
    modes=frozenset({DPMode.RECORD, DPMode.FIXED}),
    min_noise_multiplier=1.0,
    max_clip=1.0,
    max_delta=1e-5,
)


@pytest.mark.parametrize(
    ("overrides", "found"),
    [
        ("dp=none", "dp=none is not among the accepted modes (fixed, record)"),
        ("dp=adaptive", "dp=adaptive is not among the accepted modes"),
        ("dp=fixed dp.noise_multiplier=0.5", "noise multiplier 0.5 is below"),
        ("dp=fixed dp.noise_multiplier=1e-8", "below min-noise-multiplier 1"),
        ("dp=fixed dp.noise_multiplier=2 dp.clip=1e6", "dp.clip=1e+06 is above max-clip 1"),
        ("dp=fixed dp.noise_multiplier=2 dp.delta=1e-3", "dp.delta=0.001 is above max-delta"),
        ("dp=fixed dp.noise_multiplier=2 dp.warmup_rounds=1", "allow-warmup is false"),
        # a raised target: σ calibrated for ε = 20 (0.58) is below the floor (a larger ε
        # calibrates for seconds: the accountant is slow at small σ)
        ("dp=record dp.target_epsilon=20", "below min-noise-multiplier"),
        # code from the model's repository would run beside the data and the ledger
        ("dp=fixed dp.noise_multiplier=2 model.trust_remote_code=true", "trust_remote_code"),
        # DP-SGD divides by q·n: without a public n the update's scale follows the data
        (
            "dp=record dp.target_epsilon=3 dp.sample_rate=0.1",
            "dp=record without fl.max_examples_per_client",
        ),
    ],
)
def test_weaker_runs_are_refused_with_every_reason(overrides: str, found: str) -> None:
    violations = POLICY.violations(load_settings(overrides))
    assert any(found in v for v in violations), violations


@pytest.mark.parametrize(
    "overrides",
    [
        "dp=fixed dp.noise_multiplier=1",
        "dp=record dp.target_epsilon=3 dp.sample_rate=0.1 fl.max_examples_per_client=1000 "
        "dataset.split=hash fl.partitioning=hash",
    ],
)
def test_the_agreed_configurations_are_accepted(overrides: str) -> None:
    assert POLICY.violations(load_settings(overrides)) == []


@pytest.mark.parametrize(
    ("placement", "refused"),
    [
        ("", True),
        ("dataset.split=hash", True),  # the partition still places records by the others
        ("dataset.split=hash fl.partitioning=hash", False),
    ],
)
def test_record_level_dp_on_a_shared_file_needs_the_hash_placement(
    placement: str, refused: bool
) -> None:
    """One record added to a shared file moved 450 of 1,000 others across splits and shards
    (tests/data/test_splits.py): DP-SGD's unit, one record, did not hold for such a node. A
    node that holds its own shard (data-is-shard) reads it whole and needs nothing."""
    record = "dp=record dp.target_epsilon=3 dp.sample_rate=0.1 fl.max_examples_per_client=1000"
    settings = load_settings(f"{record} {placement}")
    found = [v for v in POLICY.violations(settings) if "needs dataset.split=hash" in v]
    assert bool(found) is refused
    assert POLICY.violations(settings, shared_file=False) == []
    with pytest.raises(ValueError, match=r"set dataset\.split=hash too"):  # shards by hash alone
        load_settings(f"{record} fl.partitioning=hash")


def test_non_private_rules_need_none_among_the_modes() -> None:
    adaptive = NodePolicy(modes=frozenset({DPMode.ADAPTIVE}))
    linear = load_settings("dp=adaptive dp.adaptive_rule=linear")
    assert any("not private" in v for v in adaptive.violations(linear))
    assert adaptive.violations(load_settings("dp=adaptive")) == []
    anything = NodePolicy(modes=frozenset(DPMode), allow_warmup=True)
    assert anything.violations(linear) == []
    assert anything.violations(load_settings("dp=fixed dp.noise_multiplier=0")) == []


def test_a_round_of_too_many_dp_steps_is_refused_before_any_accounting() -> None:
    """Issue 41: dp.sample_rate=1e-7 was accepted and planned 10⁷ DP-SGD steps a round (a
    denial of service through the node's one worker). The policy bounds the steps a round may
    plan (max-steps-per-round), from the settings alone, before σ is calibrated."""
    import time

    settings = load_settings(
        "dp=record dp.target_epsilon=3 dp.sample_rate=1e-5 fl.max_examples_per_client=1000 "
        "fl.local_epochs=2 fl.rounds=1"
    )
    tick = time.perf_counter()
    violations = POLICY.violations(settings)
    assert time.perf_counter() - tick < 1.0  # no accountant ran
    assert any("plans 200,000 DP steps" in v and "max-steps-per-round" in v for v in violations)
    owner = NodePolicy(modes=frozenset({DPMode.FIXED}), max_steps_per_round=10)
    per_step = load_settings(
        "dp=fixed dp.noise_multiplier=1 dp.granularity=step fl.max_examples_per_client=100"
    )
    assert any("max-steps-per-round 10" in v for v in owner.violations(per_step))


def test_a_plan_of_more_steps_than_the_accountant_can_compose_in_seconds_is_refused() -> None:
    from car_fl.privacy.record_accounting import MAX_PLANNED_STEPS, record_plan

    with pytest.raises(ValueError, match=r"dp.sample_rate=1e-07 plans .* more than"):
        record_plan(
            sample_rate=1e-7,
            noise_multiplier=1.0,
            clip=1.0,
            delta=1e-5,
            target_epsilon=3.0,
            rounds=1,
            local_epochs=1,
        )
    assert MAX_PLANNED_STEPS <= 10**7


def test_an_owner_can_require_protection_of_the_shards_mix_not_only_of_records(
    tmp_path: Path,
) -> None:
    """Issue 41: a curious server learns a shard's label mix from a record-level DP-SGD reply
    (it protects single records, not the mix); protect = "mix" accepts client-level DP only."""
    text = 'modes = ["record", "fixed"]\nprotect = "mix"\n'
    policy = NodePolicy.load(write(tmp_path, text))
    record = "dp=record dp.target_epsilon=3 dp.sample_rate=0.1 fl.max_examples_per_client=1000"
    assert any('protect = "mix"' in v for v in policy.violations(load_settings(record)))
    assert policy.violations(load_settings("dp=fixed dp.noise_multiplier=1")) == []
    with pytest.raises(PolicyError, match=r"'protect': must be one of records, mix"):
        NodePolicy.load(write(tmp_path, 'modes = ["fixed"]\nprotect = "everything"\n'))
