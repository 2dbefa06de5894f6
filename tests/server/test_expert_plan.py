"""A mixture of experts on the server: which experts travel, partial replies, their aggregation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg, FedMedian

from car_fl.protocol.messages import decode, to_record
from car_fl.server.expert_plan import ExpertPlan
from car_fl.server.strategy import GuardedStrategy
from car_fl.settings.schema import ExpertSending
from tests.helpers import reply, set_task_identity

NAMES = ["head.gate", "head.log_scale", *(f"head.experts.{c}" for c in range(4))]
SPEC = {
    "head.gate": ((4, 2), np.dtype("float32")),
    "head.log_scale": ((1,), np.dtype("float32")),
    **{f"head.experts.{c}": ((3, 2), np.dtype("float32")) for c in range(4)},
}


def model(value: float) -> dict[str, np.ndarray]:
    return {name: np.full(shape, value, dtype=dtype) for name, (shape, dtype) in SPEC.items()}


class FakeGrid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def plan(send: ExpertSending, blocks: int = 2) -> ExpertPlan:
    return ExpertPlan(send=send, blocks=blocks, names=tuple(NAMES), layout="AAAA")


def configured(
    strategy: GuardedStrategy, nodes: list[int], server_round: int = 1
) -> dict[int, list[str]]:
    """configure_train for one round; the tensor names each node is sent."""
    set_task_identity()
    record = to_record({k: torch.from_numpy(v) for k, v in model(0.0).items()})
    messages = strategy.configure_train(server_round, record, ConfigRecord(), FakeGrid(nodes))  # type: ignore[arg-type]
    return {m.metadata.dst_node_id: list(m.content["arrays"]) for m in messages}


def test_the_schedule_rotates_blocks_of_experts_and_always_sends_the_shared_tensors() -> None:
    schedule = plan(ExpertSending.SCHEDULE, blocks=2)
    first = schedule.sent(1, 0)
    assert first == ["head.gate", "head.log_scale", "head.experts.1", "head.experts.3"]
    assert schedule.sent(2, 0) == [
        "head.gate",
        "head.log_scale",
        "head.experts.0",
        "head.experts.2",
    ]
    assert schedule.sent(1, 1) == schedule.sent(2, 0)  # the next client, the next block
    assert schedule.optional(first) == set()
    assert plan(ExpertSending.ALL).sent(1, 0) == NAMES
    routed = plan(ExpertSending.ROUTED)
    assert routed.optional(NAMES) == {f"head.experts.{c}" for c in range(4)}


def test_each_node_is_sent_its_block_and_the_bytes_count_only_that() -> None:
    strategy = GuardedStrategy(FedAvg(), spec=SPEC, experts=plan(ExpertSending.SCHEDULE))
    sent = configured(strategy, [7, 9])
    assert sent == {
        7: ["head.gate", "head.log_scale", "head.experts.1", "head.experts.3"],
        9: ["head.gate", "head.log_scale", "head.experts.0", "head.experts.2"],
    }
    stats = strategy.current
    assert stats is not None
    shared = (8 + 1) * 4  # gate and scale
    assert stats.bytes_sent == {7: shared + 2 * 24 + 4, 9: shared + 2 * 24 + 4}  # + the layout


def test_partial_replies_average_each_expert_over_its_senders_and_keep_the_rest() -> None:
    strategy = GuardedStrategy(FedAvg(), spec=SPEC, experts=plan(ExpertSending.ROUTED))
    configured(strategy, [1, 2, 3])
    shared = ["head.gate", "head.log_scale"]
    sends = {
        1: ([*shared, "head.experts.0"], 1.0, 10),
        2: ([*shared, "head.experts.0", "head.experts.1"], 4.0, 30),
        3: (shared, 2.0, 60),
    }
    replies = [
        reply(node, {n: model(value)[n] for n in names}, count)
        for node, (names, value, count) in sends.items()
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.history[-1].rejected == {}
    out = {k: decode(v) for k, v in arrays.items()}
    np.testing.assert_allclose(out["head.gate"], (1.0 * 10 + 4.0 * 30 + 2.0 * 60) / 100)
    np.testing.assert_allclose(out["head.experts.0"], (1.0 * 10 + 4.0 * 30) / 40)  # not / 100
    np.testing.assert_allclose(out["head.experts.1"], 4.0)  # one sender: its value
    np.testing.assert_array_equal(out["head.experts.2"], 0.0)  # nobody: kept, not averaged
    assert set(out) == set(SPEC)


def test_robust_strategies_aggregate_partial_replies_per_tensor_too() -> None:
    strategy = GuardedStrategy(FedMedian(), spec=SPEC, experts=plan(ExpertSending.ROUTED))
    configured(strategy, [1, 2, 3])
    replies = [
        reply(
            1,
            {
                **{n: model(1.0)[n] for n in NAMES[:2]},
                "head.experts.3": model(1.0)["head.experts.3"],
            },
            5,
        ),
        reply(2, {n: model(5.0)[n] for n in NAMES[:2]}, 5),
        reply(
            3,
            {
                **{n: model(9.0)[n] for n in NAMES[:2]},
                "head.experts.3": model(3.0)["head.experts.3"],
            },
            5,
        ),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    assert float(decode(arrays["head.gate"]).max()) == 5.0  # median of 1, 5, 9
    assert float(decode(arrays["head.experts.3"]).max()) == 2.0  # median of its two senders


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (["head.gate", "head.log_scale", "head.experts.1"], r"missing \['head.experts.3'\]"),
        (
            ["head.gate", "head.log_scale", "head.experts.1", "head.experts.3", "head.experts.0"],
            r"extra \['head.experts.0'\]",
        ),
        (["head.gate", "head.experts.1", "head.experts.3"], r"missing \['head.log_scale'\]"),
    ],
)
def test_a_reply_that_is_not_exactly_its_scheduled_block_is_rejected(
    names: list[str], reason: str
) -> None:
    strategy = GuardedStrategy(FedAvg(), spec=SPEC, experts=plan(ExpertSending.SCHEDULE))
    configured(strategy, [7, 9])
    good = reply(9, {n: model(1.0)[n] for n in strategy.expected[9][0]}, 5)
    bad = reply(7, {n: model(1.0)[n] for n in names}, 5)
    arrays, _ = strategy.aggregate_train(1, [good, bad])
    assert arrays is not None
    assert list(strategy.history[-1].rejected) == [7]
    assert strategy.history[-1].rejected[7].startswith("tensor names differ")
    import re

    assert re.search(reason, strategy.history[-1].rejected[7])
    out = {k: decode(v) for k, v in arrays.items()}
    np.testing.assert_array_equal(out["head.experts.1"], 0.0)  # the rejected node's block: kept
    np.testing.assert_array_equal(out["head.experts.0"], 1.0)


def test_a_routed_reply_must_still_hold_the_shared_tensors() -> None:
    strategy = GuardedStrategy(FedAvg(), spec=SPEC, experts=plan(ExpertSending.ROUTED))
    configured(strategy, [1, 2])
    arrays, _ = strategy.aggregate_train(
        1,
        [reply(1, {"head.experts.0": model(1.0)["head.experts.0"]}, 5), reply(2, model(2.0), 5)],
    )
    assert arrays is not None
    assert "missing ['head.gate', 'head.log_scale']" in strategy.history[-1].rejected[1]


@pytest.mark.slow
def test_a_scheduled_mixture_federation_sends_blocks_and_serves_its_checkpoint(
    make_corpus_settings, tmp_path
) -> None:
    from car_fl.serving.checkpoint import load_retriever
    from car_fl.simulation.in_process import run_local

    out = tmp_path / "fl"
    settings = make_corpus_settings(
        "approach=moe",
        "moe.experts=4",
        "moe.route=2",
        "moe.iterations=2",
        "moe.send=schedule",
        "moe.schedule_blocks=2",
        "fl.clients=2",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "train.lr=0.01",
        f"output_dir={out}",
    )
    metrics = run_local(settings)
    rows = [r for r in metrics["history"] if r["round"] > 0]
    assert [r["clients_ok"] for r in rows] == [2, 2] and all(r["skipped"] == 0 for r in rows)
    retriever = load_retriever(out / "checkpoints" / "final", device="cpu")
    assert retriever.kind.value == "moe"
    full = sum(v.numel() * 4 for v in retriever.trainable_state_dict().values())
    experts = sum(p.numel() * 4 for p in retriever.head.experts)  # type: ignore[union-attr]
    for row in rows:  # one of two blocks of experts travels down, plus the layout
        assert full - experts < row["bytes_sent_per_client"] < full
    (result,) = retriever.retrieve(["w3 w44"], 3)
    assert len(result.hits) == 3 and all(h.text for h in result.hits)
