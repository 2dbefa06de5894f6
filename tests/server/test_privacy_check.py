"""car_fl.server.privacy_check: the server's own ε of each client, and flagged claims.

The honest client is the real client code (its accounting and reply metrics); the hostile one
forges its reply's ``dp-epsilon`` / ``dp-active``. Through the strategy and the round recorder,
the report (metrics.json, clients.csv) shows the server's figure and flags the forger.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

from car_fl.client.local_dp import LocalDPRound
from car_fl.client.record_dp import RecordDPRound
from car_fl.data.labels import LabelMap
from car_fl.privacy.accountant import Accountant
from car_fl.privacy.accountant import epsilon as rdp_epsilon
from car_fl.protocol.messages import decode, to_record
from car_fl.results.rows import CLIENTS_CSV, ClientRow, RunSummary
from car_fl.results.run import FEDERATED, ResumePoint, Run
from car_fl.server.federation import RoundRecorder
from car_fl.server.privacy_check import PrivacyCheck, disagreement
from car_fl.server.strategy import GuardedStrategy, ShardClaims
from car_fl.settings.compose import NodeInfo, load_settings
from car_fl.settings.dp_plan import record_plan, round_release
from car_fl.settings.schema import Mode, Settings
from tests.helpers import reply
from tests.reference import CaRFedAvg

EXAMPLES = 50
SPEC = {"w": ((3,), np.dtype("float32"))}


def honest_claims(
    settings: Settings, rounds: int, examples: int = EXAMPLES
) -> list[dict[str, float]]:
    """The reply metrics of an honest client with ``examples`` records over ``rounds`` rounds:
    the client's own code."""
    node, state = NodeInfo(partition_id=0, num_partitions=2), RecordDict()
    replies = []
    for server_round in range(1, rounds + 1):
        round_dp: LocalDPRound | RecordDPRound
        if settings.dp.mode.value == "record":
            round_dp = RecordDPRound(settings, node, state)
            round_dp.refuse_past_target(examples)
        else:
            start = {"w": torch.zeros(3)}
            round_dp = LocalDPRound(
                settings, node, state, server_round=server_round, global_state=start
            )
            round_dp.refuse_past_target(examples)
            round_dp.release({"w": torch.ones(3)})
        round_dp.save(state)
        replies.append({**round_dp.reply_metrics(), "num-examples": EXAMPLES})
    return replies


@pytest.mark.parametrize(
    "overrides",
    [
        "dp=none",
        "dp=fixed dp.noise_multiplier=1.0",
        "dp=adaptive dp.warmup_rounds=1",
        f"dp=fixed dp.granularity=step fl.max_examples_per_client={EXAMPLES}",
        "dp=fixed dp.noise_multiplier=0",  # not private: ε = ∞ on both sides
        "dp=record dp.target_epsilon=4",
    ],
)
def test_the_server_computes_what_an_honest_client_reports(overrides: str) -> None:
    settings = load_settings(f"fl.rounds=3 {overrides}")
    check = PrivacyCheck(settings)
    for server_round, metrics in enumerate(honest_claims(settings, 3), start=1):
        verdict = check.receive(server_round, 7, metrics)
        assert verdict.mismatch == ""
        assert verdict.epsilon == pytest.approx(metrics["dp-epsilon"], rel=1e-9)
    if settings.dp.mode.value == "record":  # PLD, replace-one: the plan's own figure
        assert check.epsilon(7) == record_plan(settings).epsilon(
            3 * record_plan(settings).steps_per_round
        )


def test_the_server_counts_only_the_rounds_it_received() -> None:
    settings = load_settings("fl.rounds=3 dp=fixed dp.noise_multiplier=1.0")
    check = PrivacyCheck(settings)
    claims = honest_claims(settings, 3)
    check.receive(1, 7, claims[0])  # round 2's reply never arrived
    verdict = check.receive(3, 7, claims[2])
    assert verdict.epsilon == rdp_epsilon({0.5: 2}, settings.dp.delta)
    assert "more than the server's" in verdict.mismatch  # it claims 3 releases


@pytest.mark.parametrize(
    ("claimed", "claimed_active", "why"),
    [
        (0.5, 1.0, "less than the server's"),
        (math.inf, 1.0, "more than the server's"),
        (math.nan, 1.0, "unlike the server's"),
        (None, 1.0, "claims no ε"),
        (3.0, 0.0, "dp-active=0"),
    ],
)
def test_a_forged_claim_under_dp_is_a_mismatch(
    claimed: float | None, claimed_active: float, why: str
) -> None:
    assert why in disagreement(3.0, claimed, active=True, claimed_active=claimed_active)


def test_a_claim_within_tolerance_agrees() -> None:
    assert disagreement(3.0, 3.0 * (1 + 1e-4), active=True, claimed_active=1.0) == ""
    assert disagreement(3.0, 3.0 * (1 + 1e-2), active=True, claimed_active=1.0) != ""
    assert disagreement(0.0, None, active=False, claimed_active=None) == ""


def recorder_of(settings: Settings, out: Path) -> tuple[CaRFedAvg, RoundRecorder]:
    rounds = RoundRecorder(
        Run(
            settings=settings,
            kind=FEDERATED,
            output_dir=out,
            label_map=LabelMap.from_labels(["a", "b"]),
            title="test",
            describe=lambda: RunSummary(
                kind="federated",
                clients=2,
                mode=Mode.CLASSIFIER,
                head="classifier",
                num_labels=2,
                final=None,
                best=None,
                total_seconds=0.0,
                test_examples=10,
                selection="validation",
                data={},
            ),
        ),
        evaluate=lambda arrays: {
            "val_loss": 1.0,
            "val_top1": 0.5,
            "test_loss": 1.0,
            "test_top1": 0.5,
        },
    )
    strategy = CaRFedAvg(spec=SPEC)
    rounds.rounds = strategy.history
    rounds(0, ArrayRecord())
    return strategy, rounds


def play_round(
    strategy: CaRFedAvg, rounds: RoundRecorder, server_round: int, claims: dict[int, dict]
) -> None:
    replies = [
        reply(
            node,
            {"w": np.ones(3, np.float32)},
            EXAMPLES,
            **{k: v for k, v in m.items() if k != "num-examples"},
        )
        for node, m in claims.items()
    ]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    assert arrays is not None
    rounds(server_round, to_record({"w": torch.zeros(3)}))


@pytest.mark.parametrize("forged", [0.5, math.inf, math.nan])
def test_a_forged_epsilon_is_flagged_and_the_report_shows_the_servers_figure(
    tmp_path: Path, forged: float
) -> None:
    settings = load_settings("fl.rounds=2 dp=fixed dp.noise_multiplier=1.0")
    strategy, rounds = recorder_of(settings, tmp_path)
    honest = honest_claims(settings, 2)
    for server_round in (1, 2):
        # It also sends a train loss, which an honest client never does under DP.
        hostile = {**honest[server_round - 1], "dp-epsilon": forged, "train-loss": -math.inf}
        play_round(strategy, rounds, server_round, {10: hostile, 11: honest[server_round - 1]})
    server = rdp_epsilon({0.5: 2}, settings.dp.delta)

    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["summary"]["epsilon"] == pytest.approx(server)  # never the forged claim
    assert written["summary"]["flagged_clients"] == [10]
    assert [row["claims_flagged"] for row in written["history"]] == [1, 1]
    assert [row["epsilon"] for row in written["history"]] == pytest.approx(
        [rdp_epsilon({0.5: 1}, settings.dp.delta), server]
    )
    assert all(math.isnan(row["train_loss"]) for row in written["history"])  # not the −∞
    rows = ClientRow.read_csv(tmp_path / CLIENTS_CSV)
    last = {row.node: row for row in rows if row.round == 2}
    assert last[10].server_epsilon == pytest.approx(server) and last[10].claim_mismatch
    assert last[11].server_epsilon == pytest.approx(server) and last[11].claim_mismatch == ""


def test_a_client_claiming_dp_in_a_run_without_dp_is_flagged(tmp_path: Path) -> None:
    settings = load_settings("fl.rounds=2 dp=none")
    strategy, rounds = recorder_of(settings, tmp_path)
    forged = {"dp-active": 1.0, "dp-epsilon": 0.5, "train-loss": 1.0}
    honest = honest_claims(settings, 1)[0]
    play_round(strategy, rounds, 1, {10: forged, 11: honest})
    row = rounds.run.history[-1]
    assert row.epsilon == 0.0 and row.dp_active == 0 and row.claims_flagged == 1
    assert "dp-active=1" in rounds.privacy.verdicts[10].mismatch
    assert rounds.run.summary(complete=False).flagged_clients == [10]


def test_forged_record_level_figures_are_replaced_by_the_servers(tmp_path: Path) -> None:
    settings = load_settings("fl.rounds=2 dp=record dp.target_epsilon=4")
    strategy, rounds = recorder_of(settings, tmp_path)
    honest = honest_claims(settings, 1)[0]
    forged = {**honest, "dp-steps": 1.0, "dp-noise-multiplier": 50.0, "dp-epsilon": 0.01}
    play_round(
        strategy,
        rounds,
        1,
        {10: {**forged, "partition-id": 0.0}, 11: {**honest, "partition-id": 1.0}},
    )
    plan = record_plan(settings)
    summary = rounds.run.summary(complete=False)
    assert summary.flagged_clients == [10]
    for figures in summary.dp_clients.values():
        assert figures.noise_multiplier == plan.noise_multiplier
        assert figures.steps == plan.steps_per_round
        assert figures.epsilon == pytest.approx(plan.epsilon(plan.steps_per_round))


def test_a_reply_the_norm_bound_rejects_still_counts_in_the_servers_epsilon(
    tmp_path: Path,
) -> None:
    # The server saw the rejected update: its ε counts it, and the honest client that sent it
    # is not flagged in later rounds for claiming the release it made
    from car_fl.server.strategy import NormBound, NormBoundMode

    settings = load_settings("fl.rounds=2 dp=fixed dp.noise_multiplier=1.0")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.norm_bound = NormBound(mode=NormBoundMode.FIXED, value=2.0)
    honest = honest_claims(settings, 2)
    for server_round in (1, 2):
        strategy.reference = {"w": np.zeros(3)}
        big = 5.0 if server_round == 1 else 1.0  # node 10's first update is over the bound
        replies = [
            reply(node, {"w": np.full(3, value, np.float32)}, EXAMPLES, **honest[server_round - 1])
            for node, value in ((10, big), (11, 1.0))
        ]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        assert arrays is not None
        rounds(server_round, to_record({"w": torch.zeros(3)}))
    rows = {(r.round, r.node): r for r in ClientRow.read_csv(tmp_path / CLIENTS_CSV)}
    assert rows[(1, 10)].status == "rejected"
    delta = settings.dp.delta
    assert rows[(1, 10)].server_epsilon == pytest.approx(rdp_epsilon({0.5: 1}, delta))
    assert rows[(2, 10)].server_epsilon == pytest.approx(rdp_epsilon({0.5: 2}, delta))
    assert rows[(2, 10)].claim_mismatch == "" and rounds.privacy.flagged == set()


@pytest.mark.parametrize("node_after", [10, 77], ids=["same-node-id", "new-node-id"])
def test_after_a_resume_the_servers_epsilon_counts_the_releases_before_it(
    tmp_path: Path, node_after: int
) -> None:
    """A resumed simulation's nodes have new ids (Flower gives new ones at each start), which
    the server cannot link to the old: a new id starts from the releases of the node that had
    spent the most, so the run's ε is never the ε of the rounds after the resume alone."""
    settings = load_settings("fl.rounds=3 dp=fixed dp.noise_multiplier=1.0")
    honest = honest_claims(settings, 3)
    strategy, rounds = recorder_of(settings, tmp_path)
    for server_round in (1, 2):
        play_round(strategy, rounds, server_round, {10: honest[server_round - 1]})
    # A new server process resumes after round 2 from what the first one wrote
    strategy, resumed = recorder_of(settings, tmp_path / "again")
    summary = rounds.run.summary(complete=False)
    checkpoint = rounds.run.checkpoint({}, rounds.run.history[-1])
    client_rows = ClientRow.read_csv(tmp_path / CLIENTS_CSV)
    point = ResumePoint(2, checkpoint, list(rounds.run.history), summary, client_rows, None, False)
    resumed.run.begin(point, data={})
    resumed.resume(point)
    strategy.round_offset = 2  # as run_federation sets it: Flower counts from 1 again
    play_round(strategy, resumed, 1, {node_after: honest[2]})
    row = resumed.run.history[-1]
    assert row.epsilon == pytest.approx(rdp_epsilon({0.5: 3}, settings.dp.delta))
    assert row.claims_flagged == 0  # the honest client's claim (3 releases) agrees


def test_a_node_claiming_another_nodes_partition_cannot_overwrite_its_dp_row(
    tmp_path: Path,
) -> None:
    settings = load_settings("fl.rounds=2 dp=record dp.target_epsilon=4")
    strategy, rounds = recorder_of(settings, tmp_path)
    honest = {**honest_claims(settings, 1)[0], "partition-id": 0.0}
    play_round(strategy, rounds, 1, {10: honest, 11: dict(honest)})  # 11 claims partition 0 too
    rows = rounds.run.summary(complete=False).dp_clients
    assert set(rows) == {0, 11}  # node 10 keeps partition 0's row; node 11 gets its own


@pytest.mark.parametrize("mode", ["dp=fixed dp.noise_multiplier=1.0", "dp=record"])
def test_a_node_whose_partition_was_claimed_first_is_still_counted(
    tmp_path: Path, mode: str
) -> None:
    """A hostile node claims the honest node's partition first: the honest node's replies are
    refused from then on, but each one reached the server, which counts it in that node's ε
    (it used to count none: a blank server_epsilon, and under dp=record the partition's row
    was the hostile node's, with one round's ε)."""
    settings = load_settings(f"fl.rounds=3 {mode}")
    strategy, rounds = recorder_of(settings, tmp_path)
    strategy.claims = ShardClaims({0: EXAMPLES, 1: EXAMPLES})
    honest = [{**claim, "partition-id": 0.0} for claim in honest_claims(settings, 3)]
    play_round(strategy, rounds, 1, {5: dict(honest[0]), 10: honest[0]})  # 5 claims it first
    for server_round in (2, 3):
        play_round(
            strategy, rounds, server_round, {5: dict(honest[0]), 10: honest[server_round - 1]}
        )
    rows = {(row.round, row.node): row for row in ClientRow.read_csv(tmp_path / CLIENTS_CSV)}
    assert [rows[(r, 10)].status for r in (1, 2, 3)] == ["rejected"] * 3
    counted = rows[(3, 10)].server_epsilon
    assert counted is not None and counted == pytest.approx(honest[2]["dp-epsilon"])
    assert rows[(3, 10)].claim_mismatch == ""  # honest: its claim is what it released


@pytest.mark.parametrize("claimed", [1, 10**6])
def test_a_claimed_count_moves_neither_the_servers_epsilon_nor_the_weights(claimed: int) -> None:
    """The attacker's hole: with a deployment-like cap, a node claiming n = 10⁶ under per-step
    DP made the server report ε 1,100,112 (its true ε: 223) and dominated FedAvg; claiming
    n = 1 made the server report 16.5. The server now accounts with its own bound (the value
    least favourable to privacy) and, under DP, weighs every reply the same."""
    cap = 10**6
    settings = load_settings(
        "fl.rounds=3 dp=fixed dp.granularity=step dp.noise_multiplier=1.0 "
        f"fl.max_examples_per_client={cap}"
    )
    strategy = GuardedStrategy.for_run(settings, spec=SPEC)
    strategy.reference = {"w": np.zeros(3)}
    replies = [
        reply(1, {"w": np.full(3, 1.0, np.float32)}, claimed, **{"partition-id": 0}),
        reply(2, {"w": np.full(3, 3.0, np.float32)}, 1, **{"partition-id": 1}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    np.testing.assert_allclose(decode(arrays["w"]), np.full(3, 2.0))  # equal weights
    check = PrivacyCheck(settings)
    released = strategy.history[-1].released
    verdict = check.receive(1, 1, released[1])
    assert verdict.epsilon == check.receive(1, 2, released[2]).epsilon  # the claim is not used
    bounded = round_release(settings, server_round=1, examples=cap)
    assert verdict.epsilon == pytest.approx(Accountant([bounded]).get_epsilon(settings.dp.delta))
    assert "server's bound" in verdict.basis


def test_without_a_bound_a_per_step_figure_is_infinite_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = load_settings("fl.rounds=3 dp=fixed dp.granularity=step")
    with caplog.at_level(logging.WARNING, logger="car_fl.server.privacy_check"):
        check = PrivacyCheck(settings)
    assert "fl.max_examples_per_client" in caplog.text  # said before the first round
    verdict = check.receive(1, 7, {"num-examples": 1, "dp-epsilon": 0.5})
    assert verdict.epsilon == math.inf and "cannot bound" in verdict.basis
    assert verdict.mismatch == ""  # nothing to judge the claim's value by: not flagged
    silent = check.receive(1, 8, {"num-examples": 1})  # no ε claimed in a DP round: flagged
    assert silent.epsilon == math.inf and "claims no ε" in silent.mismatch


def test_a_node_reading_more_than_its_partition_is_not_reported_below_its_epsilon() -> None:
    """The server's partition sizes are no bound on what a node reads: a node started with
    data-is-shard, or whose owner's policy sets its [data], trains on its own records. Under
    per-step DP its releases follow that n; the server used to account it with the partition
    size it had on record: ε 32.2 for a node whose true ε (500 records, 1 round) is 633.9."""
    settings = load_settings("fl.rounds=3 dp=fixed dp.granularity=step dp.noise_multiplier=1.0")
    strategy = GuardedStrategy.for_run(settings, spec=SPEC, shard_sizes={0: 10, 1: 10})
    strategy.reference = {"w": np.zeros(3)}
    claims = honest_claims(settings, 1, examples=500)  # the node's own file: 500 records
    update = {"w": np.ones(3, np.float32)}
    sent = {k: v for k, v in claims[0].items() if k != "num-examples"}  # DP: the public 1
    strategy.aggregate_train(1, [reply(1, update, 1, **sent, **{"partition-id": 0})])
    verdict = PrivacyCheck(settings).receive(1, 1, strategy.history[-1].released[1])
    assert claims[0]["dp-epsilon"] < math.inf  # the node's true ε, honestly claimed
    assert verdict.epsilon >= claims[0]["dp-epsilon"]
