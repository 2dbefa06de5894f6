"""car_fl.server.federation: ``train.patience`` ends a federated run (the real server and
ClientApp handler in process, on the tiny Llama)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message

from car_fl.privacy.mechanism import ADAPTER_WEIGHT
from car_fl.results.run import ResumePoint, load_checkpoint
from car_fl.server.federation import PatienceSpent, RoundRecorder
from car_fl.server.strategy import RoundStats
from car_fl.simulation.apps import import_app
from car_fl.simulation.in_process import run_local
from tests.results.test_run import federated_summary, global_model, make_run, scores

ROUNDS = ("fl.clients=2", "fl.local_epochs=1", "fl.rounds=6")


def idle(msg: Message, context: Context) -> Message:
    """A client that trains and then sends the global model back unchanged: no round is ever
    better than the starting point on validation, so patience P ends the run after round P."""
    reply = import_app("client_app").train(msg, context)
    for key in reply.content.array_records:
        reply.content[key] = msg.content.array_records[key]
    return reply


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rounds_of(out: Path) -> list[int]:
    return [row["round"] for row in json.loads((out / "metrics.json").read_text())["history"]]


@pytest.mark.parametrize("background", ["false", "true"])
def test_patience_ends_a_federated_run_once_validation_stops_improving(
    make_settings, tmp_path: Path, background: str
) -> None:
    """Patience 2 ends the run after round 2, evaluated at once or in the background (where
    round r's validation is known while r + 1 trains, except a round whose validation alone
    decides the stop: the server waits for it rather than train a round it would drop). The
    final checkpoint is the last round trained, the best the round validation selected."""
    last = 2
    out = tmp_path / "run"
    settings = make_settings(
        *ROUNDS, "train.patience=2", f"eval.background={background}", f"output_dir={out}"
    )
    metrics = run_local(settings, client_train=idle)
    summary = metrics["summary"]
    assert rounds_of(out) == list(range(1, last + 1))
    assert summary["stopped_early"] == last and summary["rounds"] == 6
    assert summary["best"]["round"] == 0 and summary["final"]["round"] == last
    assert summary["complete"] is True
    assert load_checkpoint(out / "checkpoints" / "final").round == last
    assert load_checkpoint(out / "checkpoints" / "best").round == 0
    # the same run without a patience trains every round: the stop was the patience's
    whole = run_local(
        make_settings(*ROUNDS, "fl.rounds=3", f"output_dir={tmp_path / 'whole'}"),
        client_train=idle,
    )
    assert whole["summary"]["best"]["round"] == 0 and "stopped_early" not in whole["summary"]
    assert rounds_of(tmp_path / "whole") == [1, 2, 3]
    # a patience that runs out in the last round stops nothing: the run is not "stopped early"
    full = run_local(
        make_settings(*ROUNDS, "fl.rounds=2", "train.patience=2", f"output_dir={tmp_path / 'f'}"),
        client_train=idle,
    )
    assert "stopped_early" not in full["summary"] and rounds_of(tmp_path / "f") == [1, 2]


def test_a_run_its_patience_ended_is_finished_and_resume_says_so(
    make_settings, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run_local(make_settings(*ROUNDS, "train.patience=1", f"output_dir={out}"), client_train=idle)
    assert rounds_of(out) == [1]
    again = make_settings(
        *ROUNDS, "fl.rounds=8", "train.patience=1", f"resume={out}", f"output_dir={out}"
    )
    with pytest.raises(
        ValueError, match=r"ended after round 1, .* it finished, it was not interrupted"
    ):
        run_local(again, client_train=idle)


def test_skipped_rounds_do_not_spend_the_patience_and_a_failed_run_still_fails(
    make_settings, tmp_path: Path
) -> None:
    """Hostile, broken or unreachable clients: no valid update in any round, the model never
    changes; that is not "validation stopped improving" (nothing trained), so patience 1 does
    not end the run, and the run still fails, naming why."""
    real = import_app("client_app").train

    def broken(msg: Message, context: Context) -> Message:
        reply = real(msg, context)
        for record in reply.content.array_records.values():
            for name in list(record):
                del record[name]  # a reply without the model's tensors is rejected
        return reply

    settings = make_settings(
        *ROUNDS, "fl.rounds=3", "train.patience=1", f"output_dir={tmp_path / 'run'}"
    )
    with pytest.raises(RuntimeError, match=r"every round failed: .* in 3 rounds"):
        run_local(settings, client_train=broken)


def resumed(rounds: RoundRecorder, history: list, done: int) -> None:
    """``rounds`` goes on after round ``done`` of ``history`` (started from val top-1 0.2)."""
    summary = federated_summary()
    summary.initial, summary.total_seconds = scores(0.2, 1.0, 0.5), 0.0
    folder = rounds.run.checkpoints / f"round-{done:03d}"
    point = ResumePoint(done, load_checkpoint(folder), history[:done], summary, [], None, False)
    rounds.run.begin(point, data={})
    rounds.resume(point)


def record_round(rounds: RoundRecorder, number: int, *, aggregated: bool = True) -> None:
    rounds.rounds.append(RoundStats(round=number, started=0.0, aggregated=aggregated))
    rounds(number - rounds.round_offset, global_model())


def test_patience_counts_the_rounds_that_trained_since_the_best_one(
    make_settings, tmp_path: Path
) -> None:
    """Validation improves in rounds 1 and 3; round 4 is skipped (no valid reply), 5 and 6 do
    not improve: patience 2 ends the run after round 6, not after 2 (since round 0) nor after 5
    (round 4 trained nothing). Resumed after round 6, the stalled run ends at once; one whose
    last round is the stall's ends normally (nothing left to stop)."""
    settings = make_settings("fl.rounds=10", "train.patience=2")
    val = {0: 0.2, 1: 0.5, 2: 0.4, 3: 0.6, 4: 0.6, 5: 0.5, 6: 0.55}
    step = iter(sorted(val))

    def evaluate(arrays) -> dict[str, float]:
        return scores(val[next(step)], 1.0, 0.5)

    def make() -> RoundRecorder:
        return RoundRecorder(make_run(settings, tmp_path), evaluate=evaluate)

    rounds = make()
    rounds(0, global_model())
    for number in range(1, 6):
        record_round(rounds, number, aggregated=number != 4)
        assert rounds.run.stopped_early is None
    with pytest.raises(PatienceSpent) as stop:
        record_round(rounds, 6)
    assert stop.value.round == 6 and rounds.run.stopped_early == 6
    assert rounds.run.best is not None and rounds.run.best.round == 3
    assert [row.skipped for row in rounds.run.history] == [0, 0, 0, 1, 0, 0]

    history = list(rounds.run.history)
    again = make()
    resumed(again, history, 6)
    step = iter([6])  # the resumed state is evaluated again
    with pytest.raises(PatienceSpent) as stop:
        again(0, global_model())
    assert stop.value.round == 6

    settings.fl.rounds = 6  # the stall falls on the last round: the run simply ends there
    last = make()
    resumed(last, history, 5)
    step = iter([5, 6])
    last(0, global_model())
    record_round(last, 6)
    assert last.run.stopped_early is None


@pytest.mark.parametrize(("round_3", "stops"), [(0.45, True), (0.6, False)])
def test_in_the_background_only_the_round_that_decides_the_patience_is_waited_for(
    make_settings, tmp_path: Path, round_3: float, stops: bool
) -> None:
    """Background evaluation, patience 2, the best in round 1, round 2 no better: rounds 1
    and 2 return while their evaluations wait (the next round trains meanwhile); round 3's
    validation alone decides whether the patience is spent, so its call waits for it and
    ends the run after round 3 when it is no better, or goes on when it is (not one round
    later, after a round the run would drop)."""
    import threading

    settings = make_settings("fl.rounds=10", "train.patience=2")
    val = {0: 0.2, 1: 0.5, 2: 0.4, 3: round_3}
    gates = {r: threading.Event() for r in val}  # round r's evaluation waits for gates[r]
    step = iter(sorted(val))

    def evaluate(arrays) -> dict[str, float]:
        r = next(step)
        assert gates[r].wait(10), f"round {r}'s evaluation was never released"
        return scores(val[r], 1.0, 0.5)

    rounds = RoundRecorder(make_run(settings, tmp_path), evaluate=evaluate, background=True)
    rounds(0, global_model())  # returns while round 0's evaluation waits
    gates[0].set()
    for number in (1, 2):
        record_round(rounds, number)  # returns while round `number`'s evaluation waits
        assert [row.round for row in rounds.run.history] == list(range(1, number))
        gates[number].set()
    gates[3].set()  # round 3 decides: its call waits for the evaluation
    if stops:
        with pytest.raises(PatienceSpent) as stop:
            record_round(rounds, 3)
        assert stop.value.round == 3 and rounds.run.stopped_early == 3
    else:
        record_round(rounds, 3)
        assert rounds.run.stopped_early is None
    assert [row.round for row in rounds.run.history] == [1, 2, 3]
    assert rounds.run.best is not None
    assert rounds.run.best.round == (1 if stops else 3)
    rounds.schedule.close()


def test_probe_rounds_do_not_spend_the_patience(make_settings, tmp_path: Path) -> None:
    """``fl.probe_rounds=3``: validation peaks in probe round 1 and rounds 2 to 5 do not beat
    it. Patience 2 would end a run without probe rounds after round 3; here the adapter gets
    its 2 rounds after the probe (4 and 5), so the run ends after round 5."""
    val = {0: 0.2, 1: 0.5, 2: 0.4, 3: 0.45, 4: 0.4, 5: 0.4}

    def run(*overrides: str) -> int | None:
        settings = make_settings("mode=adapter", "fl.rounds=10", "train.patience=2", *overrides)
        step = iter(sorted(val))
        rounds = RoundRecorder(
            make_run(settings, tmp_path / "-".join(overrides)),
            evaluate=lambda arrays: scores(val[next(step)], 1.0, 0.5),
        )
        rounds(0, global_model())
        try:
            for number in range(1, 6):
                record_round(rounds, number)
        except PatienceSpent as stop:
            return stop.round
        return None

    assert run("fl.probe_rounds=0") == 3
    assert run("fl.probe_rounds=3") == 5


def test_a_federated_run_with_probe_rounds_starts_the_adapter_after_them(
    make_settings, tmp_path: Path
) -> None:
    """The real server and ClientApp in process: round 1 (the probe) moves the head and leaves
    the identity adapter exactly as it was; round 2 trains it."""
    out = tmp_path / "run"
    settings = make_settings(
        "mode=adapter",
        "fl.clients=2",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "fl.probe_rounds=1",
        f"output_dir={out}",
    )
    run_local(settings)
    start = load_checkpoint(out / "checkpoints" / "round-001").state
    after = load_checkpoint(out / "checkpoints" / "round-002").state
    identity = torch.eye(start[ADAPTER_WEIGHT].shape[0])
    # FedAvg of two copies of the same adapter: equal up to the weights' rounding
    torch.testing.assert_close(start[ADAPTER_WEIGHT], identity, rtol=0, atol=1e-6)
    assert (after[ADAPTER_WEIGHT] - identity).abs().max() > 1e-4


@pytest.mark.parametrize(
    ("dp", "refused"),
    [
        (("dp=record", "dp.target_epsilon=4", "dp.sample_rate=0.5"), True),
        (
            (
                "dp=record",
                "dp.target_epsilon=null",
                "dp.noise_multiplier=1.5",
                "dp.sample_rate=0.5",
            ),
            False,
        ),
    ],
    ids=["sigma-from-target", "sigma-given"],
)
def test_a_resume_that_would_recalibrate_dp_sgds_noise_is_refused(
    make_settings, tmp_path: Path, dp: tuple[str, ...], refused: bool
) -> None:
    """A malicious or careless operator resumed a dp=record run with a target ε and more
    rounds: σ was calibrated again for the new plan, and the server counted the rounds already
    run with it (measured before the fix, target ε 4, 3 → 30 rounds after 2: the server
    reported ε 0.88 where 3.21 had been spent). A σ that does not
    depend on fl.rounds may still be resumed with more rounds."""
    out = tmp_path / "run"
    first = make_settings("fl.clients=2", "fl.local_epochs=1", "fl.rounds=2", *dp)
    first.output_dir = str(out)
    run_local(first, client_train=idle)
    again = make_settings("fl.clients=2", "fl.local_epochs=1", "fl.rounds=30", *dp)
    again.output_dir, again.resume = str(out), str(out)
    if refused:
        with pytest.raises(ValueError, match=r"σ is calibrated to fl.rounds: 2 rounds gave σ"):
            run_local(again, client_train=idle)
        return
    again.fl.rounds = 3
    assert rounds_of(out) == [1, 2]
    run_local(again, client_train=idle)
    assert rounds_of(out) == [1, 2, 3]
