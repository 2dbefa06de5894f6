"""An adversary of car_fl.results.run's resume, driven by the centralised epochs (and by
``car-fl train dp=record``, a federation of one node): a stopped run, resumed by a careless
operator, either ends exactly as an uninterrupted run would or is refused, before any work,
with an error naming what is wrong. Tests that fail here name a way it does neither."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from car_fl.results.run import OPTIMIZER
from car_fl.simulation.centralized_dp import train_centrally
from car_fl.standalone import centralized
from car_fl.standalone.centralized import run_centralized

ADAMW = ["train.epochs=3", "train.lr=0.01", "train.weight_decay=0.01"]


def rows(out: Path) -> list[dict[str, float]]:
    history = json.loads((out / "metrics.json").read_text())["history"]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in history]


def stop_in_epoch(monkeypatch: pytest.MonkeyPatch, stopped: int) -> None:
    """The run is killed in epoch ``stopped`` (1-based)."""
    real = centralized.one_epoch

    def one_epoch(settings, model, data, optimizer, epoch, **kwargs):
        if epoch + 1 == stopped:
            raise KeyboardInterrupt
        return real(settings, model, data, optimizer, epoch, **kwargs)

    monkeypatch.setattr(centralized, "one_epoch", one_epoch)


def stopped_run(make_settings, run: Path, monkeypatch, *overrides: str, in_epoch: int) -> None:
    with monkeypatch.context() as patch:
        stop_in_epoch(patch, in_epoch)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_settings(*overrides), run)


def test_a_damaged_newest_checkpoint_does_not_resume_with_a_fresh_optimiser(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 2's weights are damaged (a full disk, a bad copy): the resume skips them and goes
    on from epoch 1, whose optimiser.safetensors was removed once epoch 2's row was written.
    load_optimizer reads a missing file as "this run keeps no optimiser", so AdamW starts
    again from zero moments and the epochs trained again differ from the uninterrupted run's,
    silently. It must refuse (naming the optimiser) or end as the uninterrupted run does."""
    whole = tmp_path / "whole"
    run_centralized(make_settings(*ADAMW), whole)
    run = tmp_path / "run"
    stopped_run(make_settings, run, monkeypatch, *ADAMW, in_epoch=3)
    assert not (run / "checkpoints" / "round-001" / OPTIMIZER).exists()
    weights = run / "checkpoints" / "round-002" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = (run / "metrics.json").read_text()
    try:
        run_centralized(make_settings(*ADAMW, f"resume={run}"), run)
    except ValueError as err:  # refused: fine, if it says why and kept the old results
        assert "optimi" in str(err)
        assert (run / "metrics.json").read_text() == before
        return
    assert rows(run) == rows(whole)


def test_a_stopped_run_resumed_with_fewer_epochs_than_it_ran_is_refused(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after epoch 2 of 3 and resumed with train.epochs=1 (train.epochs may change):
    the resume says the run is "finished" (2 >= 1) and ends it as complete, with two epochs
    in metrics.json and train.epochs: 1 in the config.yaml it rewrites; an uninterrupted
    run with train.epochs=1 has one. A federation refuses the same resume ("already has 2
    rounds"); a centralised run must too, before rewriting anything."""
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
    re-export, a sort): the split sizes and labels, all that Run.begin compares, are the
    same, but the seeded split now puts texts the model trained on into validation and
    test. The resume goes on, and every later row's validation (selection) and test
    figures are measured on examples the model was trained on."""
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


@pytest.mark.slow
def test_a_one_node_federation_is_not_resumed_on_another_encoder(
    make_settings, normed_llama: Path, tmp_path: Path
) -> None:
    """``car-fl train dp=record`` (a federation of one node) may change each machine's own
    paths on a resume, model.name_or_path among them: another encoder of the same width is
    accepted, the head trained on the first encoder's features goes on on the second's, and
    the rewritten config.yaml no longer names the encoder of the first rows. Nothing checks
    that the encoder is the one the run was trained with (a centralised run refuses the
    key)."""
    dp = ["dp=record", "dp.noise_multiplier=1.0", "dp.target_epsilon=null"]
    run = tmp_path / "run"
    train_centrally(make_settings(*dp, "train.epochs=1"), run)
    before = (run / "metrics.json").read_text()
    resume = make_settings(*dp, "train.epochs=2", f"resume={run}", model_dir=normed_llama)
    with pytest.raises(ValueError, match=r"model|encoder"):
        train_centrally(resume, run)
    assert (run / "metrics.json").read_text() == before


def test_a_new_run_into_the_folder_of_a_finished_run_does_not_overwrite_it(
    make_settings, tmp_path: Path
) -> None:
    """The same ``output_dir=`` given twice (the README's commands name one), the second time
    with other settings and without resume=: open_run_dir writes its config.yaml over the
    finished run's, its rows replace metrics.json, and the first run's checkpoints/round-002
    (trained with other settings) stays beside the second run's round-001, best and final.
    The first run's results are lost without a word; refusing (or a new folder) keeps them."""
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=2", "train.lr=0.01"), run)
    before = {name: (run / name).read_text() for name in ("metrics.json", "config.yaml")}
    try:
        run_centralized(make_settings("train.epochs=1", "train.lr=0.5"), run)
    except (ValueError, FileExistsError) as err:
        assert str(run) in str(err) or "resume" in str(err)
    assert {name: (run / name).read_text() for name in before} == before


@pytest.mark.slow
def test_a_run_killed_after_its_patience_ran_out_resumes_to_the_same_early_stop(
    make_corpus_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the row that spends the patience, before the end is written (so
    metrics.json says neither stopped_early nor complete): the resume must stop there too,
    with the same rows, the same selected epoch and stopped_early, not train on. (Passes.)"""
    from car_fl.results.run import Run

    wrecking = ["approach=document", "train.lr=500", "train.rows_lr=500", "train.patience=2"]
    settings = [*wrecking, "train.epochs=6"]
    whole = run_centralized(make_corpus_settings(*settings), tmp_path / "whole")
    assert whole["stopped_early"] == 2
    run = tmp_path / "run"
    with monkeypatch.context() as patch:

        def killed(*args, **kwargs):
            raise KeyboardInterrupt

        patch.setattr(Run, "end", killed)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_corpus_settings(*settings), run)
    left = json.loads((run / "metrics.json").read_text())["summary"]
    assert left["complete"] is False and "stopped_early" not in left
    resumed = run_centralized(make_corpus_settings(*settings, f"resume={run}"), run)
    assert rows(run) == rows(tmp_path / "whole")
    assert resumed["stopped_early"] == 2 and resumed["best"]["round"] == whole["best"]["round"]
    assert resumed["complete"] is True


@pytest.mark.slow
def test_a_run_without_a_validation_split_resumes_to_the_same_rows_and_selection(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dataset.val_fraction=0: the latest epoch is "best" (never the test split's choice),
    before and after a resume. (Passes.)"""
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
