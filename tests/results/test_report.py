"""``car-fl report`` (car_fl.results.report): tables and plots across run directories.

The runs here are written with the results module (no training); the sweep test in
test_sweep.py builds its report from real jobs.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from car_fl.cli import main as cli_main
from car_fl.results.report import JOB_JSON, collect_runs, write_report
from car_fl.results.rows import MetricsFile, RoundRow, RunSummary
from car_fl.results.run import select_best
from car_fl.settings.compose import settings_to_yaml


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_run(
    folder: Path,
    settings,
    *,
    clients: int,
    top1: list[float],
    seconds: float,
    epsilon: float | None = None,
    complete: bool | None = True,
    job: dict | None = None,
) -> Path:
    """A run directory as a centralised run (clients=1) or a federation would leave it."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(settings_to_yaml(settings))
    history = [
        RoundRow(
            round=r,
            epochs=r,
            train_loss=0.5,
            train_accuracy=0.5,
            metrics={
                "val_loss": 1 - t,
                "val_top1": t,
                "test_loss": 1 - t,
                "test_top1": t,
                "test_top3": 1.0,
                "test_mrr": t,
                "test_macro_f1": t,
            },
            seconds=seconds / len(top1),
        )
        for r, t in enumerate(top1, start=1)
    ]
    federated = clients > 1
    summary = RunSummary(
        kind="federated" if federated else "centralized",
        clients=clients,
        mode=settings.train.mode,
        head=settings.head.kind,
        num_labels=4,
        final=history[-1],
        best=select_best(history, scores=lambda row: row.metrics),
        total_seconds=seconds,
        test_examples=10,
        selection="validation",
        data={},
        dp=settings.dp.mode if federated else None,
        epsilon=epsilon,
        complete=complete if federated else None,
    )
    MetricsFile(history=history, summary=summary).write(folder)
    if job is not None:
        (folder / JOB_JSON).write_text(json.dumps(job))
    return folder


@pytest.fixture
def sweep(make_settings, tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    write_run(root / "0", make_settings(), clients=1, top1=[0.5, 0.8], seconds=40.0)
    write_run(root / "1", make_settings("fl.clients=2"), clients=2, top1=[0.7], seconds=10.0)
    dp = make_settings("fl.clients=2", "dp=fixed")
    write_run(root / "2", dp, clients=2, top1=[0.6], seconds=20.0, epsilon=3.5)
    write_run(root / "3", dp, clients=2, top1=[0.6], seconds=20.0, epsilon=1.0, complete=False)
    skipped = {"status": "skipped", "reason": "local DP on a centralised run", "overrides": []}
    (root / "4").mkdir()
    (root / "4" / JOB_JSON).write_text(json.dumps({**skipped, "clients": 1}))
    return root


def test_the_report_has_one_row_per_run_with_speed_up_and_epsilon(
    sweep: Path, tmp_path: Path
) -> None:
    report = write_report([sweep], tmp_path / "out")
    assert report.counts == {"ok": 3, "incomplete": 1, "skipped": 1}
    rows = {r["job"]: r for r in _rows(report.results_csv)}
    assert float(rows["0"]["top1"]) == 0.8 and rows["0"]["scenario"] == "centralised"
    assert rows["1"]["scenario"] == "FL" and rows["2"]["scenario"] == "FL + DP (fixed)"
    # Speed-up: the centralised run's seconds over this run's (same sweep, model, approach).
    assert float(rows["1"]["speedup"]) == pytest.approx(4.0)
    assert float(rows["2"]["speedup"]) == pytest.approx(2.0)
    # ε only where DP was on; top-K is the largest K below the number of labels.
    assert rows["1"]["epsilon"] == "" and float(rows["2"]["epsilon"]) == 3.5
    assert rows["0"]["k"] == "3" and float(rows["0"]["topk"]) == 1.0
    assert rows["3"]["status"] == "incomplete" and rows["3"]["speedup"] == ""
    assert rows["4"]["status"] == "skipped" and "local DP" in rows["4"]["reason"]
    assert [r["job"] for r in _rows(report.retrieval_csv)] == ["0"]  # centralised runs only
    markdown = report.markdown.read_text()
    assert "## Jobs without results" in markdown and "`3` (incomplete)" in markdown
    assert "| top-3 (%) |" in markdown and "| 80.00 |" in markdown
    assert report.plots and all(f"({p.name})" in markdown for p in report.plots)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.plots)


def test_centralised_runs_of_two_approaches_get_the_retrieval_table(
    make_settings, tmp_path: Path
) -> None:
    """Beside the results table, the centralised runs of more than one approach are compared
    in the retrieval table (one approach: no table to compare)."""
    root = tmp_path / "runs"
    write_run(root / "0", make_settings("mode=classifier"), clients=1, top1=[0.8], seconds=4.0)
    write_run(root / "1", make_settings("mode=adapter"), clients=1, top1=[0.9], seconds=9.0)
    report = write_report([root], tmp_path / "out")
    assert [r["job"] for r in _rows(report.retrieval_csv)] == ["0", "1"]
    lines = report.markdown.read_text().splitlines()
    assert any(line.startswith("| model | approach | final top-1 (%) |") for line in lines)
    table = [line for line in lines if line.startswith("| local |")]
    assert len(table) == 2 + 2  # the results table, then the retrieval table


def test_the_report_shows_the_model_validation_selected_beside_the_final_one(
    make_settings, tmp_path: Path
) -> None:
    # validation peaks at epoch 2 of 3: the final model is not the one a reader should quote
    write_run(tmp_path / "runs" / "0", make_settings(), clients=1, top1=[0.5, 0.9, 0.6], seconds=3)
    report = write_report([tmp_path / "runs"], tmp_path / "out")
    (row,) = _rows(report.results_csv)
    assert float(row["top1"]) == 0.6
    assert row["selected"] == "2" and float(row["val_top1"]) == 0.9
    assert float(row["top1_selected"]) == 0.9
    markdown = report.markdown.read_text()
    assert "| final top-1 (%) | selected on val. | its val. top-1 (%) | its top-1 (%) |" in markdown
    assert "| 60.00 | 2 | 90.00 | 90.00 |" in markdown


def test_runs_are_found_in_numeric_order_two_levels_deep(sweep: Path) -> None:
    (sweep / "10").mkdir()
    (sweep / "10" / JOB_JSON).write_text(json.dumps({"status": "failed", "reason": "boom"}))
    runs = collect_runs([sweep.parent])  # the sweep folder is one level below
    assert [r.path.name for r in runs] == ["0", "1", "2", "3", "4", "10"]
    assert runs[-1].status == "failed" and runs[-1].reason == "boom"
    empty = sweep.parent / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no runs"):
        collect_runs([empty])


def test_the_report_command_on_run_directories(sweep: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "two"
    assert cli_main(["report", str(sweep / "0"), str(sweep / "2"), "--out", str(out)]) == 0
    assert sorted(r["job"] for r in _rows(out / "results.csv")) == ["0", "2"]
    assert "2 runs (2 ok)" in capsys.readouterr().out
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path / "no-such-folder")]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl report: ") and "no-such-folder" in line


def test_two_runs_that_differ_only_in_their_data_size_say_so_and_each_gets_its_curve(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: two rows looked identical ("smollm2 | classifier (CaR) | 1 | centralised",
    95.00 and 97.50) with nothing saying which run each came from, and the curves figure drew
    one of them (one label per scenario: the second overwrote the first)."""
    import car_fl.results.report as report_module

    small = write_run(
        tmp_path / "runs" / "small",
        make_settings("dataset.max_examples=400"),
        clients=1,
        top1=[0.90, 0.95],
        seconds=10.0,
    )
    large = write_run(
        tmp_path / "runs" / "large",
        make_settings("dataset.max_examples=800"),
        clients=1,
        top1=[0.93, 0.975],
        seconds=20.0,
    )
    drawn: dict[str, list[str]] = {}
    real = report_module.plot_against_epochs

    def spy(path: Path, lines: dict, *, title: str) -> None:
        drawn[path.name] = sorted(lines)
        real(path, lines, title=title)

    monkeypatch.setattr(report_module, "plot_against_epochs", spy)
    report = write_report([small, large], tmp_path / "report")
    by_source = {row["source"]: row for row in report.rows}
    assert set(by_source) == {"runs/small", "runs/large"}
    assert by_source["runs/small"]["differs"] == "dataset.max_examples=400"
    assert by_source["runs/large"]["differs"] == "dataset.max_examples=800"
    (curves,) = [labels for name, labels in drawn.items() if name.startswith("curves-")]
    assert len(curves) == 2 and all("dataset.max_examples=" in label for label in curves)
    text = report.markdown.read_text(encoding="utf-8")
    assert "runs/small" in text and "dataset.max_examples=800" in text


def test_a_loss_panel_whose_lines_differ_by_orders_of_magnitude_is_drawn_in_log_scale(
    tmp_path: Path,
) -> None:
    """Issue 43: MIPS's test loss near 32 flattened CaR's near 0 in the retrieval figure."""
    from matplotlib import pyplot

    from car_fl.results.plots import wide_range

    fig, ax = pyplot.subplots()
    ax.plot([0, 1, 2], [0.05, 0.03, 0.02])
    assert not wide_range(ax)
    ax.plot([0, 2], [32.0, 32.0])
    assert wide_range(ax)
    pyplot.close(fig)


def test_every_dp_mode_has_a_scenario_name() -> None:
    from types import SimpleNamespace

    from car_fl.results.report import scenario_of
    from car_fl.settings.schema import DPMode

    names = {scenario_of(SimpleNamespace(dp=SimpleNamespace(mode=m)), 2) for m in DPMode}  # type: ignore[arg-type]
    assert len(names) == len(DPMode) and "FL" in names  # each mode's own name (its spec's)


def test_the_configuration_docs_name_every_approach() -> None:
    from car_fl.heads.config import APPROACHES

    row = next(
        line
        for line in (Path(__file__).parents[2] / "docs" / "configuration.md")
        .read_text()
        .splitlines()
        if line.startswith("| `approach` |")
    )
    named = [name.strip(" `") for name in row.split("|")[2].split(",")[1:]]
    assert named == list(APPROACHES)  # all, in the table's order


def test_a_head_and_mode_no_approach_names_still_report() -> None:
    """A mixture of experts trained with the adapter (or a new head before its approaches
    exist) is a valid run; car-fl report raised for it."""
    from car_fl.results.report import approach_of
    from car_fl.settings.compose import load_settings

    settings = load_settings(["head.kind=moe", "mode=adapter"])
    with pytest.raises(ValueError, match="is no approach"):
        _ = settings.approach
    assert approach_of(settings) == "moe head, adapter+classifier"
    assert approach_of(load_settings(["approach=adapter_car"])) == "adapter + classifier (CaR)"


def test_reading_results_imports_no_torch() -> None:
    """``car-fl report`` and the rows it reads stay light: no torch (docs/architecture.md)."""
    code = "import sys, car_fl.results.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
