"""Centralised training that honours ``dp``: ``dp=none`` trains as before, ``dp=record`` runs
DP-SGD, and the local-DP modes are refused before any work.

``dp=record`` trains as the one node of an in-process federation, one round per epoch, so its
DP-SGD and ε are the federation's code, not a copy. Local DP has no server to protect from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.schema import Partitioning, Settings
from car_fl.simulation.in_process import run_local
from car_fl.standalone.centralized import run_centralized


def train_centrally(settings: Settings, output_dir: str | Path) -> dict[str, Any]:
    """Train on this machine under ``settings.dp``; the run's summary (``metrics.json``)."""
    if MODES[settings.dp.mode].one_machine == "one node":
        summary: dict[str, Any] = run_local(one_node(settings, output_dir))["summary"]
        return summary
    return run_centralized(settings, output_dir)  # refuses the local-DP modes before any work


def one_node(settings: Settings, output_dir: str | Path) -> Settings:
    """``settings`` as one node holding the training split, one epoch per round."""
    fl = dataclasses.replace(
        settings.fl,
        clients=1,
        min_clients=1,
        clients_per_round=None,
        rounds=settings.train.epochs,
        local_epochs=1,
        partitioning=Partitioning.IID,
    )
    return dataclasses.replace(settings, fl=fl, output_dir=str(output_dir))
