"""car_fl.client.round: one round on a node (privacy: test_local_dp.py, test_record_dp.py)."""

from __future__ import annotations

import torch
from flwr.app import RecordDict

from car_fl.client import shard as client_module
from car_fl.client.round import train_round
from car_fl.method import encoder as encoder_module
from car_fl.method.features import FeatureCache
from car_fl.method.model import build_retriever
from car_fl.settings.flower import NodeInfo

STATE = {"head.classifier.weight": torch.randn(3, 8), "head.classifier.bias": torch.randn(3)}


def test_a_fully_cached_classifier_round_never_loads_the_encoder(make_settings) -> None:
    settings = make_settings("fl.local_epochs=1")
    node = NodeInfo(partition_id=0, num_partitions=2)
    initial = build_retriever(settings, 4, hidden_size=64).trainable_state_dict()

    def new_process() -> None:  # no shard, no encoder, no feature in memory
        client_module._SHARDS.clear()
        client_module._ENCODERS.clear()
        FeatureCache.clear_memory()

    new_process()
    before = encoder_module.LOAD_COUNT
    train_round(settings, node, initial, 1, RecordDict())  # extracts, fills the disk cache
    assert before + 1 == encoder_module.LOAD_COUNT
    new_process()  # only the disk cache is left
    loads = encoder_module.LOAD_COUNT
    state, metrics = train_round(settings, node, initial, 2, RecordDict())
    assert loads == encoder_module.LOAD_COUNT
    assert not client_module._ENCODERS
    assert metrics["num-examples"] > 0 and set(state) == set(initial)
