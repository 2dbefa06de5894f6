"""A centralised classifier run whose features are all cached never loads the encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from car_fl.centralized import run_centralized
from car_fl.method import encoder as encoder_module
from car_fl.method.features import FeatureCache


def loads_since(count: int) -> int:
    return encoder_module.LOAD_COUNT - count


def history(out: Path) -> list[dict[str, float]]:
    rows = json.loads((out / "metrics.json").read_text())["history"]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "final" / "weights.safetensors"))


@pytest.mark.parametrize("head", ["classifier", "knn"])
def test_centralised_classifier_run_on_cached_features_never_loads_the_encoder(
    tmp_path: Path, make_settings, head: str
) -> None:
    settings = make_settings("train.epochs=2", f"head.kind={head}")
    before = encoder_module.LOAD_COUNT
    cold = run_centralized(settings, tmp_path / "cold")  # fills the disk cache
    assert loads_since(before) == 1

    FeatureCache.clear_memory()  # as in a new process: only the disk cache is left
    warm = run_centralized(settings, tmp_path / "warm")
    assert loads_since(before) == 1, "the encoder was loaded for cached features"
    # the same run: same head initialisation, same data order, same metrics
    assert history(tmp_path / "warm") == history(tmp_path / "cold")
    assert warm["final"]["test_top1"] == cold["final"]["test_top1"]
    if head == "classifier":
        cold_state, warm_state = final_state(tmp_path / "cold"), final_state(tmp_path / "warm")
        assert cold_state.keys() == warm_state.keys()
        assert all(torch.equal(cold_state[k], warm_state[k]) for k in cold_state)


def test_mips_and_adapter_runs_still_load_the_encoder(tmp_path: Path, make_settings) -> None:
    for i, overrides in enumerate(
        (["head.kind=mips"], ["mode=adapter", "train.epochs=1", "dataset.max_examples=40"])
    ):
        settings = make_settings(*overrides)
        run_centralized(settings, tmp_path / f"fill{i}")
        before = encoder_module.LOAD_COUNT
        run_centralized(settings, tmp_path / f"run{i}")
        assert loads_since(before) == 1, overrides
