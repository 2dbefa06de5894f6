"""Reading a stopped run back to continue it: ``resume=<its run directory>``, for every run.

One procedure for a centralised run and a federation (docs/architecture.md, "What every run
shares"): the folder must hold a run of the expected kind; its settings must equal this run's
but for those that may change (:func:`car_fl.settings.flat.refuse_other_settings`); a run that
ended by its patience is refused; the newest checkpoint that loads is where it goes on, with
the rows up to it. What only one kind of run keeps is added by its caller: the optimiser's
state (:mod:`car_fl.standalone.resume`), the clients' rows and DP-SGD's σ
(:mod:`car_fl.server.resume`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from car_fl.results.checkpoint import Checkpoint, load_checkpoint
from car_fl.results.rows import METRICS_JSON, MetricsFile, RoundRow, RunSummary
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.flat import refuse_other_settings
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)

#: What each kind of run is called in a refusal, and how it is resumed.
KINDS = {
    "centralized": "a centralised run (car-fl train)",
    "federated": "a federation (car-fl run / flwr run ., or car-fl train dp=record)",
}


@dataclass
class ResumePoint:
    """Where a stopped run goes on: after step ``done`` (an epoch or a round), from its
    ``checkpoint``, with the rows and the summary the run had written."""

    done: int
    checkpoint: Checkpoint
    history: list[RoundRow]
    summary: RunSummary
    #: Every step the settings plan is done but the run's end was not written: the resume
    #: writes it (a centralised run) or refuses (a federation).
    finished: bool

    @property
    def initial(self) -> dict[str, float]:
        """The starting point's metrics (epoch or round 0)."""
        return self.summary.initial or {}


def check_run_dir(run_dir: Path, kind: str) -> None:
    """Refuse, in seconds and before any other work, a folder that is not a run of ``kind``."""
    for name in ("config.yaml", METRICS_JSON):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(
                f"resume={run_dir}: {name} is missing; resume= takes the folder of "
                f"{KINDS[kind]} that has run at least one step"
            )
    saved_kind = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8")).get("kind")
    if saved_kind != kind:
        raise ValueError(
            f"resume={run_dir}: that is {KINDS.get(saved_kind, repr(saved_kind))}, and this is "
            f"{KINDS[kind]}; resume it the way it was started"
        )


def load_resume_point(
    run_dir: Path,
    settings: Settings,
    *,
    kind: str,
    saved: Settings | None = None,
    steps: int,
    steps_key: str,
    unit: str,
    may_change: Sequence[str],
    fix: str,
    checkpoints: Iterable[Path] | None = None,
) -> ResumePoint:
    """The newest complete step of the ``kind`` run in ``run_dir``, to go on with ``settings``
    for ``steps`` steps (the setting ``steps_key``: ``train.epochs`` or ``fl.rounds``).

    ``saved``: the run's settings as compared (default: its ``config.yaml``); ``checkpoints``:
    the folders to continue from, newest first (default: one per row, ``round-NNN``); one that
    does not load is skipped with a warning. Refused (``ValueError``/``FileNotFoundError``,
    saying what to do) when the folder is not such a run, a setting other than
    ``may_change`` differs, the run ended by its patience, or it has every step and its end.
    """
    check_run_dir(run_dir, kind)
    if saved is None:
        saved = settings_from_yaml((run_dir / "config.yaml").read_text(encoding="utf-8"))
    refuse_other_settings(run_dir, saved, settings, may_change=may_change, fix=fix)
    metrics = MetricsFile.read(run_dir)
    summary = metrics.summary
    if summary.stopped_early is not None:
        raise ValueError(
            f"resume={run_dir}: that run ended after {unit} {summary.stopped_early}, when "
            f"train.patience={settings.train.patience} {unit}s had not improved on validation: "
            "it finished, it was not interrupted; to train longer start a new run (a larger "
            "train.patience)"
        )
    if checkpoints is None:
        checkpoints = (
            run_dir / "checkpoints" / f"round-{row.round:03d}" for row in reversed(metrics.history)
        )
    for folder in checkpoints:
        try:
            checkpoint = load_checkpoint(folder)
        except (OSError, ValueError) as err:
            log.warning("resume: skipping %s (%s)", folder.name, err)
            continue
        done = checkpoint.round
        history = [row for row in metrics.history if row.round <= done]
        if [row.round for row in history] != list(range(1, done + 1)):
            raise ValueError(
                f"resume={run_dir}: metrics.json does not hold {unit}s 1 to {done} of "
                f"{folder.name}; it was changed by hand, or is another run's; start a new run"
            )
        if done >= steps and summary.complete:
            raise ValueError(
                f"resume={run_dir}: the run already has {done} {unit}s; raise {steps_key} above it"
            )
        return ResumePoint(
            done=done,
            checkpoint=checkpoint,
            history=history,
            summary=summary,
            finished=done >= steps,
        )
    raise ValueError(f"resume={run_dir}: no complete {unit} checkpoint to continue from")
