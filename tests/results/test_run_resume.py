"""car_fl.results.run.load_resume_point: one procedure reads every kind of stopped run back,
and refuses a folder it cannot continue before any work (the runs end to end:
tests/standalone/test_resume.py, tests/server/test_federation_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from car_fl.data.labels import LabelMap
from car_fl.results.rows import ClientRow, MetricsFile, RoundRow, RunSummary
from car_fl.results.run import (
    CENTRALIZED,
    FEDERATED,
    Checkpoint,
    check_run_dir,
    load_resume_point,
    save_checkpoint,
)
from car_fl.settings.compose import load_settings, settings_to_yaml
from car_fl.settings.schema import Settings


@pytest.fixture
def settings() -> Settings:
    return load_settings(["fl.rounds=3", "train.patience=2"])


def write_run(
    folder: Path,
    settings: Settings,
    *,
    kind: str = "federated",
    rounds: int = 2,
    complete: bool = False,
    stopped_early: int | None = None,
    skip_row: int | None = None,
) -> None:
    """A run's folder as a run writes it: config.yaml, metrics.json and a checkpoint per row."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(settings_to_yaml(settings))
    rows = [
        RoundRow(round=r, epochs=r, metrics={"val_top1": 0.1 * r}, seconds=1.0)
        for r in range(1, rounds + 1)
        if r != skip_row
    ]
    summary = RunSummary(
        kind=kind,
        clients=2,
        mode="classifier",
        head="linear",
        num_labels=2,
        initial={"val_top1": 0.0},
        final=rows[-1],
        best=rows[-1],
        total_seconds=5.0,
        test_examples=4,
        selection="val_top1",
        data={"train": 8},
        stopped_early=stopped_early,
        complete=complete,
    )
    MetricsFile(history=rows, summary=summary).write(folder)
    for r in range(1, rounds + 1):
        save_checkpoint(
            folder / "checkpoints" / f"round-{r:03d}",
            Checkpoint(
                state={"head.weight": torch.full((2, 2), float(r))},
                label_map=LabelMap(("ham", "spam")),
                settings=settings,
                round=r,
            ),
        )


def resume(folder: Path, settings: Settings, kind=FEDERATED):
    return load_resume_point(folder, settings, kind)


def test_the_newest_checkpoint_that_loads_is_where_the_run_goes_on(
    settings: Settings, tmp_path: Path
) -> None:
    write_run(tmp_path, settings, rounds=2)
    point = resume(tmp_path, settings)
    assert point.done == 2 and [row.round for row in point.history] == [1, 2]
    assert torch.equal(point.checkpoint.state["head.weight"], torch.full((2, 2), 2.0))
    assert point.initial == {"val_top1": 0.0} and not point.finished
    # a checkpoint cut short by a stop is skipped: round 1's is complete
    (tmp_path / "checkpoints" / "round-002" / "weights.safetensors").write_bytes(b"cut")
    point = resume(tmp_path, settings)
    assert point.done == 1 and [row.round for row in point.history] == [1]


def test_a_run_of_the_other_kind_is_refused_naming_both(settings: Settings, tmp_path: Path) -> None:
    write_run(tmp_path, settings, kind="centralized")
    with pytest.raises(ValueError, match=r"that is a centralised run .* and this is a federation"):
        resume(tmp_path, settings)
    with pytest.raises(FileNotFoundError, match=r"config\.yaml is missing; resume= takes"):
        check_run_dir(tmp_path / "elsewhere", FEDERATED)


def test_other_settings_a_finished_run_and_rows_changed_by_hand_are_refused(
    settings: Settings, tmp_path: Path
) -> None:
    write_run(tmp_path / "other", settings)
    with pytest.raises(ValueError, match=r"other settings \(train\.lr=.*\).*same overrides"):
        resume(tmp_path / "other", load_settings(["fl.rounds=3", "train.patience=2", "train.lr=9"]))

    write_run(tmp_path / "patience", settings, stopped_early=2, complete=True)
    with pytest.raises(ValueError, match=r"ended after round 2, when train\.patience=2 rounds"):
        resume(tmp_path / "patience", settings)

    write_run(tmp_path / "done", settings, rounds=3, complete=True)
    with pytest.raises(ValueError, match=r"already has 3 rounds; raise fl\.rounds above it"):
        resume(tmp_path / "done", settings)
    # every step done but the end not written (stopped while it tested the selected and
    # final state): either kind writes its end
    write_run(tmp_path / "unwritten", settings, rounds=3, complete=False)
    assert resume(tmp_path / "unwritten", settings).finished
    central = load_settings(["train.epochs=3", "train.patience=2"])
    write_run(tmp_path / "epochs", central, kind="centralized", rounds=3, complete=False)
    assert resume(tmp_path / "epochs", central, CENTRALIZED).finished

    write_run(tmp_path / "gap", settings, rounds=3, skip_row=2)
    with pytest.raises(ValueError, match=r"does not hold rounds 1 to 3 .* changed by hand"):
        resume(tmp_path / "gap", settings)


def test_a_folder_with_no_checkpoint_that_loads_is_refused(
    settings: Settings, tmp_path: Path
) -> None:
    write_run(tmp_path, settings, rounds=1)
    (tmp_path / "checkpoints" / "round-001" / "weights.safetensors").unlink()
    with pytest.raises(ValueError, match="no complete round checkpoint to continue from"):
        resume(tmp_path, settings)
    assert json.loads((tmp_path / "metrics.json").read_text())["summary"]["complete"] is False


def test_a_private_federation_resumes_only_with_a_clients_csv_that_reads(tmp_path: Path) -> None:
    """The server's ε after a resume counts the replies clients.csv recorded: a DP run whose
    file is gone or unreadable (a field past csv's limit) is refused, naming the file."""
    private = load_settings(["fl.rounds=3", "dp=fixed"])
    write_run(tmp_path, private, rounds=2)
    with pytest.raises(ValueError, match=r"clients.csv does not read .*FileNotFoundError"):
        resume(tmp_path, private)
    (tmp_path / "clients.csv").write_text(f"round,node,status,reason\n1,3,failed,{'x' * 200_000}\n")
    with pytest.raises(ValueError, match=r"clients.csv does not read .*field larger"):
        resume(tmp_path, private)
    ClientRow.write_csv(tmp_path / "clients.csv", [ClientRow(round=1, node=3, status="failed")])
    assert [row.node for row in resume(tmp_path, private).client_rows] == [3]
