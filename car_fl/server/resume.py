"""What a federation adds to a resume (:mod:`car_fl.results.resume`): its clients' rows, its
global model as Flower's record, and DP-SGD's σ kept as the rounds already run used it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord

from car_fl.protocol.messages import to_record
from car_fl.results.resume import ResumePoint, check_run_dir, load_resume_point
from car_fl.results.rows import CLIENTS_CSV, ClientRow
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.dp_plan import record_plan
from car_fl.settings.flower import NODE_LOCAL_KEYS
from car_fl.settings.schema import DPMode, Settings, federated_part


@dataclass
class RoundPoint:
    """Where an interrupted federation continues: the run read back
    (:class:`car_fl.results.resume.ResumePoint`), its global model as Flower's record, and
    the clients' rows up to its last complete round."""

    saved: ResumePoint
    arrays: ArrayRecord
    client_rows: list[ClientRow]

    @property
    def round(self) -> int:
        return self.saved.done


def check_noise_kept(run_dir: Path, settings: Settings, planned: int) -> None:
    """Refuse a new ``fl.rounds`` that would change DP-SGD's σ: with ``dp.target_epsilon`` σ
    is calibrated to the run's planned rounds, and the rounds already run used the old one
    (the server would count them with the new σ: a run from 3 to 30 rounds reported ε 0.88
    where 3.21 had been spent)."""
    if settings.dp.mode is not DPMode.RECORD or planned == settings.fl.rounds:
        return
    as_planned = copy.deepcopy(settings)
    as_planned.fl.rounds = planned
    before = record_plan(as_planned)
    after = record_plan(settings)
    if before.noise_multiplier != after.noise_multiplier:
        raise ValueError(
            f"resume={run_dir}: under dp=record with dp.target_epsilon, σ is calibrated to "
            f"fl.rounds: {planned} rounds gave σ {before.noise_multiplier:.4g}, "
            f"fl.rounds={settings.fl.rounds} gives {after.noise_multiplier:.4g}, and the rounds "
            f"already run used the first; resume with fl.rounds={planned} (car-fl train: "
            f"train.epochs={planned}), or start a new run"
        )


def load_round_point(run_dir: Path, settings: Settings) -> RoundPoint:
    """The last round whose checkpoint is complete, with the history up to it
    (:func:`car_fl.results.resume.load_resume_point`). ``fl.rounds`` may be raised, unless
    DP-SGD's σ depends on it (:func:`check_noise_kept`); node-local values are each machine's
    own; a federation does not read ``train.epochs`` (car-fl train dp=record makes it
    ``fl.rounds``)."""
    check_run_dir(run_dir, "federated")
    # a run saved before federated runs refused train.probe_epochs (which it ignored)
    saved = federated_part(settings_from_yaml((run_dir / "config.yaml").read_text("utf-8")))
    check_noise_kept(run_dir, settings, saved.fl.rounds)
    point = load_resume_point(
        run_dir,
        settings,
        kind="federated",
        saved=saved,
        steps=settings.fl.rounds,
        steps_key="fl.rounds",
        unit="round",
        may_change=(*NODE_LOCAL_KEYS, "fl.rounds", "train.epochs"),
        fix="resume it with the same overrides (only fl.rounds may change)",
    )
    if point.finished:
        raise ValueError(
            f"resume={run_dir}: the run already has {point.done} rounds; raise fl.rounds above it"
        )
    clients_csv = run_dir / CLIENTS_CSV
    client_rows = ClientRow.read_csv(clients_csv) if clients_csv.is_file() else []
    return RoundPoint(
        saved=point,
        arrays=to_record(point.checkpoint.state, dtype=settings.comm.dtype),
        client_rows=[row for row in client_rows if row.round <= point.done],
    )
