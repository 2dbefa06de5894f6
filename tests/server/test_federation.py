"""Federated pieces without a simulation: aggregation, what travels, client shards."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from car_fl.model.retriever import build_retriever
from car_fl.protocol.messages import decode, from_record, payload_bytes, to_record
from tests.helpers import reply
from tests.reference import CaRFedAvg


def spec() -> dict:
    return {"w": ((2, 3), np.dtype("float32")), "b": ((3,), np.dtype("float32"))}


def test_weighted_fedavg_is_sum_of_n_i_over_n_theta_i() -> None:
    rng = np.random.default_rng(0)
    clients = {
        node: (
            {
                "w": rng.normal(size=(2, 3)).astype(np.float32),
                "b": rng.normal(size=3).astype(np.float32),
            },
            n,
        )
        for node, n in ((11, 10), (12, 30), (13, 60))
    }
    strategy = CaRFedAvg(min_clients=3, spec=spec())
    replies = [
        reply(node, arrays, n, **{"train-loss": float(node)})
        for node, (arrays, n) in clients.items()
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    for name in ("w", "b"):
        expected = sum(n / 100 * a[name].astype(np.float64) for a, n in clients.values())
        np.testing.assert_allclose(decode(arrays[name]), expected, rtol=1e-6)
    assert metrics["num-examples"] == 100
    assert metrics["train-loss"] == pytest.approx((11 * 10 + 12 * 30 + 13 * 60) / 100)


def test_aggregation_does_not_depend_on_arrival_order() -> None:
    rng = np.random.default_rng(1)
    parts = [
        (
            n,
            {
                "w": rng.normal(size=(2, 3)).astype(np.float32),
                "b": rng.normal(size=3).astype(np.float32),
            },
            k,
        )
        for n, k in ((1, 3), (2, 5), (3, 7))
    ]
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        strategy = CaRFedAvg(min_clients=3, spec=spec())
        arrays, _ = strategy.aggregate_train(1, [reply(*parts[i]) for i in order])
        assert arrays is not None
        results.append(decode(arrays["w"]))
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_a_round_without_valid_replies_keeps_the_model() -> None:
    strategy = CaRFedAvg(min_clients=1, spec=spec())
    bad = reply(5, {"w": np.full((2, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)}, 4)
    assert strategy.aggregate_train(1, [bad]) == (None, None)
    assert strategy.history[-1].rejected == {5: "tensor 'w' has non-finite values"}


def test_only_trainable_tensors_travel(make_settings) -> None:
    clf = build_retriever(make_settings("mode=classifier"), 4)
    adp = build_retriever(make_settings("mode=adapter"), 4)
    d = clf.encoder.hidden_size
    clf_record, adp_record = (
        to_record(clf.trainable_state_dict()),
        to_record(adp.trainable_state_dict()),
    )
    assert list(clf_record) == ["head.classifier.weight", "head.classifier.bias"]
    assert list(adp_record) == ["adapter.weight", "head.classifier.weight", "head.classifier.bias"]
    # Each tensor travels as exactly its raw bytes (no .npy header)
    for record, raw in ((clf_record, (4 * d + 4) * 4), (adp_record, (d * d + 4 * d + 4) * 4)):
        assert payload_bytes(record) == raw
    round_trip = from_record(adp_record)
    for name, value in adp.trainable_state_dict().items():
        assert torch.equal(round_trip[name], value)


def test_an_anonymous_error_reply_is_attributed_to_the_silent_node() -> None:
    from car_fl.server.strategy import RoundStats

    stats = RoundStats(round=1, started=0.0, bytes_sent={5: 10, 6: 10, 7: 10})
    stats.client_metrics = {5: {"num-examples": 1.0}, 6: {"num-examples": 1.0}}
    stats.failed = {1: "Node Unavailable"}
    stats.attribute_lost_replies()
    assert stats.failed == {7: "Node Unavailable"}
    two_lost = RoundStats(round=1, started=0.0, bytes_sent={5: 10, 6: 10})
    two_lost.attribute_lost_replies()
    assert set(two_lost.failed) == {5, 6}


class Nodes:
    """A stand-in Grid that sees a fixed set of node ids."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.count + 1))


def test_a_simulation_with_another_node_count_fails_at_once_with_its_fix() -> None:
    from car_fl.server.federation import wait_for_nodes

    for nodes in (2, 4):
        tick = time.monotonic()
        with pytest.raises(
            ValueError,
            match=r"runs \d SuperNodes but fl.clients=3: run it with "
            r"--federation-config 'num-supernodes=3'",
        ):
            wait_for_nodes(Nodes(nodes), 3, timeout=120, poll=0.1, simulation=True)  # type: ignore[arg-type]
        assert time.monotonic() - tick < 2.0
    assert wait_for_nodes(Nodes(3), 3, timeout=1, simulation=True) == [1, 2, 3]  # type: ignore[arg-type]


def test_a_deployment_waits_for_missing_nodes_and_refuses_extra_ones() -> None:
    from car_fl.server.federation import wait_for_nodes

    with pytest.raises(TimeoutError, match=r"only 2 of fl.clients=3 SuperNodes connected"):
        wait_for_nodes(Nodes(2), 3, timeout=0.3, poll=0.1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"4 SuperNodes are connected.*--run-config 'fl.clients=4'"
    ):
        wait_for_nodes(Nodes(4), 3, timeout=120, poll=0.1)  # type: ignore[arg-type]


def test_a_runs_folder_names_the_data_file_it_read_not_the_reader(make_settings) -> None:
    from car_fl.results.run import default_output_dir

    folder = default_output_dir(make_settings())
    assert folder.parent.name == "runs"
    assert "-synthetic-" in folder.name and "sms_spam" not in folder.name


def test_a_starting_point_not_evaluated_is_said_so_not_nan() -> None:
    """Issue 43: federated runs printed "(round 0, the starting point: test top1 nan)"."""
    from car_fl.results.run import starting_point

    assert starting_point(None) == "not evaluated"
    assert starting_point({"test_top1": float("nan")}) == "not evaluated"
    assert starting_point({"val_top1": 0.5}) == "not evaluated"
    assert starting_point({"test_top1": 0.9751}) == "0.9751"


def test_a_federated_run_refuses_the_linear_probe_before_touching_the_grid(make_settings) -> None:
    """flwr run . and the ServerApp read the same refusal as car-fl run: nothing is waited for,
    built or written (the grid is never used)."""
    from car_fl.server.federation import run_federation

    settings = make_settings("train.probe_epochs=2")
    with pytest.raises(ValueError, match=r"train.probe_epochs=2 only steer a centralised run"):
        run_federation(None, settings)  # type: ignore[arg-type]
    assert settings.output_dir is None or not list(Path(settings.output_dir).glob("*"))


def test_a_hostile_clients_train_metrics_do_not_become_the_rounds() -> None:
    """A reply's train-loss, train-accuracy and count are claims: a non-finite one (or a count
    that is not positive) is left out of the round's example-weighted figures."""
    from car_fl.protocol.messages import NUM_EXAMPLES
    from car_fl.server.strategy import RoundStats

    stats = RoundStats(round=1, started=time.perf_counter())
    stats.client_metrics = {
        1: {NUM_EXAMPLES: 10.0, "train-loss": 0.5},
        2: {NUM_EXAMPLES: 30.0, "train-loss": 1.0},
        3: {NUM_EXAMPLES: 10.0, "train-loss": float("-inf")},
        4: {NUM_EXAMPLES: float("nan"), "train-loss": 9.0},
        5: {NUM_EXAMPLES: -5.0, "train-loss": 9.0},
        6: {NUM_EXAMPLES: 10.0, "train-loss": float("nan")},
    }
    assert stats.weighted("train-loss") == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert np.isnan(stats.weighted("train-accuracy"))  # nobody sent it
