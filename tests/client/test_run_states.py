"""car_fl.client.run_states: every run's state, kept only when its round succeeds."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from flwr.app import MetricRecord, RecordDict

from car_fl.client.node import Node
from car_fl.client.run_states import RunStates


def steps(state: RecordDict) -> int:
    record = state.metric_records.get("dp")
    return int(record["steps"]) if record is not None else 0  # type: ignore[arg-type]


def test_a_round_works_on_a_copy_that_is_kept_only_when_it_succeeded(tmp_path: Path) -> None:
    states = RunStates(tmp_path / "runs")
    state = states.get("7")
    state["dp"] = MetricRecord({"steps": 10})
    assert steps(states.get("7")) == 0  # a failed round (never kept) changed nothing
    states.keep("7", state)
    assert steps(states.get("7")) == 10 and steps(states.get("8")) == 0  # runs kept apart
    path = tmp_path / "runs" / "7.state"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert steps(RunStates(tmp_path / "runs").get("7")) == 10  # a restarted worker goes on
    assert states.runs() == ["7", "8"]


def test_a_run_id_cannot_name_a_path_outside_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RunStates(tmp_path / "runs").keep("../../ledger", RecordDict())
    assert not (tmp_path / "ledger.state").exists()


def test_the_node_owns_the_store_a_worker_gives_it(tmp_path: Path) -> None:
    from car_fl.client.worker import NodeWorker

    worker = NodeWorker(tmp_path, {"partition-id": 0, "num-partitions": 1})
    assert isinstance(worker.node, Node) and worker.node.states.folder == tmp_path / "runs"
    assert Node({}).states.folder is None  # no worker: memory (the ClientApp hands Flower's)
