"""car_fl.commands.generate_queries: a corpus checkpoint's own causal LM writes training
queries, its retriever keeps those it answers with their document, and a run trains on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.centralized import run_centralized
from car_fl.cli import main
from car_fl.data.splits import load_splits


@pytest.fixture
def causal_run(make_corpus_settings, tiny_generator: Path, tmp_path: Path):
    """A document-head run whose frozen encoder is the tiny causal Llama itself."""
    settings = make_corpus_settings(
        "approach=document", "train.epochs=1", f"model.name_or_path={tiny_generator}"
    )
    run_centralized(settings, tmp_path / "run")
    return settings, str(tmp_path / "run" / "checkpoints" / "final")


def test_queries_are_written_filtered_by_the_round_trip_and_join_a_runs_training_split(
    causal_run, make_corpus_settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings, ckpt = causal_run
    out = tmp_path / "generated.jsonl"
    common = ["generate-queries", "--checkpoint", ckpt, "--out", str(out), "--device", "cpu"]
    common += ["--per-document", "2", "--max-new-tokens", "5"]
    assert main([*common, "--keep-top-k", "12"]) == 0  # 12 documents: every query comes back
    everything = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["documents"] == 12 and summary["kept"] == summary["generated"]
    assert len(everything) == summary["kept"] > 0 and all(1 <= r["rank"] <= 12 for r in everything)
    assert f"{summary['kept']} of {summary['generated']} queries kept" in capsys.readouterr().out

    assert main([*common, "--keep-top-k", "1"]) == 0
    capsys.readouterr()
    strict = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(strict) < len(everything) and all(r["rank"] == 1 for r in strict)
    assert {(r["query"], r["document_id"]) for r in strict} <= {
        (r["query"], r["document_id"]) for r in everything
    }  # same seed, same samples: the top-1 round trip keeps a subset

    assert main([*common, "--keep-top-k", "12"]) == 0
    capsys.readouterr()
    plain = load_splits(settings.dataset, seed=settings.seed)
    with_generated = make_corpus_settings(f"dataset.generated_queries_path={out}")
    splits = load_splits(with_generated.dataset, seed=with_generated.seed)
    added = list(splits.train["text"])[len(plain.train) :]
    assert added and set(added) <= {r["query"] for r in everything}
    assert list(splits.validation["text"]) == list(plain.validation["text"])
    assert list(splits.test["text"]) == list(plain.test["text"])


def test_bad_arguments_are_one_line_and_a_non_zero_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate-queries", "--checkpoint", str(tmp_path), "--out"]
    assert main([*args, str(tmp_path / "q.csv")]) == 1
    assert "write a .jsonl file" in capsys.readouterr().err
    assert main([*args, str(tmp_path / "q.jsonl"), "--per-document", "0"]) == 1
    assert "--per-document and --max-new-tokens must be >= 1" in capsys.readouterr().err
