"""Linear probing (car_fl.method.probe): the adapter starts from the head CaR selects."""

from __future__ import annotations

from pathlib import Path

import pytest

from car_fl.method.centralized import run_centralized


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
