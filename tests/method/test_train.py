"""Centralised training on a learnable synthetic task, results files, checkpoints, retrieve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from car_fl.centralized import run_centralized
from car_fl.cli import main as cli_main
from car_fl.data.splits import load_splits
from car_fl.method.features import prepare_data
from car_fl.method.model import build_retriever
from car_fl.method.train import epoch_order, evaluate, make_optimizer, train_epoch
from car_fl.results.checkpoint import load_checkpoint
from car_fl.settings.schema import Mode


@pytest.mark.parametrize(
    ("mode", "pooling", "which"),
    [
        ("classifier", "mean", "llama"),
        ("classifier", "eos", "llama"),
        ("adapter", "eos", "llama"),
        ("adapter", "mean", "llama"),
        ("classifier", "mean", "bert"),
        ("adapter", "mean", "bert"),
    ],
)
def test_training_reaches_high_accuracy(
    make_settings, tmp_path: Path, tiny_bert: Path, mode: str, pooling: str, which: str
) -> None:
    settings = make_settings(
        f"mode={mode}",
        f"model.pooling={pooling}",
        "train.lr=0.01",
        # Cached-feature epochs are nearly free; the adapter needs fewer passes.
        "train.epochs=25" if mode == "classifier" else "train.epochs=8",
        model_dir=tiny_bert if which == "bert" else None,
    )
    summary = run_centralized(settings, tmp_path / "run")
    assert summary["final"]["test_top1"] >= 0.9, summary["final"]
    assert summary["final"]["test_top3"] >= summary["final"]["test_top1"]


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


def test_retrieve_command_prints_top_k_labels(
    make_settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings("train.epochs=6", "train.lr=0.01", "model.pooling=mean")
    run_centralized(settings, tmp_path / "run")
    queries = tmp_path / "queries.txt"
    queries.write_text("w3 k2 w4\n\nk0 w1\n")
    ckpt = str(tmp_path / "run" / "checkpoints" / "final")
    assert (
        cli_main(["retrieve", "--checkpoint", ckpt, "--file", str(queries), "-k", "2", "--json"])
        == 0
    )
    payload = json.loads(capsys.readouterr().out)
    assert [p["query"] for p in payload] == ["w3 k2 w4", "k0 w1"]
    assert [p["results"][0]["label"] for p in payload] == ["topic2", "topic0"]
    assert all(len(p["results"]) == 2 for p in payload)
    assert cli_main(["retrieve", "--checkpoint", ckpt, "k1"]) == 0
    assert "topic1" in capsys.readouterr().out.splitlines()[1]


def test_retrieve_command_serves_a_knn_run_from_its_training_split(
    make_settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings("approach=knn", "head.knn_k=1", "head.similarity=cosine")
    run_centralized(settings, tmp_path / "run")
    splits = load_splits(settings.dataset, seed=settings.seed)
    texts, ids = splits.train["text"][:5], splits.train["label"][:5]
    ckpt = str(tmp_path / "run" / "checkpoints" / "final")
    assert cli_main(["retrieve", "--checkpoint", ckpt, "-k", "1", "--json", *texts]) == 0
    payload = json.loads(capsys.readouterr().out)
    # a training text's nearest example in memory is itself
    assert [p["results"][0]["label"] for p in payload] == splits.label_map.decode(ids)


def test_retrieve_rejects_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a car-fl checkpoint"):
        cli_main(["retrieve", "--checkpoint", str(tmp_path), "hello"])


def test_epoch_order_depends_only_on_seed_and_epoch() -> None:
    a = epoch_order(50, seed=1, epoch=3)
    assert torch.equal(a, epoch_order(50, seed=1, epoch=3))
    assert not torch.equal(a, epoch_order(50, seed=1, epoch=4))
    assert sorted(a.tolist()) == list(range(50))


def test_training_in_adapter_mode_changes_adapter_not_encoder(make_settings) -> None:
    settings = make_settings("mode=adapter", "train.epochs=1")
    splits = load_splits(settings.dataset, seed=settings.seed)
    model = build_retriever(settings, len(splits.label_map))
    frozen = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    data = prepare_data(
        splits.train["text"][:40],
        splits.train["label"][:40],
        mode=Mode.ADAPTER_CLASSIFIER,
        model_cfg=settings.model,
        device="cpu",
        get_model=lambda: model,
        cache=None,
        batch_size=8,
        progress=False,
    )
    train_epoch(
        model,
        data,
        make_optimizer(model, settings.train),
        batch_size=4,
        seed=0,
        epoch=0,
        progress=False,
    )
    assert not model.adapter.is_identity()
    for name, value in model.encoder.state_dict().items():
        assert torch.equal(value, frozen[name]), name
    metrics = evaluate(model, data, batch_size=16, top_k=[1, 2])
    assert 0.0 <= metrics["top1"] <= metrics["top2"] <= 1.0
