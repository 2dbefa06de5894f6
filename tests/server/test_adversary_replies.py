"""A hostile client against the server: each test plays replies a hostile node can send and
asserts what docs/federation.md and docs/privacy.md claim of them (found by a review)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Error, Message, RecordDict

from car_fl.client.local_dp import ClientPrivacy
from car_fl.protocol.failures import Failure, failure_reply
from car_fl.protocol.messages import decode, to_record
from car_fl.results.rows import CLIENTS_CSV, ClientRow
from car_fl.results.run import ResumePoint
from car_fl.server.strategy import (
    MAX_REASON,
    REPLY_METRICS,
    GuardedStrategy,
    NormBound,
    ShardClaims,
    spec_of,
)
from car_fl.settings.compose import load_settings
from car_fl.settings.dp_plan import public_examples
from car_fl.settings.schema import NormBoundMode
from tests.helpers import reply, set_task_identity
from tests.server.test_privacy_check import EXAMPLES, honest_claims, recorder_of
from tests.server.test_strategy import SPEC, configured, params


def test_a_non_finite_partition_claim_does_not_crash_the_resume(tmp_path: Path) -> None:
    """A hostile node sends ``partition-id = inf`` (NaN is dropped, ∞ is kept as an "honest"
    number). The round itself survives it (``test_a_non_finite_partition_id_is_rejected_not_a
    _crash``) and clients.csv records ``inf``; but every later ``resume=`` of the run reads
    that row back and ``PrivacyCheck.resume`` calls ``int(inf)``: the server cannot resume."""
    settings = load_settings("fl.rounds=3 dp=none")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.claims = ShardClaims({0: EXAMPLES, 1: EXAMPLES})  # as run_federation builds it
    replies = [
        reply(10, {"w": np.ones(3, np.float32)}, EXAMPLES, **{"partition-id": 0}),
        reply(11, {"w": np.ones(3, np.float32)}, EXAMPLES, **{"partition-id": math.inf}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None  # the round is not the problem
    rounds(1, to_record({"w": torch.zeros(3)}))
    client_rows = ClientRow.read_csv(tmp_path / CLIENTS_CSV)
    assert any(row.partition_id == math.inf for row in client_rows)
    # A new server process resumes after round 1 from what the first one wrote.
    _, resumed = recorder_of(settings, tmp_path / "again")
    summary = rounds.run.summary(complete=False)
    checkpoint = rounds.run.checkpoint({}, rounds.run.history[-1])
    point = ResumePoint(1, checkpoint, list(rounds.run.history), summary, client_rows, None, False)
    resumed.run.begin(point, data={})
    resumed.resume(point)  # OverflowError: cannot convert float infinity to integer
    assert resumed.privacy.client_epsilon == {10: 0.0, 11: 0.0}


def test_a_replys_long_text_and_junk_metrics_neither_break_the_resume_nor_grow_the_server(
    tmp_path: Path,
) -> None:
    """A hostile node fails with 200,000 characters of reason, claims a partition as a list of
    20,000 numbers (both land in clients.csv's reason, past csv's 131,072-character field: no
    resume could read it), sends 5,000 metric keys of its own (kept in every round's stats)
    and train metrics out of range (a loss that overflows the round's mean, accuracy −5·10⁶,
    seconds ∞)."""
    settings = load_settings("fl.rounds=3 dp=none")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.claims = ShardClaims({0: EXAMPLES, 1: EXAMPLES})
    set_task_identity()
    instruction = Message(content=RecordDict(), dst_node_id=12, message_type="train")
    ones = {"w": np.ones(3, np.float32)}
    junk = {f"junk-{i}": float(i) for i in range(5_000)}
    out_of_range = {"train-loss": 1e308, "train-accuracy": -5e6, "train-seconds": math.inf}
    replies = [
        reply(10, ones, EXAMPLES, **{"partition-id": 0, "train-loss": 1.0}),
        reply(11, ones, EXAMPLES, **{"partition-id": [0.5] * 20_000}),  # type: ignore[arg-type]
        Message(Error(code=0, reason="x" * 200_000), reply_to=instruction),
        reply(13, ones, EXAMPLES, **{"partition-id": 1, **junk, **out_of_range}),
    ]
    strategy.aggregate_train(1, replies)
    rounds(1, to_record({"w": torch.zeros(3)}))
    stats = strategy.history[-1]
    assert all(
        len(r) <= MAX_REASON + 40 for r in [*stats.rejected.values(), *stats.failed.values()]
    )
    assert set(stats.rejected) == {11} and set(stats.failed) == {12}
    assert all(set(m) <= REPLY_METRICS for m in stats.released.values())
    assert stats.client_metrics[13] == {"num-examples": EXAMPLES, "partition-id": 1.0}
    assert rounds.run.history[-1].train_loss == 1.0  # node 10's: node 13's were dropped
    assert {row.node for row in ClientRow.read_csv(tmp_path / CLIENTS_CSV)} == {10, 11, 12, 13}


def failed(node: int) -> Message:
    """An honest node's failure reply (a lost node, a diverged round, an exhausted budget)."""
    set_task_identity()
    instruction = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return failure_reply(instruction, Failure.ROUND_FAILED)


@pytest.mark.parametrize("clients", [2, 3])
def test_the_adaptive_norm_bound_rejects_a_scaled_update_when_two_replies_are_valid(
    clients: int,
) -> None:
    """docs/federation.md: "Use the norm bound with fl.norm_bound_action=reject ...; it rejects
    the hostile reply in every round of every attack". Under ``fl.norm_bound=adaptive`` the
    bound is 3 × the median of the round's norms *including the hostile one*: with two valid
    replies the median is (h + N)/2 and 3·(h + N)/2 > N for every N, so a ×50 (or ×10⁶)
    update always passes. Two valid replies is the default federation (fl.clients=2), any
    round of fl.clients_per_round=2, and any round of the documented 3-client setting in
    which one honest node fails or is lost."""
    settings = load_settings(f"fl.clients={clients} fl.norm_bound=adaptive")
    global_ = params(0)
    honest = {k: v + 0.1 * params(1)[k] for k, v in global_.items()}
    scaled = {k: v + 50 * (honest[k] - v) for k, v in global_.items()}  # `scale50`
    strategy = GuardedStrategy.for_run(settings, spec=SPEC)
    nodes = list(range(1, clients + 1))
    configured(strategy, global_, nodes)
    replies = [reply(1, honest, 10), reply(clients, scaled, 10)]
    replies += [failed(node) for node in nodes[1:-1]]  # the third node's round failed
    arrays, _ = strategy.aggregate_train(1, replies)
    stats = strategy.history[-1]
    assert clients in stats.rejected, (stats.update_norms, stats.norm_bound)
    assert arrays is not None
    for name in SPEC:  # the honest update alone
        np.testing.assert_allclose(decode(arrays[name]), honest[name], rtol=1e-6, atol=1e-6)


def test_a_rejected_claim_does_not_take_the_partitions_dp_row(tmp_path: Path) -> None:
    """Under dp=record, ``summary.dp_clients`` is "σ, q, steps and ε per partition id, as the
    server computes them" (docs/privacy.md). A hostile node (a lower node id) sends one
    *malformed* reply claiming partition 0: the strategy rejects it and does not pin the
    partition, so the honest node 10 holds partition 0 and trains it every round. But
    ``PrivacyCheck.keep`` gave partition 0's row to the first claim it saw, rejected or not:
    the summary's partition 0 shows the hostile node's single release, and the honest
    holder's three rounds are filed under its node id as if it were a partition."""
    settings = load_settings("fl.rounds=3 dp=record dp.target_epsilon=4")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.claims = ShardClaims({0: EXAMPLES, 1: EXAMPLES})
    honest = [{**claim, "partition-id": 0.0} for claim in honest_claims(settings, 3)]
    for server_round in (1, 2, 3):
        replies = [reply(10, {"w": np.ones(3, np.float32)}, EXAMPLES, **honest[server_round - 1])]
        if server_round == 1:  # wrong shape: rejected, not pinned
            replies.append(reply(5, {"w": np.ones(4, np.float32)}, EXAMPLES, **honest[0]))
        arrays, _ = strategy.aggregate_train(server_round, replies)
        assert arrays is not None
        rounds(server_round, to_record({"w": torch.zeros(3)}))
    assert strategy.history[0].rejected.keys() == {5}
    assert strategy.claims.held == {10: 0}  # the server's record: node 10 holds partition 0
    rows = rounds.run.summary(complete=False).dp_clients
    spent = rounds.privacy.epsilon(10)
    assert spent == pytest.approx(honest[2]["dp-epsilon"])
    assert rows[0].epsilon == pytest.approx(spent), {k: v.epsilon for k, v in rows.items()}


def test_without_pinning_a_claim_takes_no_partitions_dp_row(tmp_path: Path) -> None:
    """With ``fl.max_examples_per_client`` the strategy pins no partition (data-is-shard), so
    no claim is checked: a hostile node with a lower id sent one valid reply claiming partition
    0 and took its row in ``summary.dp_clients`` (1 step's ε), the real holder's 3 rounds filed
    under its node id. Each node's row is now its node id's."""
    settings = load_settings("fl.rounds=3 dp=record dp.target_epsilon=4")
    settings.fl.max_examples_per_client = EXAMPLES
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.claims = ShardClaims(max_examples=EXAMPLES)
    honest = [{**claim, "partition-id": 0.0} for claim in honest_claims(settings, 3)]
    for server_round in (1, 2, 3):
        replies = [reply(10, {"w": np.ones(3, np.float32)}, EXAMPLES, **honest[server_round - 1])]
        if server_round == 1:  # valid, claiming the same partition: not refused without pins
            replies.append(reply(5, {"w": np.ones(3, np.float32)}, EXAMPLES, **honest[0]))
        strategy.aggregate_train(server_round, replies)
        rounds(server_round, to_record({"w": torch.zeros(3)}))
    rows = rounds.run.summary(complete=False).dp_clients
    assert set(rows) == {5, 10}
    assert rows[10].epsilon == pytest.approx(rounds.privacy.epsilon(10))
    assert rows[10].epsilon > rows[5].epsilon == pytest.approx(rounds.privacy.epsilon(5))


def test_a_reply_the_norm_bound_rejects_does_not_pin_its_partition() -> None:
    """docs/federation.md: "The server pins each node to the first partition id it claims in
    a *valid* reply" (and test_replies: "only a valid reply pins its partition"). The pin is
    made in ``GuardedStrategy._check``, before ``_bound_norms``: a hostile node whose reply the
    norm bound rejects (status "rejected" in clients.csv) still takes the honest node's
    partition, and the honest node's replies are refused from then on, in this very round
    already (here: the round is skipped, no valid reply)."""
    global_ = params(0)
    honest = {k: v + 0.1 * params(1)[k] for k, v in global_.items()}
    huge = {k: v + 1000.0 for k, v in global_.items()}
    settings = load_settings("fl.clients=2")
    strategy = GuardedStrategy.for_run(settings, spec=SPEC, shard_sizes={0: 50, 1: 50})
    strategy.norm_bound = NormBound(mode=NormBoundMode.FIXED, value=1.0)
    configured(strategy, global_, [5, 10])
    replies = [
        reply(5, huge, 50, **{"partition-id": 0}),  # over the bound: rejected
        reply(10, honest, 50, **{"partition-id": 0}),  # the partition's honest holder
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    rejected = strategy.history[-1].rejected
    assert "exceeds the bound" in rejected[5]
    assert 10 not in rejected, rejected[10]
    assert strategy.claims.held == {10: 0}
    assert arrays is not None


def test_under_dp_a_hostile_nodes_train_figures_reach_no_file(tmp_path: Path) -> None:
    """Under DP an honest client sends no train metric (car_fl/client/round.py), and
    ``RoundRecorder.row`` drops train_loss/train_accuracy ("one sent anyway is not used");
    ClientRow: "under DP the train cells are empty". A hostile node's forged figures still
    reach the files: ``max_client_train_seconds`` in metrics.json/.csv is its
    ``train-seconds``, its clients.csv row carries its train loss, accuracy and seconds, and
    the MetricRecord ``GuardedStrategy.aggregate_train`` returns to Flower has its loss."""
    settings = load_settings("fl.rounds=1 dp=fixed dp.noise_multiplier=1.0")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.public_examples = public_examples(settings)  # as for_run sets it under DP
    claims = {k: v for k, v in honest_claims(settings, 1)[0].items() if k != "num-examples"}
    forged = {"train-loss": 0.001, "train-accuracy": 1.0, "train-seconds": 1e9}
    replies = [
        reply(10, {"w": np.ones(3, np.float32)}, EXAMPLES, **claims, **forged),
        reply(11, {"w": np.ones(3, np.float32)}, EXAMPLES, **claims),
    ]
    arrays, summary = strategy.aggregate_train(1, replies)
    assert arrays is not None and summary is not None
    rounds(1, to_record({"w": torch.zeros(3)}))
    row = rounds.run.history[-1]
    assert row.train_loss is not None and math.isnan(row.train_loss)  # the documented part
    assert row.max_client_train_seconds == 0.0, row.max_client_train_seconds
    hostile = next(r for r in ClientRow.read_csv(tmp_path / CLIENTS_CSV) if r.node == 10)
    assert (hostile.train_loss, hostile.train_accuracy, hostile.train_seconds) == (None,) * 3
    # and the round's MetricRecord handed to Flower (its log, its Result) is the forged one
    assert "train-loss" not in summary and "train-accuracy" not in summary, dict(summary)


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_under_an_adapter_clip_no_reply_puts_the_joint_bounds_room_in_the_adapter(
    action: str,
) -> None:
    """With ``dp.adapter_clip`` a client clips the adapter at C_a and the head at C, each with
    its share of the noise; the server's bound was one joint bound, so a noise-free update
    of the joint bound's norm, all in the adapter, passed: 100× an honest adapter's move. Each
    part is now bounded as the client releases it; honest releases still pass."""
    dp = ["dp=fixed", "dp.noise_multiplier=0.1", "dp.adapter_clip=0.001"]
    settings = load_settings(
        [*dp, "mode=adapter", "fl.clients=3", f"fl.norm_bound_action={action}"]
    )
    before = {"adapter.weight": torch.zeros(64, 64), "head.weight": torch.zeros(4, 64)}
    strategy = GuardedStrategy.for_run(settings, spec=spec_of(to_record(before)))
    configured(strategy, {k: v.numpy() for k, v in before.items()}, [1, 2, 3])
    bound = strategy.norm_bound
    assert bound.value is not None and bound.part_values is not None
    replies = []
    for node in (1, 2):  # honest: trained far past both bounds, then clipped and noised
        client = ClientPrivacy(
            settings.dp, num_clients=3, client=node, state=ClientPrivacy.initial_state(settings.dp)
        )
        gen = torch.Generator().manual_seed(node)
        after = {k: v + torch.randn(v.shape, generator=gen) for k, v in before.items()}
        released = client.release(before, after, server_round=1)
        replies.append(reply(node, {k: v.numpy() for k, v in released.items()}, EXAMPLES))
    hostile = np.full((64, 64), 0.98 * bound.value / 64, np.float32)  # ‖·‖ = 0.98 × the bound
    replies.append(
        reply(3, {"adapter.weight": hostile, "head.weight": np.zeros((4, 64), np.float32)}, 5)
    )
    arrays, _ = strategy.aggregate_train(1, replies)
    stats = strategy.history[-1]
    assert bound.part_values[0] < 0.1 * bound.value  # the adapter's own room is far smaller
    if action == "reject":
        assert set(stats.rejected) == {3} and "adapter part norm" in stats.rejected[3]
        return
    assert stats.clipped == [3] and not stats.rejected
    assert arrays is not None
    mean = decode(arrays["adapter.weight"]).astype(np.float64)
    honest = [decode(r.content.array_records["arrays"]["adapter.weight"]) for r in replies[:2]]
    clipped = 3 * mean - sum(h.astype(np.float64) for h in honest)
    assert np.linalg.norm(clipped) <= bound.part_values[0] * (1 + 1e-5)
