"""Centralised training honours ``dp``: DP-SGD at the asked ε, or a refusal before any work."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from car_fl.simulation.centralized_dp import one_node, train_centrally
from car_fl.testing.tiny import tiny_overrides

PROJECT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_record_level_dp_trains_the_whole_split_as_one_node_at_the_asked_epsilon(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("dp=record", "dp.target_epsilon=3", "train.epochs=2")
    summary = train_centrally(settings, tmp_path / "run")
    written = json.loads((tmp_path / "run" / "metrics.json").read_text(encoding="utf-8"))
    assert written["summary"] == json.loads(json.dumps(summary))
    assert summary["dp"] == "record" and 0 < summary["epsilon"] <= 3
    assert summary["flagged_clients"] == []  # the server's ε is the node's own
    [node] = summary["dp_clients"].values()
    assert node["noise_multiplier"] > 0 and node["epsilon"] == summary["epsilon"]
    # one round per epoch, each with its ε so far; the whole training split in the one node
    epsilons = [row["epsilon"] for row in written["history"] if row["round"] > 0]
    assert len(epsilons) == 2 and epsilons[0] < epsilons[1] == summary["epsilon"]
    assert summary["rounds"] == 2 and summary["clients"] == 1
    assert (tmp_path / "run" / "checkpoints" / "best").is_dir()


def test_one_node_holds_the_whole_training_split_one_epoch_a_round(make_settings) -> None:
    settings = make_settings(
        "dp=record", "train.epochs=3", "fl.clients=4", "fl.partitioning=dirichlet"
    )
    one = one_node(settings, "/tmp/out")
    assert (one.fl.clients, one.fl.rounds, one.fl.local_epochs) == (1, 3, 1)
    assert one.fl.partitioning.value == "iid" and one.output_dir == "/tmp/out"
    assert one.dp == settings.dp and one.train == settings.train


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_local_dp_modes_are_refused_before_any_work(
    make_settings, tmp_path: Path, mode: str
) -> None:
    with pytest.raises(ValueError, match=rf"dp={mode} is local DP.*dp=record"):
        train_centrally(make_settings(f"dp={mode}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_without_dp_it_is_the_centralised_loop(make_settings, tmp_path: Path) -> None:
    summary = train_centrally(make_settings("train.epochs=1"), tmp_path / "run")
    assert summary["kind"] == "centralized" and "epsilon" not in summary


@pytest.mark.slow
def test_the_hydra_entry_point_reports_epsilon_or_fails_before_any_work(
    tiny_llama: Path, synthetic_tsv: Path, tmp_path: Path
) -> None:
    base = tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def centralized(*overrides: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "car_fl.centralized", *base, *overrides]
        return subprocess.run(
            command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600
        )

    done = centralized(
        "dp=record", "dp.target_epsilon=3", "train.epochs=1", f"output_dir={tmp_path / 'dp'}"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "dp" / "metrics.json").read_text())["summary"]
    assert 0 < summary["epsilon"] <= 3 and math.isfinite(summary["epsilon"])
    # a local DP mode (each of them: test_local_dp_modes_are_refused_before_any_work)
    refused = centralized("dp=fixed", f"output_dir={tmp_path / 'fixed'}")
    assert refused.returncode != 0 and "dp=fixed is local DP" in refused.stderr
    assert not (tmp_path / "fixed").exists()
