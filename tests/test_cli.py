"""The car-fl command (car_fl.cli): retrieve (report: tests/results/test_report.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from car_fl.centralized import run_centralized
from car_fl.cli import main as cli_main
from car_fl.data.splits import load_splits


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_a_wrong_checkpoint_is_one_line_without_traceback_unless_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["retrieve", "--checkpoint", str(tmp_path), "hello"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl retrieve: ") and "not a car-fl checkpoint" in line
    with pytest.raises(FileNotFoundError, match="not a car-fl checkpoint"):
        cli_main(["retrieve", "--debug", "--checkpoint", str(tmp_path), "hello"])
    with pytest.raises(FileNotFoundError, match="not a car-fl checkpoint"):
        cli_main(["--debug", "retrieve", "--checkpoint", str(tmp_path), "hello"])


@pytest.mark.slow
def test_retrieve_command_prints_a_corpus_checkpoints_documents(
    make_corpus_settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from car_fl.data.corpus import read_documents

    settings = make_corpus_settings("approach=document", "train.epochs=1")
    run_centralized(settings, tmp_path / "run")
    ckpt = str(tmp_path / "run" / "checkpoints" / "final")
    documents = settings.dataset.documents_path or ""
    texts = {d.id: d.text for d in read_documents(documents)}
    args = ["retrieve", "--checkpoint", ckpt, "--documents", documents, "-k", "3", "--json"]
    assert cli_main([*args, "w5 w47"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)
    hits = payload["results"]
    assert len(hits) == 3 and all(h["text"] == texts[h["id"]] == texts[h["label"]] for h in hits)
    assert cli_main(["retrieve", "--checkpoint", ckpt, "-k", "1", "w5 w47"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split("\t")[-1] == texts[hits[0]["id"]]  # id, score and the document's text


def test_every_subcommand_is_listed() -> None:
    from car_fl.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {
        "train",
        "run",
        "retrieve",
        "ask",
        "generate-queries",
        "report",
        "ledger",
        "worker",
        "serve-blocks",
        "serve",
    }
