"""Federated pieces without a simulation: aggregation, what travels, client shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from car_fl.method.model import build_retriever
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


def test_server_rejects_missing_local_paths_before_contacting_nodes(
    make_settings,
    tmp_path: Path,
) -> None:
    from car_fl.server.federation import check_local_paths

    check_local_paths(make_settings())  # the fixtures exist
    with pytest.raises(FileNotFoundError, match=r"dataset.path=.*nope.tsv does not exist"):
        check_local_paths(make_settings(f"dataset.path={tmp_path / 'nope.tsv'}"))
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path=.*no-model is not a folder"):
        check_local_paths(make_settings(model_dir=tmp_path / "no-model"))
