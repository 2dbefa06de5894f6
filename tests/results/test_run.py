"""car_fl.results.run: one Run for epochs, rounds and the probe; selection on validation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from car_fl.data.labels import LabelMap
from car_fl.privacy.accountant import epsilon as rdp_epsilon
from car_fl.protocol.messages import from_record, to_record
from car_fl.results.rows import CLIENTS_CSV, ClientRow, MetricsFile, RoundRow, RunSummary
from car_fl.results.run import (
    CENTRALIZED,
    FEDERATED,
    Kind,
    Run,
    load_checkpoint,
    load_resume_point,
    round_line,
    write_config,
)
from car_fl.server.federation import RoundRecorder
from car_fl.server.strategy import RoundStats
from car_fl.settings.compose import settings_to_yaml
from car_fl.settings.schema import Mode, Settings
from tests.helpers import reply
from tests.reference import CaRFedAvg


def global_model() -> ArrayRecord:
    """A global model as the server evaluates it (the recorder only passes it on)."""
    return to_record({"w": torch.zeros(3)})


LABELS = LabelMap.from_labels(["a", "b", "c"])
SPEC = {"w": ((3,), np.dtype("float32"))}


def scores(val_top1: float, val_loss: float, test_top1: float) -> dict[str, float]:
    return {
        "val_loss": val_loss,
        "val_top1": val_top1,
        "test_loss": 1.0 - test_top1,
        "test_top1": test_top1,
    }


def make_run(settings: Settings, out: Path, kind: Kind = FEDERATED) -> Run:
    return Run(
        settings=settings,
        kind=kind,
        output_dir=out,
        label_map=LABELS,
        title="test",
        describe=federated_summary if kind is FEDERATED else centralised_summary,
    )


def test_best_follows_validation_and_its_checkpoint_is_that_rounds_model(
    make_settings, tmp_path: Path
) -> None:
    rec = make_run(make_settings(), tmp_path, CENTRALIZED)
    # Test top-1 falls while validation rises: selecting on test would keep epoch 1.
    for epoch, (val, loss, test) in enumerate([(0.5, 1.0, 0.9), (0.7, 0.9, 0.6), (0.7, 0.8, 0.3)]):
        row = RoundRow(
            round=epoch + 1,
            epochs=epoch + 1,
            train_loss=0.1,
            train_accuracy=0.9,
            metrics=scores(val, loss, test),
            seconds=1.0,
        )
        rec.record(row, {"w": torch.full((3,), float(epoch + 1))})
    assert rec.best is not None and rec.best.round == 3  # equal top-1: the lower loss
    best = load_checkpoint(tmp_path / "checkpoints" / "best")
    assert best.round == 3 and best.metrics == rec.best.to_dict()
    assert torch.equal(best.state["w"], torch.full((3,), 3.0))
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("round-*"))
    assert steps == ["round-001", "round-002", "round-003"]  # one checkpoint per step
    rec.end({"w": torch.zeros(3)})
    assert load_checkpoint(tmp_path / "checkpoints" / "final").round == 3


def test_the_starting_point_is_selected_when_every_trained_epoch_is_worse_on_validation(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings()
    rec = make_run(settings, tmp_path, CENTRALIZED)
    write_config(settings, tmp_path)
    start = RoundRow(round=0, epochs=0, metrics=scores(0.6, 1.0, 0.6), seconds=2.5)
    rec.start(start, {"w": torch.zeros(3)})
    for epoch, val in enumerate([0.5, 0.6]):  # worse, then equal top-1 at a higher loss
        row = RoundRow(
            round=epoch + 1, epochs=epoch + 1, metrics=scores(val, 1.5, 0.9), seconds=1.0
        )
        rec.record(row, {"w": torch.ones(3)})
    assert rec.best is start and rec.initial is start
    resumed = make_run(settings, tmp_path, CENTRALIZED)  # the start row survives a resume
    resumed.begin(load_resume_point(tmp_path, settings, CENTRALIZED), data={})
    assert resumed.best == start and resumed.initial == start
    assert [row.round for row in rec.history] == [1, 2]  # the start is no row of the history
    best = load_checkpoint(tmp_path / "checkpoints" / "best")
    assert best.round == 0 and torch.equal(best.state["w"], torch.zeros(3))
    # a trained epoch that is better on validation replaces it
    rec.record(RoundRow(round=3, epochs=3, metrics=scores(0.7, 1.5, 0.1), seconds=1.0), {})
    assert rec.best is not None and rec.best.round == 3
    with pytest.raises(RuntimeError, match="recorded once"):
        rec.start(start, {})


def test_a_round_without_validation_selects_the_latest() -> None:
    rec = Run(settings=Settings(), kind=FEDERATED, output_dir=None, label_map=LABELS)
    for r, top1 in ((1, 0.9), (2, 0.1)):
        no_val = {"test_top1": top1, "test_loss": 0.0}
        rec.record(RoundRow(round=r, epochs=r, metrics=no_val, seconds=0.0), {})
        assert rec.best is not None and rec.best.round == r


def test_round_line_is_one_fixed_format_line() -> None:
    row = RoundRow(
        round=7,
        epochs=14,
        train_loss=0.5,
        train_accuracy=0.75,
        metrics=scores(0.8, 0.4, 0.7),
        seconds=2.25,
        bytes_sent=2048,
        bytes_received=1024,
        dp_active=1,
        epsilon=1.5,
    )
    assert round_line(row) == (
        "round   7 | train loss 0.5000 acc 0.7500 | val loss 0.4000 top1 0.8000 | "
        "test loss 0.3000 top1 0.7000 | 2.2s | sent 2,048 B recv 1,024 B | ε 1.5"
    )
    untrained = RoundRow(round=0, epochs=0, metrics={"test_loss": 1.0, "test_top1": 0.5}, seconds=0)
    assert round_line(untrained, unit="epoch").startswith("epoch   0 | train loss nan acc nan |")


def federated_summary() -> RunSummary:
    return RunSummary(
        kind="federated",
        clients=2,
        mode=Mode.CLASSIFIER,
        head="classifier",
        num_labels=3,
        rounds=5,
        local_epochs=2,
        final=None,
        best=None,
        total_seconds=0.0,
        test_examples=10,
        selection="validation",
        data={},
        dp="fixed",
        delta=1e-5,
    )


def centralised_summary() -> RunSummary:
    return dataclasses.replace(federated_summary(), kind="centralized", clients=1, dp="none")


def round_of(
    strategy: CaRFedAvg,
    rounds: RoundRecorder,
    server_round: int,
    epsilons: tuple[float, float],
    *,
    active: float,
) -> None:
    """One aggregated round of two clients, then the server's evaluation call."""
    replies = [
        reply(
            node,
            {"w": np.full(3, float(server_round), np.float32)},
            n,
            **{"train-loss": loss, "train-accuracy": 0.5, "dp-active": active, "dp-epsilon": eps},
            **{"partition-id": pid},
        )
        for node, n, loss, eps, pid in (
            (11, 10, 1.0, epsilons[0], 0.0),
            (12, 30, 2.0, epsilons[1], 1.0),
        )
    ]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    assert arrays is not None
    rounds(server_round, arrays)


def same(left: object, right: object) -> bool:
    """Equal, NaN included (a DP round's train loss is NaN)."""
    return json.dumps(left, default=lambda row: row.to_dict()) == json.dumps(
        right, default=lambda row: row.to_dict()
    )


@pytest.mark.slow
def test_the_strategy_hands_its_round_statistics_to_the_recorder(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings(
        "fl.rounds=5",
        "fl.local_epochs=2",
        "dp=fixed",
        "dp.noise_multiplier=1.0",
        "dp.warmup_rounds=1",
    )
    (tmp_path / "config.yaml").write_text(settings_to_yaml(settings))
    evaluations = iter([scores(0.3, 1.0, 0.3), scores(0.6, 0.9, 0.5), scores(0.5, 0.8, 0.7)])
    rounds = RoundRecorder(
        make_run(settings, tmp_path),
        evaluate=lambda arrays: next(evaluations),
    )
    strategy = CaRFedAvg(spec=SPEC)
    rounds.rounds = strategy.history
    # dp=fixed with σ₀ = 1 after one warm-up round: one Gaussian of μ = 0.5 per client in round 2.
    one = rdp_epsilon({0.5: 1}, settings.dp.delta)
    rounds(0, global_model())  # the initial model: no statistics needed
    round_of(strategy, rounds, 1, (0.0, 0.0), active=0.0)  # the warm-up round
    round_of(strategy, rounds, 2, (one, 0.5), active=1.0)  # node 12 claims less than it spent

    history = rounds.run.history
    assert [row.round for row in history] == [1, 2]
    first, second = history
    assert first.epochs == 2 and first.clients_ok == 2 and first.clients_rejected == 0
    assert first.train_loss == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)  # example-weighted
    # Under DP an honest client sends no train metric: the ones these clients sent are not used.
    assert second.train_loss is not None and math.isnan(second.train_loss)
    # The largest ε any client spent, as the server computes it; node 12's claim is flagged.
    assert [row.epsilon for row in history] == [0.0, one]
    assert [row.claims_flagged for row in history] == [0, 1]
    assert [row.dp_active for row in history] == [0, 1] and first.skipped == 0
    assert rounds.run.client_rows is not None
    assert [(r.round, r.node, r.dp_epsilon, r.server_epsilon) for r in rounds.run.client_rows] == [
        (1, 11, 0.0, 0.0),
        (1, 12, 0.0, 0.0),
        (2, 11, one, one),
        (2, 12, 0.5, one),
    ]
    assert [bool(r.claim_mismatch) for r in rounds.run.client_rows] == [False, False, False, True]
    # Files after every round; the best round (on validation) has its checkpoint.
    metrics = MetricsFile.read(tmp_path)
    assert same(metrics.history, history) and metrics.summary.complete is False
    # Round 2 has the better test top-1, round 1 the better validation top-1.
    assert metrics.summary.best == history[0] and metrics.summary.initial == scores(0.3, 1.0, 0.3)
    assert metrics.summary.epsilon == one and metrics.summary.flagged_clients == [12]
    assert ClientRow.read_csv(tmp_path / CLIENTS_CSV) == rounds.run.client_rows
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "round-002")
    assert ckpt.epsilon == one and same(ckpt.metrics, history[1].to_dict())
    assert load_checkpoint(tmp_path / "checkpoints" / "best").round == 1

    # Resume reads the same typed rows back and restores selection and ε.
    point = load_resume_point(tmp_path, settings, FEDERATED)
    assert point.done == 2 and same(point.history, history)
    assert point.client_rows == rounds.run.client_rows and point.optimizer is None
    assert point.initial == scores(0.3, 1.0, 0.3)
    again = RoundRecorder(make_run(settings, tmp_path), evaluate=lambda a: scores(0, 0, 0))
    again.run.begin(point, data={})
    again.resume(point)
    assert again.run.best == history[0] and again.privacy.last_epsilon == one
    assert again.privacy.flagged == {12}
    assert json.loads((tmp_path / "metrics.json").read_text())["summary"]["epsilon"] == one


@pytest.mark.parametrize(
    "metrics",
    [
        {"dp-steps": 1.0},  # claims record-level DP without its other values
        {"dp-steps": 1.0, "dp-noise-multiplier": 1.0, "dp-sample-rate": 0.1, "dp-epsilon": 1.0},
        {"dp-epsilon": float("nan"), "train-loss": float("nan")},
    ],
)
@pytest.mark.parametrize("partition", [0.0, float("nan"), float("inf")])
def test_a_hostile_clients_metrics_cannot_end_the_run_or_poison_epsilon(
    make_settings, tmp_path: Path, metrics: dict[str, float], partition: float
) -> None:
    # With a cap on claimed examples, the server does not check the claimed partition id.
    settings = make_settings()
    rounds = RoundRecorder(
        make_run(settings, tmp_path),
        evaluate=lambda arrays: scores(0.5, 1.0, 0.5),
    )
    strategy = CaRFedAvg(spec=SPEC, max_examples=100)
    rounds.rounds = strategy.history
    honest = reply(11, {"w": np.ones(3, np.float32)}, 10, **{"dp-epsilon": 0.0})  # dp=none
    hostile = reply(10, {"w": np.ones(3, np.float32)}, 10, **{"partition-id": partition}, **metrics)
    arrays, _ = strategy.aggregate_train(1, [hostile, honest])  # the hostile reply first
    assert arrays is not None
    rounds(1, arrays)  # evaluates and records the round without raising
    row = rounds.run.history[-1]
    assert row.clients_ok == 2
    assert row.epsilon == 0.0  # the server's figure under dp=none; no claim takes over
    assert rounds.privacy.verdicts[11].mismatch == ""
    dp = MetricsFile.read(tmp_path).summary.dp_clients or {}
    assert all(math.isfinite(float(key)) for key in dp)


def test_a_round_the_strategy_never_recorded_is_an_error(make_settings, tmp_path: Path) -> None:
    rounds = RoundRecorder(
        make_run(make_settings(), tmp_path),
        evaluate=lambda arrays: scores(0.5, 1.0, 0.5),
    )
    with pytest.raises(RuntimeError, match="round 1: the strategy recorded no statistics"):
        rounds(1, global_model())
    rounds.rounds.append(RoundStats(round=1, started=0.0))  # the last round it saw is stale
    with pytest.raises(RuntimeError, match="round 2: the strategy recorded no statistics"):
        rounds(2, global_model())


@pytest.mark.slow
def test_centralised_and_federated_runs_record_through_the_same_recorder(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from car_fl.centralized import run_centralized
    from car_fl.simulation.in_process import run_local

    calls: list[tuple[str, int]] = []
    record = Run.record

    def spy(self: Run, row: RoundRow, state, **kwargs) -> None:
        calls.append((self.unit, row.round))
        record(self, row, state, **kwargs)

    monkeypatch.setattr(Run, "record", spy)
    run_centralized(make_settings("train.epochs=2"), tmp_path / "central")
    out = tmp_path / "fl"
    run_local(make_settings("fl.rounds=1", "fl.local_epochs=1", f"output_dir={out}"))
    assert calls == [("epoch", 1), ("epoch", 2), ("round", 1)]
    central = MetricsFile.read(tmp_path / "central")
    federated = MetricsFile.read(out)
    # The same row format: every centralised column is also a federated one.
    assert set(central.history[0].to_dict()) <= set(federated.history[0].to_dict())
    assert central.summary.best is not None and federated.summary.best is not None
    assert load_checkpoint(out / "checkpoints" / "best").round == federated.summary.best.round


def test_a_background_evaluation_lets_the_next_round_start_and_the_end_tests_best_and_final(
    make_settings, tmp_path: Path
) -> None:
    """``background``: the call returns while the evaluation runs; the round is recorded at
    the next call (or at ``close``). ``test``: only the best and the final state get test
    metrics, at ``close``, in their rows and checkpoints."""
    import threading

    settings = make_settings("dp=none")
    gates = [threading.Event() for _ in range(4)]  # round r's evaluation waits for gates[r]
    started: list[float] = []
    validation = iter([0.3, 0.4, 0.6, 0.5])  # rounds 0..3: round 2 is the best

    def evaluate(arrays: ArrayRecord) -> dict[str, float]:
        started.append(float(from_record(arrays)["w"][0]))  # w = the round
        assert gates[int(started[-1])].wait(30), "the test never released the evaluation"
        val = next(validation)
        return {"val_top1": val, "val_loss": 1 - val, "test_top1": math.nan, "test_loss": math.nan}

    tested: list[float] = []

    def test(state: dict[str, torch.Tensor]) -> dict[str, float]:
        tested.append(float(state["w"][0]))
        return {"test_top1": 0.1 * float(state["w"][0]), "test_loss": 0.5}

    rounds = RoundRecorder(
        make_run(settings, tmp_path),
        evaluate=evaluate,
        test=test,
        background=True,
    )
    strategy = CaRFedAvg(spec=SPEC)
    rounds.rounds = strategy.history
    assert rounds(0, global_model()) is None  # returns at once: the evaluation waits
    gates[0].set()
    for r in (1, 2, 3):
        round_of(strategy, rounds, r, (0.0, 0.0), active=0.0)  # returns while r's waits
        assert [row.round for row in rounds.run.history] == list(range(1, r))
        gates[r].set()
    rounds.close({"w": torch.full((3,), 3.0)}, round=3)
    history = rounds.run.history
    assert [row.round for row in history] == [1, 2, 3] and started == [0.0, 1.0, 2.0, 3.0]
    assert rounds.run.best is history[1] and tested == [2.0, 3.0]
    assert history[1].metrics["test_top1"] == pytest.approx(0.2)
    assert history[2].metrics["test_top1"] == pytest.approx(0.3)
    assert math.isnan(history[0].metrics["test_top1"])
    best = load_checkpoint(tmp_path / "checkpoints" / "best")
    assert best.round == 2 and best.metrics["test_top1"] == pytest.approx(0.2)
    assert load_checkpoint(tmp_path / "checkpoints" / "round-003").metrics[
        "test_top1"
    ] == pytest.approx(0.3)


def test_a_running_runs_plot_is_drawn_at_most_every_plot_seconds_and_always_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drawing costs more than a round of a small head: while the run goes on, the metrics
    files are written every round and the plot at most every PLOT_SECONDS."""
    from car_fl.results import run as module

    drawn: list[int] = []
    monkeypatch.setattr(module, "plot_curves", lambda *a, **k: drawn.append(len(a[1])))
    clock = iter([0.0, 1.0, 2.0, module.PLOT_SECONDS + 5.0, module.PLOT_SECONDS + 6.0])
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    rec = make_run(Settings(), tmp_path)
    for r in range(1, 6):
        metrics = {"val_top1": 0.1 * r, "val_loss": 1.0, "test_top1": 0.5, "test_loss": 1.0}
        rec.history.append(RoundRow(round=r, epochs=r, metrics=metrics, seconds=0.0))
        rec.write(complete=r == 5)
        assert len(MetricsFile.read(tmp_path).history) == r  # the rows: every round
    assert drawn == [1, 4, 5]  # the first, one after PLOT_SECONDS, the end
