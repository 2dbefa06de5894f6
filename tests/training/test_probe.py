"""Linear probing (car_fl.training.train): the adapter starts from the head CaR selects, in a
centralised run (``train.probe_epochs``) and a federated one (``fl.probe_rounds``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.node import Node
from car_fl.privacy.mechanism import ADAPTER_WEIGHT
from car_fl.settings.compose import NodeInfo
from car_fl.settings.schema import Mode
from car_fl.standalone.centralized import run_centralized
from car_fl.training.train import keep_adapter, probe_round, round_settings
from tests.helpers import first_global_state


@pytest.mark.slow
def test_probing_starts_the_adapter_from_the_head_car_selects_on_the_same_features(
    make_settings, tmp_path: Path
) -> None:
    # lr 1 over-fits the tiny task after one epoch: CaR's validation peaks at epoch 1 of 4
    common = ("model.dtype=float32", "train.lr=1", "train.batch_size=16")
    car = run_centralized(
        make_settings("approach=car", "train.epochs=4", *common), tmp_path / "car"
    )
    assert 0 < car["best"]["round"] < car["final"]["round"], "no later epoch was worse"
    assert car["best"]["val_top1"] > car["final"]["val_top1"]
    probed = run_centralized(
        make_settings("approach=adapter_car", "train.epochs=1", "train.probe_epochs=4", *common),
        tmp_path / "probed",
    )
    plain = run_centralized(
        make_settings("approach=adapter_car", "train.epochs=1", *common), tmp_path / "plain"
    )
    # the adapter run starts from CaR's selected head, not from its last one
    probe = probed["probe"]
    assert probe["selected"] == car["best"]["round"]
    assert [row["epoch"] for row in probe["history"]] == [0, 1, 2, 3, 4]
    assert probed["initial"]["val_top1"] == pytest.approx(car["best"]["val_top1"])
    assert probed["initial"]["test_loss"] == pytest.approx(car["best"]["test_loss"], rel=1e-4)
    assert probed["initial"]["test_loss"] != pytest.approx(plain["initial"]["test_loss"])
    assert "probe" not in plain
    # patience ends the probe as it ends training: epoch 1 best, 2 and 3 worse
    patient = run_centralized(
        make_settings(
            "approach=adapter_car",
            "train.epochs=1",
            "train.probe_epochs=4",
            "train.patience=2",
            *common,
        ),
        tmp_path / "patient",
    )
    assert [row["epoch"] for row in patient["probe"]["history"]] == [0, 1, 2, 3]
    assert patient["initial"]["val_top1"] == pytest.approx(car["best"]["val_top1"])


# ------------------------------------------------------------------ federated: fl.probe_rounds


@pytest.mark.parametrize(
    "dp",
    [
        "dp=none",
        "dp=record dp.target_epsilon=3",
        "dp=fixed dp.noise_multiplier=1 dp.adapter_clip=0.001",
        "dp=fixed dp.noise_multiplier=1 dp.granularity=step fl.max_examples_per_client=500",
    ],
)
def test_a_probe_round_trains_the_head_alone_and_sends_the_adapter_back_as_it_came(
    make_settings, dp: str
) -> None:
    """Round 1 of ``fl.probe_rounds=1`` trains the head on the node's cached features (the
    identity adapter's, which are CaR's) and replies with the server's adapter, bit for bit,
    under every DP mechanism: the release covers the head alone. Noise on an adapter no step
    touched would have to match every planned step's noise, or (per step) its spread against
    the adapter the server sent would count the steps the node took, and so its n. Round 2
    trains the adapter. The reply has the same tensors either way."""
    settings = make_settings(
        "mode=adapter",
        "fl.rounds=3",
        "fl.probe_rounds=1",
        "fl.local_epochs=1",
        "train.batch_size=64",
        *dp.split(),
    )
    place = NodeInfo(partition_id=0, num_partitions=2)
    initial = first_global_state(settings, 4)
    node = Node(config={})
    probed, _ = node.train(settings, place, initial, 1, RecordDict())
    assert set(probed) == set(initial)
    assert torch.equal(probed[ADAPTER_WEIGHT], initial[ADAPTER_WEIGHT])
    head = [k for k in initial if k != ADAPTER_WEIGHT]
    assert any(not torch.equal(probed[k], initial[k]) for k in head), "the head did not train"
    # the probe round read features (the classifier mode's shard), not token ids
    assert [s.data.features is not None for s in node.shards.values()] == [True]
    trained, _ = node.train(settings, place, probed, 2, RecordDict())
    assert not torch.equal(trained[ADAPTER_WEIGHT], probed[ADAPTER_WEIGHT])
    assert sorted(s.data.features is not None for s in node.shards.values()) == [False, True]


def test_probe_rounds_change_nothing_for_car_and_are_refused_where_nothing_can_be_probed(
    make_settings,
) -> None:
    car = make_settings("approach=car", "fl.rounds=3", "fl.probe_rounds=2")
    assert not probe_round(car, 1) and round_settings(car, 1) is car  # every round probes
    adapter = make_settings("mode=adapter", "fl.rounds=3", "fl.probe_rounds=2")
    assert [probe_round(adapter, r) for r in (1, 2, 3)] == [True, True, False]
    assert round_settings(adapter, 2).train.mode is Mode.CLASSIFIER
    assert round_settings(adapter, 3) is adapter
    with pytest.raises(ValueError, match=r"fl.probe_rounds must be in \[0, fl.rounds=3\)"):
        make_settings("mode=adapter", "fl.rounds=3", "fl.probe_rounds=3")
    with pytest.raises(ValueError, match=r"fl.probe_rounds must be in"):
        make_settings("fl.probe_rounds=-1")
    with pytest.raises(ValueError, match=r"head.kind=mips has none to probe"):
        make_settings("approach=adapter_mips", "fl.rounds=3", "fl.probe_rounds=1")
    with pytest.raises(ValueError, match=r"needs the adapter among the tensors"):
        keep_adapter({}, {"head.classifier.weight": torch.zeros(2, 2)})
