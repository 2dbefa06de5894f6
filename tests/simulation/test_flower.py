"""Flower's own simulation engine (Ray) end to end, with the tiny offline Llama: what only a
real simulation shows (each client in its Ray worker with its CPU share of threads, the
encoder loaded once per worker, the bytes Flower carries). The federation's reference checks
(one client equals centralised training, a resumed run equals an uninterrupted one, ...)
run through the same ServerApp and ClientApp handlers in one process:
``tests/server/test_federation_runs.py``."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

from car_fl.results.run import load_checkpoint, select_best
from car_fl.simulation.flower import run_simulation
from car_fl.testing.tiny import tiny_overrides

pytestmark = pytest.mark.slow


@pytest.fixture
def base(tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path) -> list[str]:
    return tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=tmp_path / "cache")


def rows_of(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "final").state


def test_two_client_simulation_learns_and_ships_only_trainable_tensors(
    base: list[str], tmp_path: Path
) -> None:
    """The one run on Flower's engine: adapter mode, the mode that ships the most."""
    out = tmp_path / "fl"
    rounds = 3
    metrics = run_simulation(
        [*base, "mode=adapter", "train.lr=0.01", f"fl.rounds={rounds}", f"output_dir={out}"]
    )
    history = metrics["history"]
    assert [r["round"] for r in history] == list(range(1, rounds + 1))
    # Adapter mode tests once, at the end (eval.test_every_round): its learning shows on
    # validation, evaluated every round; the final state's test top-1 is there either way.
    assert history[-1]["val_top1"] > metrics["summary"]["initial"]["val_top1"] + 0.2
    assert history[-1]["test_top1"] >= 0.75
    # Results people can read, and the resolved config the clients agreed on.
    for name in ("config.yaml", "metrics.csv", "clients.csv", "curves.png"):
        assert (out / name).is_file(), name
    for r in range(1, rounds + 1):
        assert (out / "checkpoints" / f"round-{r:03d}" / "weights.safetensors").is_file()
    assert (out / "checkpoints" / "best").is_dir() and (out / "checkpoints" / "final").is_dir()
    # Bytes per client = exactly the trainable tensors' bytes (head and adapter), nothing else.
    d = 64
    raw = (4 * d + 4) * 4 + d * d * 4
    rows = list(csv.DictReader((out / "clients.csv").open()))
    assert len(rows) == 2 * rounds and {r["status"] for r in rows} == {"ok"}
    for row in rows:
        assert int(row["bytes_sent"]) == raw
        assert int(row["bytes_received"]) == int(row["bytes_sent"])
    # Each simulated client's torch threads follow its CPU share: no oversubscription.
    share = max(1, (os.cpu_count() or 1) // 2)
    assert {int(float(r["torch_threads"])) for r in rows} == {share}
    # The encoder is loaded once per client process, never again in later rounds.
    assert {int(float(r["encoder_loads"])) for r in rows} == {1}
    # Clients train on the training split only: 400 examples - 80 test - 32 validation.
    assert sum(float(r["num_examples"]) for r in rows if r["round"] == "1") == 288
    # The best round is chosen on validation and its checkpoint is that round's model.
    best = select_best(history)
    assert best is not None and metrics["summary"]["best"]["round"] == best["round"]
    assert load_checkpoint(out / "checkpoints" / "best").round == best["round"]
    assert {"val_top1", "test_top1"} <= set(rows_of(out / "metrics.csv")[0])
