"""Adversary tests of the node's policy and ledger after the DP-mode registry refactor.

A malicious server chooses the run config (every setting), the round numbers and the runs;
what the node's owner set in its policy file must hold whatever it sends. Each test here plays
one such server against the real :class:`~car_fl.client.node.Node` round, policy and ledger.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.failures import Refusal
from car_fl.client.node import Node
from car_fl.client.node_privacy import NodePrivacy
from car_fl.model.retriever import build_retriever
from car_fl.protocol.failures import Failure
from car_fl.settings.compose import NodeInfo

NODE = NodeInfo(partition_id=0, num_partitions=2)
LABELS = [f"topic{i}" for i in range(4)]
#: What every test's run shares besides its DP settings.
BASE = ("fl.rounds=2", "fl.local_epochs=1", "dp.clip=1")


def open_policy(tmp_path: Path, data: Path, text: str) -> NodePrivacy:
    policy = tmp_path / "policy.toml"
    policy.write_text(text, encoding="utf-8")
    return NodePrivacy.open(policy, data)


def initial(settings) -> dict[str, torch.Tensor]:
    return build_retriever(settings, 4, hidden_size=64).trainable_state_dict()


def round_of(settings, node_privacy: NodePrivacy, server_round: int, run: str = "1"):
    global_state = initial(settings)
    state, metrics = Node(config={}, privacy=node_privacy).train(
        settings, NODE, global_state, server_round, RecordDict(), LABELS, run=run
    )
    return global_state, state, metrics


def refused(settings, node_privacy: NodePrivacy) -> Refusal:
    """The refusal of round 1 of ``settings`` by the node (fails the test when it trains)."""
    with pytest.raises(Refusal) as err:
        round_of(settings, node_privacy, 1)
    return err.value


@pytest.mark.parametrize(
    "weak",
    [
        ("dp=fixed", "dp.noise_multiplier=5e-324"),  # σ₀/2 rounds to 0: accounted non-private
        ("dp=fixed", "dp.noise_multiplier=1e-100"),
        ("dp=fixed", "dp.noise_multiplier=1e-200"),  # its μ⁻² overflows a float
        ("dp=adaptive", "dp.noise_multiplier=1e-150"),
        ("dp=record", "dp.target_epsilon=null", "dp.noise_multiplier=1e-12", "dp.sample_rate=0.25"),
    ],
    ids=["fixed-subnormal", "fixed-tiny", "fixed-overflow", "adaptive-tiny", "record-tiny"],
)
def test_a_policy_without_none_refuses_a_release_accounted_at_infinite_epsilon(
    tmp_path: Path, make_settings, synthetic_tsv: Path, weak: tuple[str, ...]
) -> None:
    """``modes`` without ``none``: the owner accepts no release without a guarantee. A σ that
    is not 0 but too small for any (ε = ∞ in the node's own accountant and ledger) is refused
    before the ledger, whatever the owner's ``min-noise-multiplier`` (0 by default)."""
    node_privacy = open_policy(
        tmp_path,
        synthetic_tsv,
        'modes = ["fixed", "adaptive", "record"]\nlifetime-epsilon = 10\n[data]\nsplit = "hash"\n',
    )
    settings = make_settings(
        *weak, *BASE, "dataset.split=hash", "fl.partitioning=hash", "fl.max_examples_per_client=500"
    )
    err = refused(settings, node_privacy)
    assert err.failure is Failure.POLICY_REFUSED and "ε = ∞" in str(err), err
    assert node_privacy.ledger.entries() == []  # refused before any charge


def test_a_target_epsilon_of_infinity_is_refused_by_the_settings(make_settings) -> None:
    """dp.target_epsilon=inf would calibrate DP-SGD's σ down to ~1e-5 (``inf > 0`` passed)."""
    with pytest.raises(ValueError, match=r"dp\.target_epsilon must be > 0 and finite"):
        make_settings("dp=record", "dp.target_epsilon=inf", *BASE)


def test_warmup_rounds_covering_the_whole_run_are_refused(make_settings) -> None:
    """dp=fixed with dp.warmup_rounds >= fl.rounds is dp=none under another name: every round
    un-noised, and non-private releases are kept out of a lifetime ε, so no cap would stop it.
    The settings refuse it, on the server and on every node (which composes them itself)."""
    with pytest.raises(ValueError, match=r"covers all fl\.rounds=2: no round would be private"):
        make_settings("dp=fixed", "dp.noise_multiplier=2", "dp.warmup_rounds=2", *BASE)
    assert make_settings("dp=fixed", "dp.warmup_rounds=1", *BASE).dp.warmup_rounds == 1


def test_a_warmup_round_is_refused_under_public_example_count(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """A warm-up round's reply carries the node's true n (and an un-noised update), as dp=none's
    does, which ``public-example-count = true`` (the default) refuses; ``allow-warmup`` alone
    does not lift it. With the count not public, the warm-up round trains."""
    policy = 'modes = ["fixed"]\nmin-noise-multiplier = 1.0\nallow-warmup = true\n'
    settings = make_settings("dp=fixed", "dp.noise_multiplier=2", "dp.warmup_rounds=1", *BASE)
    err = refused(settings, open_policy(tmp_path, synthetic_tsv, policy))
    assert err.failure is Failure.POLICY_REFUSED and "public-example-count" in str(err)
    public = open_policy(tmp_path, synthetic_tsv, policy + "public-example-count = false\n")
    _, _, metrics = round_of(settings, public, 1)
    assert metrics["num-examples"] > 1  # the node's own n, as its owner accepted


@pytest.mark.parametrize("mode", ["fixed", "none"])
def test_un_noised_rounds_are_bounded_over_the_nodes_lifetime_not_per_run(
    tmp_path: Path, make_settings, synthetic_tsv: Path, mode: str
) -> None:
    """``allow-warmup`` (or ``none`` among the modes) lets each run send un-noised rounds; a
    server starting run after run would get as many as it likes. ``lifetime-unnoised-rounds``
    bounds them over all runs, in the ledger: here 3, at one un-noised round per run (a
    warm-up round, or a dp=none round). A run planning more than the bound is refused first."""
    policy = (
        f'modes = ["{mode}"]\nallow-warmup = true\npublic-example-count = false\n'
        "lifetime-unnoised-rounds = 3\n"
    )
    node_privacy = open_policy(tmp_path, synthetic_tsv, policy)
    dp = ("dp=fixed", "dp.noise_multiplier=2", "dp.warmup_rounds=1") if mode == "fixed" else ()
    settings = make_settings(*dp, *BASE)
    for run in ("1", "2", "3"):
        round_of(settings, node_privacy, 1, run=run)
    with pytest.raises(Refusal) as exhausted:
        round_of(settings, node_privacy, 1, run="4")
    assert exhausted.value.failure is Failure.BUDGET_EXHAUSTED, exhausted.value
    assert "lifetime-unnoised-rounds 3" in str(exhausted.value)
    assert len(node_privacy.ledger.entries()) == 3  # the refused round was not recorded
    planned = 4 if dp else 5  # dp=none: every round
    longer = make_settings(*dp, *BASE, "fl.rounds=5", f"dp.warmup_rounds={4 if dp else 0}")
    refusal = refused(longer, node_privacy)  # from the settings alone, whatever the ledger holds
    assert refusal.failure is Failure.POLICY_REFUSED, refusal
    assert f"plans {planned} un-noised rounds, above lifetime-unnoised-rounds 3" in str(refusal)


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        (("dp=fixed", "dp.mode=RECORD", "dp.noise_multiplier=1"), "record"),  # enum name
        (("dp=fixed", "dp.mode=DPMode.RECORD", "dp.noise_multiplier=1"), "record"),
        (("dp=record", "dp.mode=fixed", "dp.noise_multiplier=2"), "fixed"),  # record's keys
        (("dp=none", "dp.mode=adaptive", "dp.noise_multiplier=0.05"), "adaptive"),
    ],
)
def test_an_unusual_spelling_or_mixed_keys_give_the_policy_and_the_round_one_mode(
    make_settings, overrides: tuple[str, ...], mode: str
) -> None:
    """Passes: the run config names a mode by its enum name, or composes one mode's group with
    another's ``dp.mode``. The settings hold one :class:`DPMode` member, and the policy's check,
    the ledger's charge and the node's round class all read it from the registry."""
    from car_fl.client.policy import NodePolicy
    from car_fl.settings.dp_modes.registry import MODES
    from car_fl.settings.dp_plan import round_release

    settings = make_settings(*overrides, *BASE, "fl.max_examples_per_client=100")
    assert settings.dp.mode.value == mode
    others = sorted({"fixed", "adaptive", "record"} - {mode})
    policy = NodePolicy.parse(f"modes = {others!r}\n".replace("'", '"'), source=Path("p.toml"))
    assert any("not among the accepted modes" in v for v in policy.violations(settings))
    spec = MODES[settings.dp.mode]
    release = round_release(settings, server_round=1, examples=0)
    assert (release.kind.value == "dpsgd") is spec.record_level
    assert spec.node_round.endswith("RecordDPRound") is (mode == "record")
