"""car_fl.client.node: every run's state, kept only when its round succeeds."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from flwr.app import MetricRecord, RecordDict

from car_fl.client.node import ContextState, Node, RunStates


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


def test_two_spellings_of_one_run_id_are_one_run(tmp_path: Path) -> None:
    states = RunStates(tmp_path / "runs")
    first = states.get("7")
    first["dp"] = MetricRecord({"steps": 10})
    states.keep("7", first)
    second = states.get("07")
    assert steps(second) == 10
    second["dp"] = MetricRecord({"steps": 20})
    states.keep("07", second)
    assert steps(states.get("7")) == 20 and states.runs() == ["7"]


def test_without_a_worker_a_failed_round_leaves_flowers_state_as_it_was(tmp_path: Path) -> None:
    """The ClientApp hands the Node Flower's context.state (ContextState): the Node works on a
    copy and writes it back only when the round succeeded (one copy-and-keep path)."""
    from flwr.app import Context

    import client_app

    context = Context(
        run_id=3, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    context.state["run-3/dp"] = MetricRecord({"steps": 5})

    from car_fl.client.node import Node

    class Failing(Node):
        def respond(self, content: RecordDict, *, node_state: RecordDict, **_: object) -> None:  # type: ignore[override]
            node_state["dp"] = MetricRecord({"steps": 99})  # counted, then the round fails
            raise RuntimeError("the round failed after its state changed")

    key = repr(sorted((str(k), str(v)) for k, v in context.node_config.items()))
    client_app.NODES[key] = Failing(dict(context.node_config))
    try:
        with pytest.raises(RuntimeError):
            client_app.train_here(RecordDict(), context)
    finally:
        client_app.NODES.pop(key)
    assert steps(ContextState(context.state).get("3")) == 5


def test_without_a_worker_each_run_of_a_series_keeps_its_own_state() -> None:
    """Flower 1.39 keeps context.state per run series: a new run of the series inherited the
    last run's accountant and mechanism (review of issue 42). Each run has its own now."""
    flower_state = RecordDict()
    first, second = ContextState(flower_state), ContextState(flower_state)
    state = first.get("3")
    state["dp"] = MetricRecord({"steps": 5})
    first.keep("3", state)
    assert steps(second.get("4")) == 0  # a new run starts from nothing
    later = second.get("4")
    later["dp"] = MetricRecord({"steps": 1})
    second.keep("4", later)
    assert steps(first.get("3")) == 5 and steps(second.get("4")) == 1
    assert steps(first.get("03")) == 5  # one spelling per run id


@pytest.mark.parametrize("spelling", ["-7", "7_0", "\u0667", "7.0", " 7", "", str(2**64)])
def test_a_run_id_is_ascii_digits_only(tmp_path: Path, spelling: str) -> None:
    """Issue 41: "-7", "7_0" and Arabic-Indic digits were accepted as integers by int()."""
    from car_fl.client.node import run_key

    with pytest.raises(ValueError, match="ASCII digits"):
        run_key(spelling)
    with pytest.raises(ValueError):
        RunStates(tmp_path / "runs").get(spelling)
    assert run_key("07") == run_key(7) == "7"
