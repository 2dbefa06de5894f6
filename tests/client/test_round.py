"""car_fl.client.round: one round on a node (privacy: test_local_dp.py, test_record_dp.py)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.node import Node
from car_fl.model import encoder as encoder_module
from car_fl.model.feature_cache import FeatureCache
from car_fl.model.retriever import build_retriever
from car_fl.settings.compose import NodeInfo
from tests.helpers import first_global_state

STATE = {"head.classifier.weight": torch.randn(3, 8), "head.classifier.bias": torch.randn(3)}


@pytest.mark.slow
def test_a_fully_cached_classifier_round_never_loads_the_encoder(make_settings) -> None:
    settings = make_settings("fl.local_epochs=1")
    node = NodeInfo(partition_id=0, num_partitions=2)
    initial = build_retriever(settings, 4, hidden_size=64).trainable_state_dict()

    def new_process() -> None:  # no shard, no encoder, no feature in memory
        encoder_module._SHARED.clear()  # as in a new process
        FeatureCache.clear_memory()

    new_process()
    before = encoder_module.LOAD_COUNT
    Node(config={}).train(
        settings, node, initial, 1, RecordDict()
    )  # extracts, fills the disk cache
    assert before + 1 == encoder_module.LOAD_COUNT
    new_process()  # only the disk cache is left
    loads = encoder_module.LOAD_COUNT
    state, metrics = Node(config={}).train(settings, node, initial, 2, RecordDict())
    assert loads == encoder_module.LOAD_COUNT
    assert not encoder_module._SHARED
    assert metrics["num-examples"] > 0 and set(state) == set(initial)


@pytest.mark.parametrize(
    "overrides",
    [
        "dp=fixed dp.noise_multiplier=1",
        "dp=record dp.target_epsilon=3",
        "mode=adapter dp=fixed dp.noise_multiplier=1",
    ],
)
def test_a_label_map_the_node_shares_nothing_with_gets_the_same_kind_of_reply(
    make_settings, overrides: str
) -> None:
    # A crafted label map must not learn "does this node have label L?" from whether the
    # round fails: with none of its labels the node still trains (on nothing) and replies
    settings = make_settings("fl.local_epochs=1", *overrides.split())
    node = NodeInfo(partition_id=0, num_partitions=2)
    replies = {}
    for name, labels in {"some": ["topic0", "zz"], "none": ["yy", "zz"]}.items():
        initial = first_global_state(settings, 2)
        state, metrics = Node(config={}).train(settings, node, initial, 1, RecordDict(), labels)
        assert set(state) == set(initial)
        assert all(bool(torch.isfinite(v).all()) for v in state.values())
        replies[name] = metrics
    assert replies["some"].keys() == replies["none"].keys()
    assert replies["some"]["num-examples"] == replies["none"]["num-examples"]
    assert replies["some"]["dp-epsilon"] == replies["none"]["dp-epsilon"]


@pytest.mark.slow
def test_a_federated_client_after_a_centralised_run_on_the_same_node_encodes_nothing_new(
    make_settings, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from car_fl.centralized import run_centralized
    from car_fl.client.node import own_cache

    # the node owner's default cache ($CAR_FL_CACHE), for the centralised run and the node alike
    settings = make_settings("train.epochs=1", "cache_dir=null")
    run_centralized(settings, tmp_path / "central")
    node_settings = own_cache(settings, {})  # what a node without a cache-dir resolves to
    encoder_module._SHARED.clear()  # as in a new process
    FeatureCache.clear_memory()  # another process: only the disk cache is shared
    puts: list[int] = []
    monkeypatch.setattr(FeatureCache, "put", lambda self, space, texts, f: puts.append(len(texts)))
    loads = encoder_module.LOAD_COUNT
    initial = build_retriever(settings, 4, hidden_size=64).trainable_state_dict()
    for partition in range(2):  # each client's shard: a list of texts no run encoded as such
        node = NodeInfo(partition_id=partition, num_partitions=2)
        state, metrics = Node(config={}).train(node_settings, node, initial, 1, RecordDict())
        assert metrics["num-examples"] > 0 and set(state) == set(initial)
    assert puts == [] and loads == encoder_module.LOAD_COUNT and not encoder_module._SHARED
