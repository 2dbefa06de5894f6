"""car_fl.results.run's resume driven by the centralised epochs: a stopped run, resumed, ends
as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from car_fl.results import run as run_module
from car_fl.results.run import OPTIMIZER, Run, load_optimizer_tensors, optimizer_tensors
from car_fl.simulation.centralized_dp import train_centrally
from car_fl.standalone import centralized
from car_fl.standalone.centralized import run_centralized
from tests.helpers import stop_in_the_end


def rows(out: Path) -> list[dict[str, float]]:
    history = json.loads((out / "metrics.json").read_text())["history"]
    return [timeless(row) for row in history]


def timeless(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if k != "seconds"}


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "final" / "weights.safetensors"))


def stop_in_epoch(monkeypatch: pytest.MonkeyPatch, stopped: int) -> None:
    """The run is killed in epoch ``stopped`` (1-based), as Ctrl-C or a closed laptop would."""
    real = centralized.one_epoch

    def one_epoch(settings, model, data, optimizer, epoch, **kwargs):
        if epoch + 1 == stopped:
            raise KeyboardInterrupt
        return real(settings, model, data, optimizer, epoch, **kwargs)

    monkeypatch.setattr(centralized, "one_epoch", one_epoch)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_run_stopped_in_an_epoch_resumes_and_ends_where_an_uninterrupted_one_does(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    overrides = [
        "mode=adapter",
        "dataset.max_examples=40",
        "train.batch_size=16",
        "train.epochs=3",
        "train.lr=0.01",
        f"train.optimizer={optimizer}",
        "train.momentum=0.9" if optimizer == "sgd" else "train.weight_decay=0.01",
    ]
    whole = run_centralized(make_settings(*overrides), tmp_path / "whole")

    stopped = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        stop_in_epoch(patch, 2)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_settings(*overrides), stopped)
    # what the stopped run left: its first epoch, said to be incomplete, and its state
    left = json.loads((stopped / "metrics.json").read_text())
    assert [row["round"] for row in left["history"]] == [1]
    assert left["summary"]["complete"] is False
    kept = sorted(p.parent.name for p in (stopped / "checkpoints").glob(f"*/{OPTIMIZER}"))
    assert kept == ["round-001"]
    assert not (stopped / "checkpoints" / "final").exists()

    resumed = run_centralized(make_settings(*overrides, f"resume={stopped}"), stopped)
    assert rows(stopped) == rows(tmp_path / "whole")
    assert resumed["complete"] is True and timeless(resumed["best"]) == timeless(whole["best"])
    assert resumed["total_seconds"] >= left["summary"]["total_seconds"]
    a, b = final_state(tmp_path / "whole"), final_state(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_run_goes_on_when_train_epochs_is_raised(make_settings, tmp_path: Path) -> None:
    base = ["train.lr=0.01", "train.weight_decay=0.01"]
    whole = run_centralized(make_settings(*base, "train.epochs=4"), tmp_path / "whole")
    run = tmp_path / "run"
    run_centralized(make_settings(*base, "train.epochs=2"), run)
    more = run_centralized(make_settings(*base, "train.epochs=4", f"resume={run}"), run)
    assert rows(run) == rows(tmp_path / "whole")
    assert timeless(more["best"]) == timeless(whole["best"])
    # the folder's config.yaml is the one it now ran with
    assert "epochs: 4" in (run / "config.yaml").read_text()

    with pytest.raises(ValueError, match=r"already has 4 epochs; raise train\.epochs"):
        run_centralized(make_settings(*base, "train.epochs=4", f"resume={run}"), run)


def test_a_resume_with_other_settings_or_after_early_stopping_is_refused_before_any_work(
    make_settings, make_corpus_settings, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=1"), run)
    before = (run / "metrics.json").read_text()
    refused = r"other settings .* \(only train\.epochs may change\)"
    with pytest.raises(ValueError, match=refused) as err:
        run_centralized(make_settings("train.epochs=2", "train.lr=0.5", f"resume={run}"), run)
    assert "train.lr=" in str(err.value)  # the message names what changed
    with pytest.raises(ValueError, match="trains nothing"):
        run_centralized(make_settings("head.kind=knn", f"resume={run}"), run)
    with pytest.raises(FileNotFoundError, match="is missing; resume= takes the folder"):
        run_centralized(make_settings("train.epochs=2", f"resume={tmp_path}"), tmp_path)
    assert (run / "metrics.json").read_text() == before  # nothing was overwritten

    # the wrecking learning rate of test_centralized's patience test: patience ends it
    wrecking = ["approach=document", "train.lr=500", "train.rows_lr=500", "train.patience=2"]
    stopped = tmp_path / "stopped"
    summary = run_centralized(make_corpus_settings(*wrecking, "train.epochs=6"), stopped)
    assert summary["stopped_early"] == 2
    resume = make_corpus_settings(*wrecking, "train.epochs=8", f"resume={stopped}")
    with pytest.raises(ValueError, match=r"ended after epoch 2, when train\.patience=2"):
        run_centralized(resume, stopped)


def test_a_federated_run_is_not_resumed_as_a_centralised_one(make_settings, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=1"), run)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["kind"] = metrics["summary"]["kind"] = "federated"
    (run / "metrics.json").write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match=r"that is a federation .* and this is a centralised run"):
        run_centralized(make_settings("train.epochs=2", f"resume={run}"), run)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_state_round_trips_and_refuses_other_parameters(kind: str) -> None:
    def build(*shapes: tuple[int, ...]) -> torch.optim.Optimizer:
        params = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.1)

    first = build((3, 3), (4,))
    for _ in range(2):
        for group in first.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        first.step()
    saved = optimizer_tensors(first)
    assert saved  # the moments (and Adam's step count) are there to be kept

    second = build((3, 3), (4,))
    load_optimizer_tensors(second, saved)
    assert optimizer_tensors(second).keys() == saved.keys()
    assert all(torch.equal(optimizer_tensors(second)[k], saved[k]) for k in saved)

    with pytest.raises(ValueError, match="has shape"):
        load_optimizer_tensors(build((3, 3), (5,)), saved)
    with pytest.raises(ValueError, match="for a parameter this model lacks"):
        load_optimizer_tensors(build((3, 3)), saved)


def test_dp_sgd_on_one_machine_resumes_as_the_federation_of_one_it_is(
    make_settings, tmp_path: Path
) -> None:
    # car-fl train dp=record runs train.epochs rounds of one node: raising train.epochs raises
    # fl.rounds, which a federation's resume allows (it used to refuse the changed epochs)
    dp = ["dp=record", "dp.noise_multiplier=1.0", "dp.target_epsilon=null"]
    run = tmp_path / "run"
    train_centrally(make_settings(*dp, "train.epochs=1"), run)
    summary = train_centrally(make_settings(*dp, "train.epochs=2", f"resume={run}"), run)
    assert [row["round"] for row in rows(run)] == [1, 2]
    assert summary["complete"] is True


@pytest.mark.parametrize("where", ["between its optimiser and its weights", "after its row"])
def test_a_run_stopped_at_any_point_of_its_epoch_end_resumes_to_the_same_end(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Stopped in epoch 2's checkpoint between the optimiser file and the weights (the
    resume goes on from epoch 1, whose optimiser is still there, and trains epoch 2 again), or
    after epoch 2's row before epoch 1's optimiser file is removed (it goes on from epoch 2):
    it ends as an uninterrupted run does."""
    overrides = ["train.epochs=3", "train.lr=0.01", "train.weight_decay=0.01"]
    whole = tmp_path / "whole"
    run_centralized(make_settings(*overrides), whole)
    real_save, real_write = run_module.save_checkpoint, Run.write

    def stop_in_save(folder, checkpoint):
        if folder.name == "round-002":  # after its optimizer.safetensors was written
            raise KeyboardInterrupt
        return real_save(folder, checkpoint)

    def stop_after_row(self, *, complete):
        real_write(self, complete=complete)
        if len(self.history) == 2:
            raise KeyboardInterrupt

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        if where == "after its row":
            patch.setattr(Run, "write", stop_after_row)
        else:
            patch.setattr(run_module, "save_checkpoint", stop_in_save)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_settings(*overrides), run)
    rows_left = len(json.loads((run / "metrics.json").read_text())["history"])
    assert rows_left == (2 if where == "after its row" else 1)
    assert (run / "checkpoints" / "round-002" / OPTIMIZER).is_file()
    run_centralized(make_settings(*overrides, f"resume={run}"), run)
    assert rows(run) == rows(whole)
    a, b = final_state(whole), final_state(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_stopped_after_its_last_epoch_is_finished_by_a_resume_without_more_epochs(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = ["train.epochs=2", "train.lr=0.01"]
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_in_the_end(patch)
        with pytest.raises(KeyboardInterrupt):
            run_centralized(make_settings(*overrides), run)
    assert json.loads((run / "metrics.json").read_text())["summary"]["complete"] is False
    summary = run_centralized(make_settings(*overrides, f"resume={run}"), run)
    assert summary["complete"] is True and "stopped_early" not in summary
    assert [row["round"] for row in rows(run)] == [1, 2]
    assert (run / "checkpoints" / "final").is_dir() and (run / "curves.png").is_file()


def fewer(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[: len(lines) // 2])


def relabelled(text: str) -> str:
    """topic3 renamed: the same split sizes, other labels."""
    return "".join(
        ("other" if line.split("\t")[0] == "topic3" else line.split("\t")[0])
        + "\t"
        + line.split("\t", 1)[1]
        for line in text.splitlines(keepends=True)
    )


@pytest.mark.parametrize(
    ("change", "refused"), [(fewer, "the data splits"), (relabelled, "the labels")]
)
def test_a_resume_on_a_changed_data_file_is_refused_before_an_epoch_is_trained(
    make_settings, tmp_path: Path, synthetic_tsv: Path, change, refused: str
) -> None:
    data = tmp_path / "data.tsv"
    data.write_text(synthetic_tsv.read_text())
    run = tmp_path / "run"
    run_centralized(make_settings("train.epochs=1", f"dataset.path={data}"), run)
    before = (run / "config.yaml").read_text()
    data.write_text(change(data.read_text()))  # the same path, another file
    resume = make_settings("train.epochs=2", f"dataset.path={data}", f"resume={run}")
    with pytest.raises(ValueError, match=f"{refused} differ from that run's"):
        run_centralized(resume, run)
    assert (run / "config.yaml").read_text() == before  # not rewritten for a refused resume
    assert len(json.loads((run / "metrics.json").read_text())["history"]) == 1
