"""An adversary of car_fl.results.run's resume, driven by the centralised epochs: a stopped
run, resumed by a careless operator, either ends exactly as an uninterrupted run would or is
refused, before any work, with an error naming what is wrong."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from car_fl.results.run import OPTIMIZER
from car_fl.standalone.centralized import run_centralized
from tests.helpers import stop_in_the_end
from tests.standalone.test_resume import rows, stop_in_epoch, timeless

ADAMW = ["train.epochs=3", "train.lr=0.01", "train.weight_decay=0.01"]


def stopped_run(make_settings, run: Path, monkeypatch, *overrides: str, in_epoch: int) -> None:
    with monkeypatch.context() as patch:
        stop_in_epoch(patch, in_epoch)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_settings(*overrides), run)


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_with_its_optimiser(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 2's weights are damaged (a full disk, a bad copy): the two newest steps keep their
    optimiser, so the resume goes on from epoch 1 with AdamW's moments as they were and ends
    as the uninterrupted run does. With epoch 1's optimiser gone too, going on with the
    moments at zero would differ: refused, naming the optimiser, the old results kept."""
    whole = run_centralized(make_settings(*ADAMW), tmp_path / "whole")
    run, weights = tmp_path / "run", Path("checkpoints") / "round-002" / "weights.safetensors"
    for gone in (False, True):
        shutil.rmtree(run, ignore_errors=True)
        stopped_run(make_settings, run, monkeypatch, *ADAMW, in_epoch=3)
        assert (run / "checkpoints" / "round-001" / OPTIMIZER).exists()
        (run / weights).write_bytes((run / weights).read_bytes()[:100])
        if gone:
            (run / "checkpoints" / "round-001" / OPTIMIZER).unlink()
            before = (run / "metrics.json").read_text()
            with pytest.raises(ValueError, match="optimiser"):
                run_centralized(make_settings(*ADAMW, f"resume={run}"), run)
            assert (run / "metrics.json").read_text() == before
        else:
            resumed = run_centralized(make_settings(*ADAMW, f"resume={run}"), run)
            assert rows(run) == rows(tmp_path / "whole")
            assert timeless(resumed["best"]) == timeless(whole["best"])


def test_a_stopped_run_resumed_with_fewer_epochs_than_it_ran_is_refused(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after epoch 2 of 3 and resumed with train.epochs=1: ending it there would
    report a complete run of two epochs under a config.yaml of one. Refused, as a federation
    refuses it, before anything is rewritten."""
    run = tmp_path / "run"
    stopped_run(make_settings, run, monkeypatch, *ADAMW, in_epoch=3)
    before = {name: (run / name).read_text() for name in ("metrics.json", "config.yaml")}
    lower = [*ADAMW[1:], "train.epochs=1"]
    with pytest.raises(ValueError, match=r"train\.epochs"):
        run_centralized(make_settings(*lower, f"resume={run}"), run)
    assert {name: (run / name).read_text() for name in before} == before


def test_a_resume_on_the_same_data_file_reordered_is_refused(
    make_settings, tmp_path: Path, synthetic_tsv: Path
) -> None:
    """The data file at dataset.path is replaced by the same lines in another order (a
    re-export, a sort): the split sizes and labels are the same, but the seeded split would
    put texts the model trained on into validation and test. The splits' digest refuses it."""
    data = tmp_path / "data.tsv"
    data.write_text(synthetic_tsv.read_text())
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=1", f"dataset.path={data}"), run)
    lines = data.read_text().splitlines(keepends=True)
    random.Random(1).shuffle(lines)
    data.write_text("".join(lines))
    before = (run / "metrics.json").read_text()
    resume = make_settings("train.epochs=2", f"dataset.path={data}", f"resume={run}")
    with pytest.raises(ValueError, match="differ from that run's"):
        run_centralized(resume, run)
    assert (run / "metrics.json").read_text() == before


def test_a_resume_with_other_encoder_weights_at_the_same_path_is_refused(
    make_settings, tmp_path: Path, tiny_llama: Path
) -> None:
    """The model folder the run named is replaced by another model (a re-download, a re-made
    conversion): the settings are the same, the encoder is not. Its checkpoints record the
    encoder's digest, so the resume is refused before an epoch, the run's files kept."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=1", model_dir=model), run)
    weights = load_file(model / "model.safetensors")
    for tensor in weights.values():
        tensor.mul_(1.01)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = (run / "metrics.json").read_text()
    with pytest.raises(ValueError, match=r"encoder_digest differ from that run's.*name_or_path"):
        run_centralized(make_settings("train.epochs=2", f"resume={run}", model_dir=model), run)
    assert (run / "metrics.json").read_text() == before


def test_a_new_run_into_the_folder_of_a_finished_run_does_not_overwrite_it(
    make_settings, tmp_path: Path
) -> None:
    """The same ``output_dir=`` given twice (the README's commands name one), the second time
    with other settings and without resume=: the second run is refused, naming the keys and
    resume=, and the first run's config.yaml and metrics.json are kept."""
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=2", "train.lr=0.01"), run)
    before = {name: (run / name).read_text() for name in ("metrics.json", "config.yaml")}
    with pytest.raises(FileExistsError, match=r"other settings \(.*train\.lr.*resume="):
        run_centralized(make_settings("train.epochs=1", "train.lr=0.5"), run)
    assert {name: (run / name).read_text() for name in before} == before
    # the same settings again (a README command run twice) run again from the start
    again = run_centralized(make_settings("train.epochs=2", "train.lr=0.01"), run)
    assert again["complete"] and rows(run) == [
        timeless(row) for row in json.loads(before["metrics.json"])["history"]
    ]


def test_a_run_killed_after_its_patience_ran_out_resumes_to_the_same_early_stop(
    make_corpus_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the row that spends the patience, before the end is written (so
    metrics.json says neither stopped_early nor complete): the resume must stop there too,
    with the same rows, the same selected epoch and stopped_early, not train on."""
    wrecking = ["approach=document", "train.lr=500", "train.rows_lr=500", "train.patience=2"]
    settings = [*wrecking, "train.epochs=6"]
    whole = run_centralized(make_corpus_settings(*settings), tmp_path / "whole")
    assert whole["stopped_early"] == 2
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_in_the_end(patch)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_corpus_settings(*settings), run)
    left = json.loads((run / "metrics.json").read_text())["summary"]
    assert left["complete"] is False and "stopped_early" not in left
    resumed = run_centralized(make_corpus_settings(*settings, f"resume={run}"), run)
    assert rows(run) == rows(tmp_path / "whole")
    assert resumed["stopped_early"] == 2 and resumed["best"]["round"] == whole["best"]["round"]
    assert resumed["complete"] is True


def test_a_run_without_a_validation_split_resumes_to_the_same_rows_and_selection(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dataset.val_fraction=0: the latest epoch is "best" (never the test split's choice),
    before and after a resume."""
    overrides = [*ADAMW, "dataset.val_fraction=0", "train.patience=1"]
    whole = run_centralized(make_settings(*overrides), tmp_path / "whole")
    run = tmp_path / "run"
    stopped_run(make_settings, run, monkeypatch, *overrides, in_epoch=3)
    resumed = run_centralized(make_settings(*overrides, f"resume={run}"), run)
    assert rows(run) == rows(tmp_path / "whole")
    assert not any(key.startswith("val_") for row in rows(run) for key in row)
    assert resumed["best"]["round"] == whole["best"]["round"] == 3
    assert resumed["selection"] == "final (no validation split)"
    assert "stopped_early" not in resumed
