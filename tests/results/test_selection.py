"""car_fl.results.run: the best model is chosen on validation, never on test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.centralized import run_centralized
from car_fl.results.run import eval_row, is_better, load_checkpoint, select_best
from car_fl.testing.tiny import synthetic_examples, write_tsv


def test_selection_uses_validation_and_ignores_test() -> None:
    rows = [
        {"round": 1, **eval_row({"top1": 0.6, "loss": 1.0}, {"top1": 0.9, "loss": 0.2})},
        {"round": 2, **eval_row({"top1": 0.8, "loss": 0.9}, {"top1": 0.5, "loss": 2.0})},
        {"round": 3, **eval_row({"top1": 0.8, "loss": 0.5}, {"top1": 0.4, "loss": 3.0})},
        {"round": 4, **eval_row({"top1": 0.8, "loss": 0.5}, {"top1": 0.3, "loss": 4.0})},
    ]
    best = select_best(rows)
    assert best is not None and best["round"] == 3  # equal top-1: lower loss; full tie: earlier
    assert not is_better(rows[3], rows[2])
    no_val = [
        {"round": r, **eval_row(None, {"top1": t, "loss": 0.0})} for r, t in [(1, 0.9), (2, 0.1)]
    ]
    assert select_best(no_val) == no_val[-1]  # without validation: the final model


@pytest.mark.slow
def test_best_checkpoint_follows_validation_when_test_disagrees(
    make_settings, tmp_path: Path
) -> None:
    # Train/validation follow the keyword task; the test file labels every text with the
    # *next* topic, so learning the task raises validation top-1 and lowers test top-1.
    flipped = [
        (text, f"topic{(int(label[-1]) + 1) % 4}") for text, label in synthetic_examples(80, seed=9)
    ]
    test_path = write_tsv(tmp_path / "flipped.tsv", flipped)
    settings = make_settings(
        f"dataset.test_path={test_path}", "train.epochs=4", "train.lr=0.01", "seed=3"
    )
    summary = run_centralized(settings, tmp_path / "run")
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    val = [r["val_top1"] for r in history]
    test = [r["test_top1"] for r in history]
    best = summary["best"]
    assert best["val_top1"] == max(val)
    assert best["test_top1"] < max(test)  # selecting on test would have picked another epoch
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best").round == best["round"]
    assert summary["selection"] == "validation"
    assert summary["data"]["test_examples"] == len(flipped)
