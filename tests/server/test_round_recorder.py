"""car_fl.server.round_recorder: ``train.patience`` ends a federated run (the real server and
ClientApp handler in process, on the tiny Llama)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message

from car_fl.results.checkpoint import load_checkpoint
from car_fl.simulation.apps import import_app
from car_fl.simulation.in_process import run_local

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


@pytest.mark.parametrize(("background", "last"), [("false", 2), ("true", 3)])
def test_patience_ends_a_federated_run_once_validation_stops_improving(
    make_settings, tmp_path: Path, background: str, last: int
) -> None:
    """Evaluated at once, patience 2 ends the run after round 2; evaluated in the background
    (round r's validation is known while r + 1 trains) one round later. The final checkpoint
    is the last round trained, the best the round validation selected."""
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


def test_a_patience_does_not_hide_a_run_in_which_every_round_failed(
    make_settings, tmp_path: Path
) -> None:
    """Hostile or broken clients: no valid update in any round, the model never changes, the
    patience ends the run after 2 rounds, and the run still fails, naming why."""
    real = import_app("client_app").train

    def broken(msg: Message, context: Context) -> Message:
        reply = real(msg, context)
        for record in reply.content.array_records.values():
            for name in list(record):
                del record[name]  # a reply without the model's tensors is rejected
        return reply

    settings = make_settings(*ROUNDS, "train.patience=2", f"output_dir={tmp_path / 'run'}")
    with pytest.raises(RuntimeError, match=r"every round failed: .* in 2 rounds"):
        run_local(settings, client_train=broken)
