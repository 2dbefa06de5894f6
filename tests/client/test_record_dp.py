"""car_fl.client.record_dp: a DP-SGD round: checks before training, the reply, the budget."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.failures import RunTargetReached
from car_fl.client.node import Node
from car_fl.client.record_dp import RecordDPRound, load_record_state
from car_fl.client.round import Shard, shard_data, train_shard
from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.privacy.record_accounting import trained_cap
from car_fl.settings.compose import NodeInfo
from car_fl.settings.dp_plan import public_examples, record_plan


@pytest.fixture
def record_inputs(make_settings):
    def make(*overrides: str):
        s = make_settings(
            "dp=record", "dp.delta=1e-4", "fl.local_epochs=1", "dp.sample_rate=0.1", *overrides
        )
        splits = load_splits(s.dataset, seed=s.seed)
        initial = build_retriever(s, len(splits.label_map)).trainable_state_dict()
        return s, NodeInfo(0, 2), initial

    return make


def norm(update: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    return float(sum(float(((update[k] - start[k]) ** 2).sum()) for k in start) ** 0.5)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_whether_a_dpsgd_round_succeeds_and_what_it_sends_do_not_depend_on_the_shards_size(
    record_inputs, optimizer: str
) -> None:
    """The attacker's probe: δ = 0.01 and shards of 0, 1, 50 and ≥ 1/δ examples. Before, n ≥
    1/δ and n = 0 failed the round (one un-noised bit about n per run), and, since each step
    divided by q·n, plain SGD's update was ~100× larger for an empty shard. With a public
    fl.max_examples_per_client every size trains, the reply's metrics are the same, and the
    update's size does not tell the sizes apart."""
    s, node, initial = record_inputs(
        "dp.delta=0.01", "fl.max_examples_per_client=200", f"train.optimizer={optimizer}"
    )
    whole = shard_data(s, node)
    assert whole.examples >= 100 and len(whole.data) == whole.examples  # n ≥ 1/δ
    replies, norms = [], []
    for size in (0, 1, 50, whole.examples):
        shard = Shard(whole.data.select(range(size)), whole.label_map, examples=size)
        state, metrics = train_shard(s, node, shard, initial, 1, RecordDict())
        assert set(state) == set(initial)
        assert all(bool(torch.isfinite(t).all()) for t in state.values())
        replies.append(metrics)
        norms.append(norm(state, initial))
    assert all(reply == replies[0] for reply in replies), replies
    assert replies[0]["num-examples"] == public_examples(s) == 200
    assert max(norms) / min(norms) < 3, norms  # noise, the same scale for every size


def test_a_hostile_learning_rate_fails_or_passes_a_round_whatever_the_shards_size(
    record_inputs,
) -> None:
    s, node, initial = record_inputs(
        "dp.delta=0.01", "fl.max_examples_per_client=200", "train.optimizer=sgd", "train.lr=3e36"
    )
    whole = shard_data(s, node)
    outcomes = set()
    for size in (0, whole.examples):
        shard = Shard(whole.data.select(range(size)), whole.label_map, examples=size)
        try:
            train_shard(s, node, shard, initial, 1, RecordDict())
            outcomes.add("ok")
        except FloatingPointError:
            outcomes.add("FloatingPointError")
    assert len(outcomes) == 1, outcomes


def test_a_run_that_changes_q_or_delta_mid_run_is_refused(record_inputs) -> None:
    """σ, q and δ are fixed for a run's life: otherwise its steps would not compose into the ε
    it reports (the ledger, which keeps q per release, stays right either way)."""
    fixed = ("dp.target_epsilon=null", "dp.noise_multiplier=1.0")
    s, node, initial = record_inputs(*fixed)
    state = RecordDict()
    Node(config={}).train(s, node, initial, 1, state)
    for change in ("dp.sample_rate=0.2", "dp.delta=1e-6"):
        changed, _, _ = record_inputs(*fixed, change)
        with pytest.raises(ValueError, match="fixed for a run's whole life"):
            Node(config={}).train(changed, node, initial, 2, state)


def test_a_shard_of_at_least_one_over_delta_trains_on_a_fresh_random_subset(record_inputs) -> None:
    s, node, _ = record_inputs("dp.delta=0.01")
    whole = shard_data(s, node)
    assert trained_cap(0.01) == 99 and whole.examples > 99
    subsets = []
    for _ in range(2):
        dp_round = RecordDPRound(s, node, RecordDict())
        dp_round.refuse_past_target(whole.examples)
        trained, population = dp_round.round_data(whole.data)
        assert population == 99 and len(trained) == 99  # every example has a known label here
        assert dp_round.round_data(whole.data)[0] is trained  # one subset per round
        assert trained.features is not None
        subsets.append(trained.features)
    assert not torch.equal(subsets[0], subsets[1])  # OS entropy: not reproducible by the server
    dp_round = RecordDPRound(s, node, RecordDict())
    dp_round.refuse_past_target(0)
    empty, population = dp_round.round_data(whole.data.select([]))
    assert len(empty) == 0 and population == 1  # an empty shard: noise-only steps


@pytest.mark.slow
def test_curious_server_sees_parameters_count_and_public_privacy_figures_only(
    record_inputs,
) -> None:
    s, node, initial = record_inputs("fl.rounds=2")
    state = RecordDict()
    released, metrics = Node(config={}).train(s, node, initial, 1, state)
    assert set(metrics) == {
        "num-examples",
        "partition-id",
        "dp-active",
        "dp-epsilon",
        "dp-steps",
        "dp-noise-multiplier",
        "dp-sample-rate",
    }  # no train loss, accuracy, norms or clip counts: those are data-dependent
    plan = record_plan(s)
    assert metrics["dp-steps"] == plan.steps_per_round == 10
    assert metrics["dp-epsilon"] == plan.epsilon(10)
    assert metrics["dp-noise-multiplier"] == plan.noise_multiplier
    # The same round again from the same state: the server knows the seed, yet cannot
    # regenerate the noise or the sampled batches (OS entropy)
    again, _ = Node(config={}).train(s, node, initial, 1, RecordDict())
    assert any(not torch.equal(released[k], again[k]) for k in released)


def test_a_client_never_releases_past_its_target_epsilon(record_inputs) -> None:
    s, node, initial = record_inputs("fl.rounds=2", "dp.target_epsilon=2")
    state = RecordDict()
    eps = []
    for server_round in (1, 2):
        _, metrics = Node(config={}).train(s, node, initial, server_round, state)
        eps.append(metrics["dp-epsilon"])
    assert eps[0] < eps[1] <= 2.0
    assert eps[1] >= 2.0 * 0.99  # σ was calibrated for exactly these 2 rounds
    assert load_record_state(state).steps == 20
    with pytest.raises(RunTargetReached, match=r"client 0 stops contributing.*> dp.target"):
        Node(config={}).train(s, node, initial, 3, state)
    assert load_record_state(state).steps == 20  # nothing was trained or counted


@pytest.mark.parametrize(
    ("kind", "tensors"),
    [("full", {"weight"}), ("lowrank", {"up", "down"}), ("diagonal", {"scale", "shift"})],
)
def test_record_round_in_adapter_mode_trains_the_adapter(record_inputs, kind, tensors) -> None:
    """Every adapter kind: the node's DP-SGD round trains it and sends exactly its tensors."""
    s, node, initial = record_inputs(
        "mode=adapter",
        f"adapter.kind={kind}",
        "adapter.rank=4",
        "adapter.anchor=0.1",
        "dataset.max_examples=40",
        "dp.sample_rate=0.5",
        "dp.target_epsilon=null",
        "dp.noise_multiplier=1",
    )
    released, metrics = Node(config={}).train(s, node, initial, 1, RecordDict())
    assert metrics["dp-steps"] == 2
    sent = {k.removeprefix("adapter.") for k in released if k.startswith("adapter.")}
    assert sent == tensors and set(released) == set(initial)
    assert all(not torch.equal(released[f"adapter.{t}"], initial[f"adapter.{t}"]) for t in sent)


def test_record_round_clips_the_adapter_apart_when_asked(
    record_inputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp.adapter_clip reaches every DP-SGD step of a node's round (and σ·C is unchanged:
    tests/privacy/test_ghost.py); a bound at or above C is refused when the settings are made."""
    import car_fl.privacy.dpsgd as dpsgd

    seen: list[tuple[float, float | None]] = []
    real = dpsgd.clipped_gradient_sum

    def spy(*args, **kwargs):
        seen.append((kwargs["clip"], kwargs.get("adapter_clip")))
        return real(*args, **kwargs)

    monkeypatch.setattr(dpsgd, "clipped_gradient_sum", spy)
    small = ("dataset.max_examples=40", "dp.sample_rate=0.5", "dp.target_epsilon=null")
    bounds = ("dp.noise_multiplier=1", "dp.clip=0.5", "dp.adapter_clip=0.05")
    # classifier mode has no adapter: one bound C, as its log line says
    for mode, expected in (("mode=adapter", 0.05), ("mode=classifier", None)):
        seen.clear()
        s, node, initial = record_inputs(mode, *small, *bounds)
        Node(config={}).train(s, node, initial, 1, RecordDict())
        assert seen == [(0.5, expected)] * 2
    with pytest.raises(ValueError, match=r"dp\.adapter_clip=0\.5 under dp=record must be below"):
        record_inputs("mode=adapter", "dp.clip=0.5", "dp.adapter_clip=0.5")
