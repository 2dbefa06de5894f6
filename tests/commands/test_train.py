"""``car-fl train``: centralised training from the command line; mistakes fail in seconds with
one line, results are readable by others."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from car_fl.cli import main as cli_main
from car_fl.results.rows import MetricsFile
from car_fl.testing.tiny import tiny_overrides

PROJECT = Path(__file__).resolve().parents[2]


def train(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}
    command = [sys.executable, "-m", "car_fl.cli", "train", *args]
    return subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60)


def test_the_offline_default_fails_in_seconds_naming_both_fixes(tmp_path: Path) -> None:
    tick = time.monotonic()
    done = train(home=tmp_path / "hf")
    assert time.monotonic() - tick < 10
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("car-fl train: the model 'TinyLlama/TinyLlama-1.1B-Chat-v1.0' and")
    assert "model=minilm" in line and "model.name_or_path=" in line and "dataset.path=" in line


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("fl.round=2",), "car-fl train: fl.round is not a setting; did you mean fl.rounds?"),
        (("model=minilm", "dataset.path=/nope/a.tsv"), "car-fl train: dataset.path=/nope/a.tsv"),
        (("dp=recrod",), "car-fl train: dp=recrod is not an option of dp; did you mean dp=record?"),
        (
            ("model=minilm", "dataset=sms_spam", "resume=/nope/run"),
            "car-fl train: resume=/nope/run: config.yaml is missing; resume= takes the folder",
        ),
    ],
)
def test_mistakes_exit_non_zero_with_one_line(
    tmp_path: Path, args: tuple[str], reason: str
) -> None:
    done = train(*args, home=tmp_path / "hf")
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(reason)


@pytest.mark.slow
def test_train_writes_results_others_can_read(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache")
    old = os.umask(0o022)
    try:
        assert cli_main(["train", *overrides, "train.epochs=2", f"output_dir={out}"]) == 0
        assert f"results: {out}" in capsys.readouterr().out
        # the same run, two epochs longer, goes on in its own folder
        assert cli_main(["train", *overrides, "train.epochs=4", f"resume={out}"]) == 0
    finally:
        os.umask(old)
    assert f"results: {out}" in capsys.readouterr().out
    assert len(MetricsFile.read(out).history) == 4
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.json", "metrics.csv", "curves.png"} <= {p.name for p in files}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}
