"""Sweeps (Hydra multirun), their job records and the report built from them."""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from car_fl.settings.compose import conf_dir
from car_fl.sweep import job_settings, skip_reason
from car_fl.testing.tiny import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "car_fl.sweep", "-m", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _tiny(tiny_llama: Path, synthetic_tsv: Path, tmp_path: Path) -> list[str]:
    return [
        *tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache"),
        "train.lr=1e-2",
        "fl.rounds=2",
        "fl.local_epochs=1",
    ]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_sweep_over_clients_runs_every_job_and_reports_the_metrics_it_wrote(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    result = _sweep(
        tmp_path,
        *_tiny(tiny_llama, synthetic_tsv, tmp_path),
        "clients=1,2",  # a second axis: test_a_failed_job_is_recorded_and_the_sweep_goes_on
        "mode=adapter",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = sorted(p for p in sweep_dir.iterdir() if p.name.isdigit())
    assert len(jobs) == 2
    for job in jobs:
        record = json.loads((job / "job.json").read_text())
        assert record["status"] == "ok", record
        for name in ("config.yaml", "metrics.json", "metrics.csv", "curves.png"):
            assert (job / name).is_file(), (job, name)
        assert (job / "checkpoints" / "final").exists()
    # clients=1 is a centralised run of rounds x local epochs epochs; clients=2 a federation
    kinds = {
        json.loads((j / "job.json").read_text())["clients"]: json.loads(
            (j / "metrics.json").read_text()
        )
        for j in jobs
    }
    assert kinds[1]["kind"] == "centralized" and len(kinds[1]["history"]) == 2
    assert kinds[2]["kind"] == "federated" and kinds[2]["summary"]["clients"] == 2

    report = sweep_dir / "report"
    rows = _rows(report / "results.csv")
    assert len(rows) == 2
    by_path = {Path(r["path"]).name: r for r in rows}
    for job in jobs:
        summary = json.loads((job / "metrics.json").read_text())["summary"]
        row = by_path[job.name]
        assert float(row["top1"]) == summary["final"]["test_top1"]
        assert float(row["mrr"]) == summary["final"]["test_mrr"]
        assert float(row["seconds"]) == summary["total_seconds"]
        assert row["scenario"] == ("centralised" if summary["clients"] == 1 else "FL")
        centralised = next(
            r for r in rows if r["approach"] == row["approach"] and r["clients"] == "1"
        )
        assert float(row["speedup"]) == pytest.approx(
            float(centralised["seconds"]) / float(row["seconds"])
        )
    markdown = (report / "report.md").read_text()
    table = [line for line in markdown.splitlines() if line.startswith("| local |")]
    assert len(table) == 2  # one approach: no retrieval table (tests/results/test_report.py)
    assert {r["clients"] for r in _rows(report / "retrieval.csv")} == {"1"}
    plots = sorted(report.glob("*.png"))
    assert len(plots) == 1  # one approach's curves
    for plot in plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({plot.name})" in markdown
    # The report command on run directories: tests/test_report.py.


@pytest.mark.slow
def test_a_failed_job_is_recorded_and_the_sweep_goes_on(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    missing = tmp_path / "missing.tsv"
    result = _sweep(
        tmp_path,
        *[o for o in _tiny(tiny_llama, synthetic_tsv, tmp_path) if "dataset.path" not in o],
        "clients=1",
        f"dataset.path={missing},{synthetic_tsv}",
        "dp=none,fixed",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert result.returncode == 1  # a job failed
    records = [json.loads((sweep_dir / str(i) / "job.json").read_text()) for i in range(4)]
    assert [r["status"] for r in records] == ["failed", "skipped", "ok", "skipped"]
    assert str(missing) in records[0]["reason"]
    assert "local DP" in records[1]["reason"]
    rows = _rows(sweep_dir / "report" / "results.csv")
    assert sorted(r["status"] for r in rows) == ["failed", "ok", "skipped", "skipped"]
    markdown = (sweep_dir / "report" / "report.md").read_text()
    assert "## Jobs without results" in markdown and str(missing) in markdown


def _experiment(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(
            config_name="sweep",
            overrides=[f"experiment={name}", *overrides],
            return_hydra_config=True,
        )


@pytest.mark.parametrize("name", ["sms_mips", "sms_scenarios", "ag_news", "arxiv"])
@pytest.mark.slow
def test_every_experiment_config_gives_valid_jobs(name: str) -> None:
    """Each combination of an experiment's sweep composes into valid settings (or a skip)."""
    extra = ["dataset.path=/data/arxiv.json"] if name == "arxiv" else []
    params = _experiment(name, *extra).hydra.sweeper.params
    assert params, f"experiment {name} sweeps nothing"
    keys = list(params)
    ran = 0
    for values in itertools.product(*(str(params[k]).split(",") for k in keys)):
        cfg = _experiment(name, *extra, *(f"{k}={v}" for k, v in zip(keys, values, strict=True)))
        settings, clients = job_settings(cfg)
        if not skip_reason(settings, clients):
            ran += 1
            if clients > 1:
                assert settings.fl.clients == clients
            else:
                assert settings.train.epochs >= 1
    assert ran >= 2


def test_ag_news_experiment_matches_the_method() -> None:
    cfg = _experiment("ag_news", "clients=1")
    settings, _ = job_settings(cfg)
    assert settings.train.epochs == 50 and settings.model.pooling == "mean"
    assert settings.head.pre_classifier_dim is not None
    fed, clients = job_settings(_experiment("ag_news", "clients=3", "dp=adaptive"))
    assert (clients, fed.fl.rounds, fed.fl.local_epochs) == (3, 25, 2)
    assert fed.dp.mode == "adaptive" and fed.dp.warmup_rounds > 0


def test_a_sweep_refuses_resume_which_would_send_every_job_to_one_folder() -> None:
    for clients in (1, 2):
        cfg = _experiment("sms_scenarios", f"clients={clients}", "resume=/runs/one")
        with pytest.raises(ValueError, match="a sweep's jobs each write their own"):
            job_settings(cfg)


def test_centralised_jobs_default_to_the_federations_passes_over_the_data() -> None:
    settings, _ = job_settings(_experiment("sms_scenarios", "clients=1", "fl.rounds=3"))
    assert settings.train.epochs == 3 * 2


def test_a_sweeps_probe_rounds_probe_its_centralised_jobs_for_as_many_passes() -> None:
    """fl.probe_rounds=N in a sweep: its federated jobs probe N rounds, its centralised ones
    N x fl.local_epochs epochs (train.probe_epochs), so the two start the adapter alike."""
    common = ("approach=adapter_car", "fl.rounds=6", "fl.probe_rounds=3")
    central, _ = job_settings(_experiment("sms_scenarios", "clients=1", *common))
    assert central.train.probe_epochs == 3 * 2 and central.train.epochs == 6 * 2
    own, _ = job_settings(
        _experiment("sms_scenarios", "clients=1", *common, "train.probe_epochs=4")
    )
    assert own.train.probe_epochs == 4  # set by hand: kept
    fed, _ = job_settings(_experiment("sms_scenarios", "clients=2", *common))
    assert fed.fl.probe_rounds == 3 and fed.train.probe_epochs == 0


def test_a_sweeps_probe_rounds_leave_its_mips_jobs_to_train_the_adapter_from_round_1() -> None:
    """A sweep over approaches shares fl.probe_rounds: adapter + MIPS has no head to probe, so
    its jobs run without probe rounds instead of failing on the setting."""
    common = ("approach=adapter_mips", "fl.rounds=6", "fl.probe_rounds=3")
    fed, clients = job_settings(_experiment("sms_scenarios", "clients=2", *common))
    assert clients == 2 and fed.fl.probe_rounds == 0 and not skip_reason(fed, clients)
    central, _ = job_settings(_experiment("sms_scenarios", "clients=1", *common))
    assert central.train.epochs == 6 * 2 and central.train.probe_epochs == 0
    assert central.fl.probe_rounds == 0 and not skip_reason(central, 1)
    car, _ = job_settings(
        _experiment("sms_scenarios", "clients=2", *common[1:], "approach=adapter_car")
    )
    assert car.fl.probe_rounds == 3
