"""car_fl.centralized: a run writes its files; cached features spare loading the encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from car_fl.centralized import run_centralized
from car_fl.model import encoder as encoder_module
from car_fl.model.feature_cache import FeatureCache
from car_fl.results.run import load_checkpoint


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
def test_adapter_runs_still_load_the_encoder_and_cached_mips_runs_do_not(
    tmp_path: Path, make_settings
) -> None:
    for i, (overrides, loads) in enumerate(
        (
            (["head.kind=mips"], 0),  # documents and held-out queries cached
            (["mode=adapter", "train.epochs=1", "dataset.max_examples=40"], 1),
        )
    ):
        settings = make_settings(*overrides)
        run_centralized(settings, tmp_path / f"fill{i}")
        FeatureCache.clear_memory()  # as in a new process
        before = encoder_module.LOAD_COUNT
        run_centralized(settings, tmp_path / f"run{i}")
        assert loads_since(before) == loads, overrides


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


def test_an_untrained_start_is_selected_when_training_makes_validation_worse(
    make_corpus_settings, tmp_path: Path
) -> None:
    # A document head starts as MIPS; a learning rate this large wrecks it in one epoch.
    settings = make_corpus_settings(
        "approach=document", "train.epochs=2", "train.lr=500", "train.rows_lr=500"
    )
    out = tmp_path / "run"
    summary = run_centralized(settings, out)
    start, trained = summary["initial"], summary["final"]
    assert (
        max(row["val_top1"] for row in json.loads((out / "metrics.json").read_text())["history"])
        < start["val_top1"]
    ), "training did not make validation worse: the test proves nothing"
    assert summary["best"]["round"] == 0 and summary["best"]["val_top1"] == start["val_top1"]
    assert trained["round"] == 2
    # the best checkpoint is the untrained head, and it scores as MIPS (cosine) does
    best = load_checkpoint(out / "checkpoints" / "best")
    assert best.round == 0 and best.metrics["val_top1"] == start["val_top1"]
    mips = run_centralized(
        make_corpus_settings("approach=mips", "head.similarity=cosine"), tmp_path / "mips"
    )
    assert mips["best"]["test_top1"] == pytest.approx(start["test_top1"])


def test_patience_stops_training_once_validation_stops_improving(
    make_corpus_settings, tmp_path: Path
) -> None:
    # The same wrecking learning rate: epoch 0 stays best, so patience 2 stops after epoch 2.
    settings = make_corpus_settings(
        "approach=document",
        "train.epochs=6",
        "train.lr=500",
        "train.rows_lr=500",
        "train.patience=2",
    )
    out = tmp_path / "run"
    summary = run_centralized(settings, out)
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [row["round"] for row in history] == [1, 2]  # round 0 is the summary's initial
    assert summary["best"]["round"] == 0 and summary["final"]["round"] == 2
    assert summary["epochs"] == 2
    improving = run_centralized(
        make_corpus_settings("approach=document", "train.epochs=2", "train.patience=2"),
        tmp_path / "improving",
    )
    assert improving["final"]["round"] == 2  # no stop before the ceiling without a stall


@pytest.mark.slow
def test_a_trained_head_is_selected_over_its_start_only_when_better_on_validation(
    make_settings, tmp_path: Path
) -> None:
    summary = run_centralized(make_settings("train.epochs=3", "train.lr=0.01"), tmp_path / "run")
    start, best = summary["initial"], summary["best"]
    assert best["round"] > 0 and best["val_top1"] > start["val_top1"]  # a random head starts
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best").round == best["round"]


@pytest.mark.slow
def test_a_mips_run_writes_best_and_final_and_its_best_checkpoint_retrieves(
    make_corpus_settings, tmp_path: Path
) -> None:
    from car_fl.serving.checkpoint import load_retriever

    settings = make_corpus_settings(
        "approach=mips", "head.similarity=cosine", "head.temperature=0.05"
    )
    run_centralized(settings, tmp_path / "run")
    for name in ("best", "final"):
        assert load_checkpoint(tmp_path / "run" / "checkpoints" / name).round == 0
    retriever = load_retriever(tmp_path / "run" / "checkpoints" / "best", device="cpu")
    [result] = retriever.retrieve(["w5 w47"], 3)
    assert result.score_kind == "cosine" and result.probabilities is None
    # the score is the cosine itself, not divided by the temperature nor a softmax
    assert all(-1.0 <= s <= 1.0 for s in result.scores) and result.scores[0] > 0.05
    assert list(result.scores) == sorted(result.scores, reverse=True)
    assert all(hit.probability is None for hit in result.hits)


@pytest.mark.slow
def test_a_second_run_over_other_lists_of_the_same_texts_encodes_nothing_new(
    make_corpus_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_corpus_settings("approach=document", "train.epochs=1")
    run_centralized(settings, tmp_path / "first")  # encodes every query and document
    puts: list[int] = []
    original = FeatureCache.put

    def spy(self: FeatureCache, space: str, texts: Any, features: torch.Tensor) -> None:
        puts.append(len(texts))
        original(self, space, texts, features)

    monkeypatch.setattr(FeatureCache, "put", spy)
    FeatureCache.clear_memory()  # as in a new process: only the disk cache is left
    before = encoder_module.LOAD_COUNT
    # more new documents: a shorter list of training queries (the old whole-list key missed
    # it); then MIPS, which encodes documents and held-out queries only
    for i, extra in enumerate((["dataset.new_fraction=0.5"], ["approach=mips"])):
        run_centralized(
            make_corpus_settings("approach=document", "train.epochs=1", *extra),
            tmp_path / f"again{i}",
        )
    assert puts == [] and before == encoder_module.LOAD_COUNT


@pytest.mark.slow
def test_a_federation_selects_its_untrained_round_0_when_training_makes_validation_worse(
    make_corpus_settings, tmp_path: Path
) -> None:
    """The federated counterpart: round 0 (the untrained document head, = MIPS) is the first
    candidate, and rounds that only make validation worse never replace it."""
    from car_fl.simulation.in_process import run_local

    out = tmp_path / "fl"
    settings = make_corpus_settings(
        "approach=document",
        "fl.clients=2",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "train.lr=500",
        "train.rows_lr=500",
        f"output_dir={out}",
    )
    metrics = run_local(settings)
    summary = metrics["summary"]
    start = summary["initial"]
    rounds = [row for row in metrics["history"] if row["round"] > 0]
    assert len(rounds) == 2 and max(row["val_top1"] for row in rounds) < start["val_top1"], (
        "training did not make validation worse: the test proves nothing"
    )
    assert summary["best"]["round"] == 0 and summary["best"]["val_top1"] == start["val_top1"]
    assert summary["final"]["round"] == 2
    best = load_checkpoint(out / "checkpoints" / "best")
    assert best.round == 0 and best.metrics["val_top1"] == start["val_top1"]
