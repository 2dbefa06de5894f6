"""car_fl.centralized: a run writes its files; cached features spare loading the encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from car_fl.centralized import run_centralized
from car_fl.method import encoder as encoder_module
from car_fl.method.features import FeatureCache
from car_fl.results.checkpoint import load_checkpoint


def loads_since(count: int) -> int:
    return encoder_module.LOAD_COUNT - count


def history(out: Path) -> list[dict[str, float]]:
    rows = json.loads((out / "metrics.json").read_text())["history"]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "final" / "weights.safetensors"))


@pytest.mark.parametrize("head", ["classifier", "knn"])
@pytest.mark.slow
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


@pytest.mark.slow
def test_mips_and_adapter_runs_still_load_the_encoder(tmp_path: Path, make_settings) -> None:
    for i, overrides in enumerate(
        (["head.kind=mips"], ["mode=adapter", "train.epochs=1", "dataset.max_examples=40"])
    ):
        settings = make_settings(*overrides)
        run_centralized(settings, tmp_path / f"fill{i}")
        before = encoder_module.LOAD_COUNT
        run_centralized(settings, tmp_path / f"run{i}")
        assert loads_since(before) == 1, overrides


def test_centralized_run_writes_config_metrics_plot_and_checkpoints(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("train.epochs=3")
    out = tmp_path / "run"
    summary = run_centralized(settings, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["kind"] == "centralized"
    assert [row["round"] for row in metrics["history"]] == [1, 2, 3]
    assert {
        "train_loss",
        "test_loss",
        "test_top1",
        "test_top5",
        "test_mrr",
        "test_macro_f1",
        "seconds",
    } <= set(metrics["history"][0])
    assert (out / "metrics.csv").read_text().splitlines()[0].startswith("round,")
    assert (out / "curves.png").stat().st_size > 1000
    assert "pooling: eos" in (out / "config.yaml").read_text()
    final = load_checkpoint(out / "checkpoints" / "final")
    assert final.round == 3 and final.settings == settings
    assert final.label_map.names == ("topic0", "topic1", "topic2", "topic3")
    assert set(final.state) == {"head.classifier.weight", "head.classifier.bias"}
    best = load_checkpoint(out / "checkpoints" / "best")
    assert best.metrics["test_top1"] == summary["best"]["test_top1"]


@pytest.mark.parametrize(
    "dp",
    [
        ("dp=record", "dp.target_epsilon=3"),
        ("dp=fixed",),
        ("dp=adaptive",),
    ],
)
def test_dp_modes_are_refused_before_any_work(
    tmp_path: Path, make_settings, dp: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"does not train with differential privacy.*dp=none"):
        run_centralized(make_settings(*dp), out)
    assert not out.exists()  # nothing written, nothing trained
