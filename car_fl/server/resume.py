"""Resuming an interrupted federation: its last complete round, read back from its run directory."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord

from car_fl.protocol.messages import to_record
from car_fl.results.checkpoint import load_checkpoint
from car_fl.results.rows import CLIENTS_CSV, METRICS_JSON, ClientRow, MetricsFile, RoundRow
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.dp_plan import record_plan
from car_fl.settings.flat import refuse_other_settings
from car_fl.settings.flower import NODE_LOCAL_KEYS
from car_fl.settings.schema import DPMode, Settings, federated_part

log = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """Where an interrupted run continues: its last complete round and what it had written."""

    round: int
    arrays: ArrayRecord
    history: list[RoundRow]
    client_rows: list[ClientRow]
    initial: dict[str, float]


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


def load_resume_point(run_dir: Path, settings: Settings) -> ResumePoint:
    """The last round whose checkpoint is complete, with the history up to it.

    The run's saved configuration must match this one (``fl.rounds`` may be raised, unless
    DP-SGD's σ depends on it).
    """
    saved_config = run_dir / "config.yaml"
    for path in (saved_config, run_dir / METRICS_JSON):
        if not path.is_file():
            raise FileNotFoundError(f"resume={run_dir}: {path.name} is missing; is it a run dir?")
    # a run saved before federated runs refused train.probe_epochs (which it ignored)
    saved = federated_part(settings_from_yaml(saved_config.read_text(encoding="utf-8")))
    planned = saved.fl.rounds
    # node-local values are each machine's own; a federation does not read train.epochs
    # (car-fl train dp=record makes it fl.rounds)
    refuse_other_settings(
        run_dir,
        saved,
        settings,
        may_change=(*NODE_LOCAL_KEYS, "fl.rounds", "train.epochs"),
        fix="resume it with the same overrides (only fl.rounds may change)",
    )
    check_noise_kept(run_dir, settings, planned)
    metrics = MetricsFile.read(run_dir)
    stopped = metrics.summary.stopped_early
    if stopped is not None:
        raise ValueError(
            f"resume={run_dir}: that run ended after round {stopped}, when train.patience="
            f"{settings.train.patience} rounds had not improved on validation: it finished, it "
            "was not interrupted; to train longer start a new run (a larger train.patience)"
        )
    for row in reversed(metrics.history):
        folder = run_dir / "checkpoints" / f"round-{row.round:03d}"
        try:
            checkpoint = load_checkpoint(folder)
        except (OSError, ValueError) as err:
            log.warning("resume: skipping round %s (%s)", row.round, err)
            continue
        done = checkpoint.round
        if done >= settings.fl.rounds:
            raise ValueError(
                f"resume={run_dir}: the run already has {done} rounds; raise fl.rounds above it"
            )
        clients_csv = run_dir / CLIENTS_CSV
        client_rows = ClientRow.read_csv(clients_csv) if clients_csv.is_file() else []
        return ResumePoint(
            round=done,
            arrays=to_record(checkpoint.state, dtype=settings.comm.dtype),
            history=[r for r in metrics.history if r.round <= done],
            client_rows=[r for r in client_rows if r.round <= done],
            initial=metrics.summary.initial or {},
        )
    raise ValueError(f"resume={run_dir}: no complete round checkpoint to continue from")
