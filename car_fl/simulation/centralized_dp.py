"""Centralised training that honours ``dp``: ``dp=none`` trains as before, ``dp=record`` runs
DP-SGD, and the local-DP modes are refused before any work.

``dp=record`` trains the whole training split as the one node of an in-process federation, one
round per epoch. Written as a federation of one so that DP-SGD's sampling, clipping, noise
calibration and accounting (:mod:`car_fl.client.record_dp`, :mod:`car_fl.settings.dp_plan`)
and the server's own ε figure (:mod:`car_fl.server.privacy_check`) are the code a federation
runs, not a copy; ``metrics.json`` has the run's ε beside its metrics. ``dp=fixed`` and
``dp=adaptive`` protect an update from the server that aggregates it: one machine has no such
server, so they have nothing to protect and are refused (see
:func:`car_fl.standalone.centralized.check_no_dp`).
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
    """``settings`` as a federation of one node holding the whole training split, one local
    epoch per round and ``train.epochs`` rounds."""
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
