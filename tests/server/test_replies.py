"""Nothing poisoned, nothing lost: bad replies are rejected, skipped rounds keep the model
(the checkpoint crash test lives in test_checkpoint.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array

from car_fl.protocol.messages import RAW_STYPE, decode, encode
from car_fl.results.run import load_checkpoint
from car_fl.testing.tiny import tiny_overrides
from tests.helpers import reply
from tests.reference import CaRFedAvg

SPEC = {"w": ((2, 3), np.dtype("float32")), "b": ((3,), np.dtype("float32"))}


def good(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(2, 3)).astype(np.float32),
        "b": rng.normal(size=3).astype(np.float32),
    }


def bad_replies() -> dict[int, tuple[dict[str, np.ndarray], object, str]]:
    """node → (arrays, num-examples, expected reason)."""
    ok = good(9)
    return {
        101: ({**ok, "w": np.full((2, 3), np.nan, np.float32)}, 5, "non-finite"),
        102: ({**ok, "b": np.array([np.inf, 0, 0], np.float32)}, 5, "non-finite"),
        103: ({**ok, "w": np.ones((1, 3), np.float32)}, 5, r"shape \(1, 3\)"),  # would broadcast
        104: ({"w": ok["w"]}, 5, r"missing \['b'\]"),
        105: ({**ok, "extra": np.zeros(2, np.float32)}, 5, r"extra \['extra'\]"),
        106: ({**ok, "w": ok["w"].astype(np.float64)}, 5, "dtype float64"),
        107: (ok, 0, "must be positive"),
        108: (ok, -4, "must be positive"),
        109: (ok, float("nan"), "must be an integer"),
        110: (ok, 10**9, "exceeds the cap of 1000"),
    }


@pytest.mark.parametrize("order", [0, 1, 2])
def test_every_kind_of_bad_reply_is_rejected_and_only_valid_ones_count(order: int) -> None:
    valid = {1: (good(1), 10), 2: (good(2), 30)}
    messages = [reply(node, arrays, n) for node, (arrays, n) in valid.items()]
    messages += [reply(node, arrays, n) for node, (arrays, n, _) in bad_replies().items()]
    rng = np.random.default_rng(order)
    messages = [messages[i] for i in rng.permutation(len(messages))]
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, max_examples=1000)
    arrays, metrics = strategy.aggregate_train(1, messages)
    assert arrays is not None and metrics is not None
    for name in ("w", "b"):
        expected = (10 * good(1)[name].astype(np.float64) + 30 * good(2)[name]) / 40
        np.testing.assert_allclose(decode(arrays[name]), expected, rtol=1e-6, atol=1e-7)
    rejected = strategy.history[-1].rejected
    for node, (_, _, reason) in bad_replies().items():
        assert node in rejected
        assert re.search(reason, rejected[node]), (node, rejected[node])
    assert metrics["num-examples"] == 40


def test_aggregate_is_the_same_for_every_arrival_order() -> None:
    messages = [reply(n, good(n), 5 * n) for n in (1, 2, 3)]
    results = []
    for perm in itertools.permutations(messages):
        arrays, _ = CaRFedAvg(min_clients=1, spec=SPEC).aggregate_train(1, list(perm))
        assert arrays is not None
        results.append(decode(arrays["w"]).tobytes())
    assert len(set(results)) == 1


def test_example_counts_are_capped_by_the_partition_the_server_pinned_to_each_node() -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, shard_sizes={0: 50, 1: 70})
    first = [
        reply(1, good(1), 50, **{"partition-id": 0}),
        reply(2, good(2), 80, **{"partition-id": 1}),  # partition 1 holds only 70
    ]
    strategy.aggregate_train(1, first)
    assert strategy.history[-1].rejected == {2: "'num-examples' = 80 exceeds the cap of 70"}
    assert strategy.claims.held == {1: 0}  # only a valid reply pins its partition
    # A hostile node cannot borrow the larger shard of another node, nor switch partitions.
    second = [
        reply(1, good(1), 70, **{"partition-id": 1}),
        reply(2, good(2), 70, **{"partition-id": 1}),
        reply(3, good(3), 50, **{"partition-id": 0}),
    ]
    _, metrics = strategy.aggregate_train(2, second)
    rejected = strategy.history[-1].rejected
    assert rejected[1] == "node 1 holds partition 0, now claims partition 1"
    assert rejected[3].startswith("partition 0 is held by node 1")
    assert set(rejected) == {1, 3}
    assert metrics is not None and metrics["num-examples"] == 70
    assert strategy.claims.held == {1: 0, 2: 1}


@pytest.mark.parametrize("claim", [None, 2, -1, 0.5, 1e9])
def test_a_claim_of_no_partition_of_this_run_is_rejected(claim: object) -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, shard_sizes={0: 50, 1: 70})
    metrics = {} if claim is None else {"partition-id": claim}
    strategy.aggregate_train(1, [reply(1, good(1), 5, **metrics)])  # type: ignore[arg-type]
    assert "'partition-id'" in strategy.history[-1].rejected[1]


def test_pre_sharded_nodes_are_capped_by_max_examples_per_client() -> None:
    # Nodes started with data-is-shard hold data the server cannot size: one cap for all,
    # whatever partition they report.
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, shard_sizes={0: 50, 1: 50}, max_examples=300)
    replies = [
        reply(1, good(1), 300, **{"partition-id": 0}),
        reply(2, good(2), 120, **{"partition-id": 0}),
        reply(3, good(3), 301, **{"partition-id": 1}),
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert strategy.history[-1].rejected == {3: "'num-examples' = 301 exceeds the cap of 300"}
    assert metrics is not None and metrics["num-examples"] == 420


def npy(values: np.ndarray, shape: tuple[int, ...] | None = None) -> Array:
    """NumPy's ``.npy`` format (Flower's default), with the metadata shape we choose."""
    array = Array(values)
    return Array(dtype=array.dtype, shape=shape or array.shape, stype=array.stype, data=array.data)


@pytest.mark.parametrize(
    ("name", "array", "reason"),
    [
        # payload (1,) under metadata (2, 3): would broadcast into every cell
        ("w", npy(np.full(1, 1e3, np.float32), (2, 3)), "only 'car_fl.raw'"),
        # payload (5,) under metadata (3,): would crash the round
        ("b", npy(np.ones(5, np.float32), (3,)), "only 'car_fl.raw'"),
        # even an honest .npy array: only car-fl's own format is read
        ("w", npy(np.ones((2, 3), np.float32)), "only 'car_fl.raw'"),
        # raw bytes that do not fill the shape the metadata gives
        ("w", Array(dtype="<f4", shape=(2, 3), stype=RAW_STYPE, data=b"\0" * 4), "cannot be read"),
        # raw bytes of the right length for metadata that lies about the shape
        ("w", encode(np.ones((3, 2), np.float32)), r"shape \(3, 2\)"),
    ],
)
def test_shape_is_checked_on_the_decoded_values_of_our_own_wire_format_only(
    name: str, array: Array, reason: str
) -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC)
    bad = reply(7, {**good(7), name: array}, 5)
    arrays, _ = strategy.aggregate_train(1, [reply(1, good(1), 5), bad])
    assert re.search(reason, strategy.history[-1].rejected[7])
    assert arrays is not None
    np.testing.assert_array_equal(decode(arrays["w"]), good(1)["w"])


@pytest.mark.parametrize(("min_valid", "fraction"), [(3, 0.0), (1, 0.75)])
def test_below_the_minimum_of_valid_replies_the_round_is_skipped(
    min_valid: int, fraction: float
) -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, min_valid=min_valid, min_valid_fraction=fraction)
    messages = [
        reply(1, good(1), 5),
        reply(2, good(2), 5),
        reply(3, bad_replies()[101][0], 5),
        reply(4, good(4), 0),
    ]
    assert strategy.aggregate_train(1, messages) == (None, None)
    assert not strategy.history[-1].aggregated


@pytest.mark.slow
def test_a_poisoned_round_leaves_the_model_bit_identical_and_the_run_completes(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    import csv

    import torch

    from car_fl.settings.compose import load_settings
    from car_fl.simulation.in_process import run_local

    def poisoning_train(msg, context):
        from car_fl.protocol.messages import ARRAYS_KEY
        from car_fl.simulation.apps import import_app

        out = import_app("client_app").train(msg, context)
        if (
            int(context.node_config["partition-id"]) == 1
            and int(msg.content["config"]["server-round"]) == 2
        ):
            from car_fl.protocol.messages import decode, encode

            record = out.content[ARRAYS_KEY]
            weight = decode(record["head.classifier.weight"]).copy()
            weight[0, 0] = float("nan")
            record["head.classifier.weight"] = encode(weight)
        return out

    out = tmp_path / "fl"
    settings = load_settings(
        [
            *tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache"),
            "fl.rounds=3",
            "fl.local_epochs=1",
            "fl.min_valid_fraction=1.0",
            f"output_dir={out}",
        ]
    )
    metrics = run_local(settings, client_train=poisoning_train)
    assert [row["skipped"] for row in metrics["history"]] == [0, 1, 0]
    r1 = load_checkpoint(out / "checkpoints" / "round-001").state
    r2 = load_checkpoint(out / "checkpoints" / "round-002").state
    r3 = load_checkpoint(out / "checkpoints" / "round-003").state
    assert all(torch.equal(r1[k], r2[k]) for k in r1)
    assert not all(torch.equal(r2[k], r3[k]) for k in r2)
    rows = [r for r in csv.DictReader((out / "clients.csv").open()) if r["round"] == "2"]
    assert sorted(r["status"] for r in rows) == ["ok", "rejected"]
    assert any("non-finite" in r["reason"] for r in rows)


@pytest.mark.slow
def test_pre_sharded_nodes_train_with_the_documented_cap_and_are_refused_without(
    make_settings, tmp_path: Path
) -> None:
    """Nodes started with data-is-shard report their whole file (here 400 examples), which no
    partition of the server's split holds: without fl.max_examples_per_client every reply is
    refused and the run fails; with it the run completes."""
    import torch

    from car_fl.simulation.in_process import run_local

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = ["fl.rounds=1", "fl.local_epochs=1"]
        shard = {"data-is-shard": "true"}
        refused = "every round failed: .*: 2 nodes sent replies the server rejected"
        with pytest.raises(RuntimeError, match=refused):
            run_local(make_settings(*base, f"output_dir={tmp_path / 'a'}"), node_config=shard)
        metrics = run_local(
            make_settings(*base, "fl.max_examples_per_client=400", f"output_dir={tmp_path / 'b'}"),
            node_config=shard,
        )
    finally:
        torch.set_num_threads(threads)
    assert metrics["summary"]["complete"]
    assert metrics["history"][0]["clients_ok"] == 2


@pytest.mark.parametrize("claimed", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_partition_id_is_rejected_not_a_crash(claimed: float) -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, shard_sizes={0: 50, 1: 70})
    replies = [
        reply(1, good(1), 50, **{"partition-id": 0}),
        reply(2, good(2), 50, **{"partition-id": claimed}),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None  # the honest reply is aggregated, the run goes on
    np.testing.assert_array_equal(decode(arrays["w"]), good(1)["w"])
    assert "'partition-id' must be an integer" in strategy.history[-1].rejected[2]
