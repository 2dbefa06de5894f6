"""A whole federation under record-level DP (its ServerApp and ClientApp handlers in one
process): σ, q, steps and ε per client on record."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from car_fl.settings.compose import load_settings
from car_fl.settings.dp_plan import record_plan
from car_fl.simulation.in_process import run_local
from car_fl.testing.tiny import tiny_overrides

pytestmark = pytest.mark.slow


def test_record_dp_federation_reports_each_clients_privacy(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    overrides = [
        *tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache"),
        "dp=record",
        "dp.delta=1e-4",
        "dp.sample_rate=0.1",
        "dp.target_epsilon=4",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "train.optimizer=sgd",
        "train.lr=0.5",
    ]
    metrics = run_local(load_settings([*overrides, f"output_dir={tmp_path / 'run'}"]))
    settings = load_settings(overrides)
    plan = record_plan(settings)
    summary = metrics["summary"]
    assert summary["dp"] == "record"
    clients = summary["dp_clients"]
    assert sorted(clients) == ["0", "1"]  # by partition id (JSON keys)
    for figures in clients.values():
        assert figures["noise_multiplier"] == plan.noise_multiplier
        assert figures["sample_rate"] == 0.1
        assert figures["steps"] == 2 * plan.steps_per_round == 20
        assert figures["epsilon"] == pytest.approx(plan.epsilon(20))
        assert 4 * 0.99 <= figures["epsilon"] <= 4
    assert summary["epsilon"] == max(f["epsilon"] for f in clients.values())
    assert summary["flagged_clients"] == []  # honest clients: their claims match the server's
    rows = list(csv.DictReader((tmp_path / "run" / "clients.csv").open()))
    assert {float(r["dp_steps"]) for r in rows} == {10.0, 20.0}
    assert all(float(r["dp_epsilon"]) == float(r["server_epsilon"]) for r in rows)
    assert all(r["claim_mismatch"] == "" for r in rows)
    assert all(r["train_loss"] == "" for r in rows)  # never sent under record-level DP
