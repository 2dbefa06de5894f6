"""car_fl.client.round: the experts a node sends never depend on its data under DP.

The adversary is a curious server: it sees which tensors each reply holds. Under DP that set
must be a function of what the server sent alone, whatever the node's queries are.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.node import Node
from car_fl.client.round import tensors_to_send
from car_fl.data.splits import load_splits
from car_fl.heads.experts import EXPERT_PREFIX, MixtureHead
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.serving.checkpoint import checkpoint_extra
from car_fl.settings.compose import NodeInfo
from car_fl.settings.schema import Settings

MOE = ("approach=moe", "moe.experts=4", "moe.route=1", "moe.iterations=2", "fl.local_epochs=1")


def server_model(settings: Settings) -> CaRRetriever:
    splits = load_splits(settings.dataset, seed=settings.seed)
    assert splits.documents is not None
    names = splits.label_map.names
    return build_retriever(settings, len(names), documents=[d.text for d in splits.documents])


def global_model(
    settings: Settings,
) -> tuple[dict[str, torch.Tensor], tuple[str, ...], dict[str, str]]:
    """The server's model: its trainable state, label names and expert layout as text."""
    model = server_model(settings)
    names = load_splits(settings.dataset, seed=settings.seed).label_map.names
    return model.trainable_state_dict(), names, checkpoint_extra(settings, names, model)


def sent_experts(
    settings: Settings,
    partition: int,
    state: dict[str, torch.Tensor],
    names: tuple[str, ...],
    layout: str,
) -> set[str]:
    reply, _ = Node(config={}).train(
        settings,
        NodeInfo(partition_id=partition, num_partitions=3),
        state,
        1,
        RecordDict(),
        names,
        layout=layout,
    )
    return {n for n in reply if n.startswith(EXPERT_PREFIX)}


@pytest.mark.slow
@pytest.mark.parametrize("send", ["all", "schedule"])
def test_under_dp_the_experts_a_node_sends_do_not_depend_on_its_data(
    make_corpus_settings, send: str
) -> None:
    settings = make_corpus_settings(
        *MOE,
        f"moe.send={send}",
        "moe.schedule_blocks=2",
        "fl.partitioning=topic",
        "dp=record",
        "dp.delta=1e-4",
        "dp.sample_rate=0.5",
    )
    state, names, extra = global_model(settings)
    if send == "schedule":  # the server sent block 1 of the experts: odd ones
        state = {
            n: v
            for n, v in state.items()
            if not n.startswith(EXPERT_PREFIX) or int(n[len(EXPERT_PREFIX) :]) % 2 == 1
        }
    expected = {n for n in state if n.startswith(EXPERT_PREFIX)}
    for partition in range(3):  # three nodes with different (topic-skewed) queries
        assert sent_experts(settings, partition, state, names, extra["moe_layout"]) == expected


@pytest.mark.slow
def test_outgoing_under_dp_ignores_which_experts_training_touched(make_corpus_settings) -> None:
    """Even a configuration that slipped past the settings (routed under DP) sends every
    expert it holds: the node checks again."""
    settings = make_corpus_settings(*MOE, "moe.send=all", "dp=record", "dp.delta=1e-4")
    settings.moe.send = settings.moe.send.ROUTED  # as a malicious server might ship it
    model = server_model(settings)
    state = model.trainable_state_dict()
    head = model.head
    assert isinstance(head, MixtureHead)
    for touched in (set(), {0}, {1, 3}):
        head.touched = touched
        assert set(tensors_to_send(model, settings)) == set(state)
    settings.dp.mode = settings.dp.mode.NONE
    head.touched = {1}
    assert {n for n in tensors_to_send(model, settings) if n.startswith(EXPERT_PREFIX)} == {
        f"{EXPERT_PREFIX}1"
    }
    assert all(torch.equal(tensors_to_send(model, settings)[n], state[n]) for n in ("head.gate",))
