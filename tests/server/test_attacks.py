"""One hostile client of three, each attack, against the update-norm bound (with FedAvg and
with the median) and Krum: no crash, final top-1 within 2 points of the same aggregation's
honest run (Krum: 5, see TOLERANCE), and every rejected reply logged with its node and reason.
Tiny task (4 rounds), federations in process (LocalGrid)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from car_fl.settings.compose import load_settings
from car_fl.simulation.apps import import_app
from car_fl.simulation.hostile import PARAMETER_ATTACKS, hostile_client
from car_fl.simulation.in_process import run_local
from car_fl.testing.tiny import tiny_overrides

pytestmark = pytest.mark.slow

DEFENCES = {
    "norm bound": ["strategy=fedavg", "fl.norm_bound=adaptive"],
    "krum": ["strategy=krum"],
    # what docs/federation.md recommends with few clients: the median is biased by a hostile
    # reply (it picks which honest value wins), the norm bound's reject action removes it
    "median + norm bound": ["strategy=median", "fl.norm_bound=adaptive"],
}
#: What the defence does with the hostile reply: reject it (the count of rejections per run),
#: or outvote it (Krum chooses another reply; checks still reject malformed ones).
REJECTED = {
    ("norm bound", "huge"): 4,
    ("norm bound", "scale50"): 4,
    ("norm bound", "signflip10"): 4,
    ("norm bound", "broadcast"): 4,
    ("norm bound", "overclaim"): 4,
    ("krum", "huge"): 0,
    ("krum", "scale50"): 0,
    ("krum", "signflip10"): 0,
    ("krum", "broadcast"): 4,
    ("krum", "overclaim"): 4,
    **{("median + norm bound", attack): 4 for attack in PARAMETER_ATTACKS},
    ("median + norm bound", "broadcast"): 4,
    ("median + norm bound", "overclaim"): 4,
}


#: How far below its own honest run a defence may end (80 test examples: 0.0125 each). The
#: norm bound meets the 2-point bar. Krum (f = 1) with only 3 clients, fewer than the 2f + 3 its
#: guarantee needs, keeps one honest update per round and drops the other, which here costs
#: up to 4 test examples; it is held to that, far above FedAvg's collapse (0.00-0.25).
TOLERANCE = {"norm bound": 0.02, "krum": 0.05, "median + norm bound": 0.02}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attacks")


def federation(
    workdir: Path, tiny_llama: Path, synthetic_tsv: Path, defence: str, attack: str
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = load_settings(
            [
                *tiny_overrides(tiny_llama, synthetic_tsv, cache_dir=workdir / "cache"),
                f"output_dir={workdir / f'{defence}-{attack}'}",
                "fl.clients=3",
                "fl.rounds=4",
                "train.lr=0.01",
                *DEFENCES[defence],
            ]
        )
        honest = import_app("client_app").train
        return run_local(settings, client_train=hostile_client(honest, attack=attack))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def honest_top1(workdir: Path, tiny_llama: Path, synthetic_tsv: Path) -> dict[str, float]:
    return {
        defence: federation(workdir, tiny_llama, synthetic_tsv, defence, "none")["history"][-1][
            "test_top1"
        ]
        for defence in DEFENCES
    }


@pytest.mark.parametrize(("defence", "attack"), sorted(REJECTED))
def test_one_hostile_client_of_three_does_not_poison_the_model(
    workdir: Path,
    tiny_llama: Path,
    synthetic_tsv: Path,
    honest_top1: dict[str, float],
    caplog: pytest.LogCaptureFixture,
    defence: str,
    attack: str,
) -> None:
    with caplog.at_level(logging.ERROR, logger="car_fl.server.strategy"):
        metrics = federation(workdir, tiny_llama, synthetic_tsv, defence, attack)
    assert metrics["summary"]["complete"] and not metrics["summary"]["skipped_rounds"]
    final = metrics["history"][-1]["test_top1"]
    gap = abs(final - honest_top1[defence])
    assert gap <= TOLERANCE[defence] + 1e-6, (final, honest_top1[defence])  # float32 top-1
    rejected = sum(row["clients_rejected"] for row in metrics["history"])
    assert rejected == REJECTED[(defence, attack)]
    # Every rejection names the hostile node (partition 1) and why, in the log and clients.csv.
    rows = list(csv.DictReader((Path(metrics["output_dir"]) / "clients.csv").open()))
    bad = [r for r in rows if r["status"] == "rejected"]
    assert len(bad) == rejected
    assert all(r["node"] == "1002" for r in bad)  # LocalGrid: node 1001 + i holds partition i
    logged = [
        r.getMessage() for r in caplog.records if "rejected the reply of node" in r.getMessage()
    ]
    assert len(logged) == rejected
    for row in bad:
        assert any(f"node {row['node']}: {row['reason']}" in line for line in logged)
