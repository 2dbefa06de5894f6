"""car_fl.commands.ask: a corpus checkpoint's top-K documents, then a tiny Llama's answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.centralized import run_centralized
from car_fl.cli import main


@pytest.fixture
def corpus_checkpoint(make_corpus_settings, tmp_path: Path) -> tuple[str, str]:
    settings = make_corpus_settings("approach=document", "train.epochs=1")
    run_centralized(settings, tmp_path / "run")
    return str(tmp_path / "run" / "checkpoints" / "final"), settings.dataset.documents_path or ""


def test_ask_answers_from_the_top_k_documents_and_names_them(
    corpus_checkpoint: tuple[str, str],
    tiny_generator: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt, documents = corpus_checkpoint
    common = ["--checkpoint", ckpt, "--documents", documents, "--device", "cpu", "-k", "3"]
    assert main(["retrieve", *common, "--json", "w5 w47"]) == 0
    [retrieved] = json.loads(capsys.readouterr().out)
    ask = ["ask", *common, "--generator", str(tiny_generator), "--max-new-tokens", "5"]
    assert main([*ask, "--json", "w5 w47"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["question"] == "w5 w47" and payload["answer"].strip()
    assert [s["id"] for s in payload["sources"]] == [h["id"] for h in retrieved["results"]]
    assert [s["text"] for s in payload["sources"]] == [h["text"] for h in retrieved["results"]]
    assert main([*ask, "w5 w47"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == payload["answer"]  # greedy: the same answer
    assert lines[2] == "Sources:"
    assert [line.split()[1] for line in lines[3:]] == [s["id"] for s in payload["sources"]]


def test_a_bad_generator_or_k_is_one_line_and_a_non_zero_exit(
    corpus_checkpoint: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = corpus_checkpoint
    missing = tmp_path / "no-such-model"
    args = ["ask", "--checkpoint", ckpt, "--generator", str(missing), "--device", "cpu", "w5"]
    assert main(args) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"car-fl ask: could not load the generator '{missing}'")
    assert "config.json" in line
    assert main(["ask", "--checkpoint", ckpt, "--generator", str(missing), "-k", "0", "w5"]) == 1
    assert "car-fl ask: -k must be >= 1" in capsys.readouterr().err
