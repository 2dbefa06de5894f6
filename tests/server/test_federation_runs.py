"""Federations through the project's ServerApp and ClientApp handlers in one process
(car_fl.simulation.in_process), with the tiny offline Llama: the reference checks of a
federated run, against centralised training and against itself. Flower's own engine (Ray)
is exercised end to end in ``tests/simulation/test_flower.py``."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from car_fl.centralized import run_centralized
from car_fl.privacy.accountant import epsilon
from car_fl.results.rows import ClientRow, MetricsFile
from car_fl.results.run import load_checkpoint
from car_fl.settings.compose import load_settings, settings_to_yaml
from car_fl.simulation.in_process import run_local
from car_fl.testing.tiny import tiny_overrides
from tests.helpers import stop_in_the_end

pytestmark = pytest.mark.slow


@pytest.fixture
def base(tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path) -> list[str]:
    return tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache")


def federate(overrides: list[str]) -> dict[str, Any]:
    """A whole federation in this process; its ``metrics.json`` content."""
    settings = load_settings(overrides)
    if settings.output_dir is None:  # a resumed run writes where it was
        settings.output_dir = settings.resume
    return run_local(settings)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "final").state


@pytest.mark.parametrize(
    ("fl", "central"),
    [
        # One round of E = 2 local epochs (AdamW) = 2 centralised epochs.
        (["fl.rounds=1", "fl.local_epochs=2"], ["train.epochs=2"]),
        # Plain SGD has no optimizer state: R = 3 rounds x E = 1 epoch = 3 centralised epochs.
        (
            ["fl.rounds=3", "fl.local_epochs=1", "train.optimizer=sgd", "train.lr=0.05"],
            ["train.epochs=3", "train.optimizer=sgd", "train.lr=0.05"],
        ),
    ],
)
def test_one_client_federation_equals_centralised_training(
    base: list[str], tmp_path: Path, fl: list[str], central: list[str]
) -> None:
    fed = federate([*base, "fl.clients=1", *fl, f"output_dir={tmp_path / 'fl'}"])
    run_centralized(load_settings([*base, *central]), tmp_path / "central")
    fed_state, central_state = final_state(tmp_path / "fl"), final_state(tmp_path / "central")
    assert set(fed_state) == set(central_state)
    for name, value in central_state.items():
        torch.testing.assert_close(fed_state[name], value, rtol=1e-5, atol=1e-6)
    central_metrics = json.loads((tmp_path / "central" / "metrics.json").read_text())
    assert fed["history"][-1]["test_top1"] == pytest.approx(
        central_metrics["history"][-1]["test_top1"]
    )
    # Same metrics format: every centralised column is also in the federated rows.
    assert set(central_metrics["history"][0]) <= set(fed["history"][0])


def test_server_and_clients_resolve_the_same_configuration(base: list[str], tmp_path: Path) -> None:
    out = tmp_path / "fl"
    federate([*base, "fl.rounds=1", "fl.local_epochs=1", f"output_dir={out}"])
    saved = (out / "config.yaml").read_text()
    assert saved == settings_to_yaml(
        load_settings([*base, "fl.rounds=1", "fl.local_epochs=1", f"output_dir={out}"])
    )
    # Clients check the server's fingerprint on every message; a mismatch fails the round,
    # so a completed run means every client resolved the same configuration.
    rows = list(csv.DictReader((out / "clients.csv").open()))
    assert {r["status"] for r in rows} == {"ok"}


def test_adaptive_dp_simulation_reports_epsilon_and_keeps_each_clients_state(
    base: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "fl"
    metrics = federate(
        [*base, "dp=adaptive", "fl.rounds=3", "fl.local_epochs=1", f"output_dir={out}"]
    )
    history = metrics["history"]
    eps = [row["epsilon"] for row in history]
    # z = 0.1: update and clipped-indicator together cost one Gaussian of multiplier z/2 a round.
    assert eps == pytest.approx([epsilon({0.05: r}, 1e-5) for r in (1, 2, 3)], rel=1e-6)
    assert metrics["summary"]["epsilon"] == eps[-1]
    assert metrics["summary"]["flagged_clients"] == []  # the clients' claims match the server's
    assert load_checkpoint(out / "checkpoints" / "final").epsilon == eps[-1]
    # Under DP no train metric reaches the server.
    assert all(math.isnan(row["train_loss"]) for row in history)
    rows = list(csv.DictReader((out / "clients.csv").open()))
    by_client: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_client.setdefault(row["partition_id"], []).append(row)
        assert row["train_loss"] == row["train_accuracy"] == row["train_seconds"] == ""
        assert "dp_clip" not in row
    assert len(by_client) == 2
    for client_rows in by_client.values():
        # The DP state persists in the node's state: releases (and C_i) carry over rounds.
        client_rows.sort(key=lambda r: int(r["round"]))
        assert [float(r["dp_releases"]) for r in client_rows] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("dp", ["none", "adaptive"])
def test_a_resumed_run_matches_an_uninterrupted_one(
    base: list[str], tmp_path: Path, dp: str
) -> None:
    common = [*base, f"dp={dp}", "fl.local_epochs=1"]
    whole = federate([*common, "fl.rounds=3", f"output_dir={tmp_path / 'whole'}"])
    # "Interrupted" after round 2: the run directory holds rounds 1-2 only.
    part = tmp_path / "part"
    federate([*common, "fl.rounds=2", f"output_dir={part}"])
    resumed = federate([*common, "fl.rounds=3", f"resume={part}"])
    assert [row["round"] for row in resumed["history"]] == [1, 2, 3]
    assert resumed["summary"]["complete"]
    if dp == "none":
        a, b = final_state(tmp_path / "whole"), final_state(part)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-6)
        assert resumed["history"][-1]["test_top1"] == pytest.approx(
            whole["history"][-1]["test_top1"]
        )
    else:
        assert resumed["summary"]["epsilon"] > 0


@pytest.mark.parametrize("stopped_in", ["clients.csv", "metrics.json"])
def test_a_private_federation_stopped_while_writing_a_row_resumes_with_every_reply_counted(
    base: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped_in: str
) -> None:
    """Stopped while writing round 2's clients.csv or its metrics.json row: the resume goes on
    from round 1 and its ε is the uninterrupted run's. (metrics.json was written first: a stop
    between them resumed from round 2 with a clients.csv that lacked it, and the server's ε
    after the resume left round 2 out; found by a review.)"""
    common = [*base, "dp=fixed", "dp.noise_multiplier=1.0", "fl.local_epochs=1", "fl.rounds=3"]
    whole = federate([*common, f"output_dir={tmp_path / 'whole'}"])
    real_metrics, real_clients = MetricsFile.write, ClientRow.write_csv

    def metrics(self: MetricsFile, folder: Path) -> None:
        if len(self.history) == 2 and stopped_in == "metrics.json":
            raise KeyboardInterrupt
        real_metrics(self, folder)

    def clients(path: Path, rows: list[ClientRow]) -> None:
        if max((row.round for row in rows), default=0) == 2 and stopped_in == "clients.csv":
            raise KeyboardInterrupt
        real_clients(path, rows)

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(MetricsFile, "write", metrics)
        patch.setattr(ClientRow, "write_csv", staticmethod(clients))
        with pytest.raises(KeyboardInterrupt):
            federate([*common, f"output_dir={run}"])
    resumed = federate([*common, f"resume={run}"])
    assert [row["round"] for row in resumed["history"]] == [1, 2, 3]
    assert resumed["summary"]["epsilon"] == pytest.approx(whole["summary"]["epsilon"])


def test_a_federation_stopped_in_its_end_is_ended_by_a_resume(
    base: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round's row and checkpoint written, the end (the test split of the selected and
    final state, checkpoints/final) not: a resume trains nothing and writes the end."""
    common = [*base, "fl.rounds=2", "fl.local_epochs=1"]
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_in_the_end(patch)
        with pytest.raises(KeyboardInterrupt):
            federate([*common, f"output_dir={run}"])
    left = json.loads((run / "metrics.json").read_text())
    assert [row["round"] for row in left["history"]] == [1, 2] and not left["summary"]["complete"]
    ended = federate([*common, f"resume={run}"])
    assert ended["summary"]["complete"] and ended["history"] == left["history"]
    last = load_checkpoint(run / "checkpoints" / "round-002").state
    final = final_state(run)
    assert all(torch.equal(final[name], last[name]) for name in last)


def test_resume_refuses_another_configuration(base: list[str], tmp_path: Path) -> None:
    part = tmp_path / "part"
    federate([*base, "fl.rounds=1", "fl.local_epochs=1", f"output_dir={part}"])
    with pytest.raises(
        ValueError, match=r"other settings \(fl.local_epochs=1→2\).*only fl.rounds may change"
    ):
        federate([*base, "fl.rounds=2", "fl.local_epochs=2", f"resume={part}"])


def test_a_run_saved_with_train_probe_epochs_still_resumes_without_it(
    base: list[str], tmp_path: Path
) -> None:
    """Runs made before federated runs refused train.probe_epochs saved it in their
    config.yaml (and ignored it): resuming one without it is the same configuration."""
    part = tmp_path / "part"
    federate([*base, "fl.rounds=1", "fl.local_epochs=1", f"output_dir={part}"])
    saved = part / "config.yaml"
    text = saved.read_text(encoding="utf-8")
    assert "probe_epochs: 0" in text
    saved.write_text(text.replace("probe_epochs: 0", "probe_epochs: 5"), encoding="utf-8")
    resumed = federate([*base, "fl.rounds=2", "fl.local_epochs=1", f"resume={part}"])
    assert [row["round"] for row in resumed["history"]] == [1, 2]
