"""One recorder for a run's rounds (federated) or epochs (centralised).

:class:`Recorder` takes each evaluated :class:`~car_fl.results.rows.RoundRow` and does the same
for both paths: one log line (:func:`round_line`), checkpoints (per round if asked, best on
validation, final), selection on validation (:mod:`car_fl.results.selection`), the metrics files
and the plot. The federation feeds it through :class:`car_fl.server.round_recorder.RoundRecorder`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from car_fl.data.labels import LabelMap
from car_fl.results.checkpoint import Checkpoint, save_checkpoint
from car_fl.results.plots import plot_curves
from car_fl.results.rows import (
    MetricsFile,
    RoundRow,
    RunSummary,
)
from car_fl.results.selection import is_better, select_best
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)


def round_line(row: RoundRow, *, unit: str = "round") -> str:
    """The fixed-format log line of one round (or epoch)."""
    m = row.metrics
    val = f"val loss {m['val_loss']:.4f} top1 {m['val_top1']:.4f} | " if "val_top1" in m else ""
    train_loss = row.train_loss if row.train_loss is not None else float("nan")
    train_acc = row.train_accuracy if row.train_accuracy is not None else float("nan")
    test = (
        f"test loss {m['test_loss']:.4f} top1 {m['test_top1']:.4f}"
        if math.isfinite(m.get("test_top1", math.nan))
        else "test at the end"  # eval.test_every_round=false: the selected and final state
    )
    return (
        f"{unit} {row.round:>3d} | train loss {train_loss:.4f} acc {train_acc:.4f} | {val}"
        f"{test} | {row.seconds:.1f}s | "
        f"sent {row.bytes_sent:,} B recv {row.bytes_received:,} B"
        + (f" | ε {row.epsilon:.4g}" if row.dp_active else "")
    )


def best_row(rows: list[RoundRow], *, initial: RoundRow | None = None) -> RoundRow | None:
    """The row selection keeps when the rows arrive in order (on validation), the starting
    point ``initial`` first."""
    return select_best([initial, *rows] if initial else rows, scores=lambda row: row.metrics)


@dataclass
class Recorder:
    """Rows, log lines, checkpoints, selection and result files of one run."""

    settings: Settings
    output_dir: Path
    label_map: LabelMap
    #: ``"epoch"`` (centralised) or ``"round"`` (federated): log lines and the plot's x axis.
    unit: str
    #: The plot's title.
    title: str
    #: Whether every row gets a checkpoint of its own (``checkpoints/round-NNN``).
    round_checkpoints: bool = False
    history: list[RoundRow] = field(default_factory=list)
    best: RoundRow | None = None
    #: The starting point (epoch or round 0, before any training), evaluated like any other
    #: row and a candidate for ``best``, so that selection never keeps a trained model worse
    #: on validation than the one it started from. Not part of :attr:`history`.
    initial: RoundRow | None = None
    #: What every checkpoint also records (a corpus's digest, a mixture of experts' layout).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"

    def add(self, row: RoundRow) -> bool:
        """Append ``row``; whether it is the new best (on validation, never on test)."""
        self.history.append(row)
        better = is_better(row.metrics, self.best.metrics if self.best is not None else None)
        if better:
            self.best = row
        return better

    def start(
        self,
        row: RoundRow,
        state: dict[str, torch.Tensor],
        *,
        epsilon: float | None = None,
    ) -> None:
        """The starting point ``row`` (round 0) of the model ``state``: logged, the first
        candidate for ``best`` (checkpointed as such), kept as :attr:`initial`."""
        if self.history or self.initial is not None:
            raise RuntimeError("the starting point is recorded once, before any other row")
        self.initial = row
        better = is_better(row.metrics, self.best.metrics if self.best is not None else None)
        if better:
            self.best = row
        log.info("%s | starting point", round_line(row, unit=self.unit))
        if better:
            save_checkpoint(self.checkpoints / "best", self.checkpoint(state, row, epsilon=epsilon))

    def record(
        self,
        row: RoundRow,
        state: dict[str, torch.Tensor],
        *,
        epsilon: float | None = None,
        note: str = "",
    ) -> None:
        """Add ``row`` of the model ``state``: log it, checkpoint it (and as best if it is)."""
        better = self.add(row)
        log.info("%s%s", round_line(row, unit=self.unit), note)
        checkpoint = self.checkpoint(state, row, epsilon=epsilon)
        if self.round_checkpoints:
            save_checkpoint(self.checkpoints / f"round-{row.round:03d}", checkpoint)
        if better:
            save_checkpoint(self.checkpoints / "best", checkpoint)

    def checkpoint(
        self,
        state: dict[str, torch.Tensor],
        row: RoundRow,
        *,
        round: int | None = None,
        epsilon: float | None = None,
    ) -> Checkpoint:
        return Checkpoint(
            state=state,
            label_map=self.label_map,
            settings=self.settings,
            round=row.round if round is None else round,
            metrics=row.to_dict(),
            epsilon=epsilon,
            extra=dict(self.extra),
        )

    def save_final(
        self,
        state: dict[str, torch.Tensor],
        *,
        round: int | None = None,
        epsilon: float | None = None,
    ) -> None:
        """``checkpoints/final``: ``state`` with the last row's metrics (the starting point's
        when no row followed it)."""
        last = self.history[-1] if self.history else self.initial
        if last is None:
            raise RuntimeError("no row to save a final checkpoint of")
        checkpoint = self.checkpoint(state, last, round=round, epsilon=epsilon)
        save_checkpoint(self.checkpoints / "final", checkpoint)

    def write(self, summary: RunSummary) -> None:
        """``metrics.json``, ``metrics.csv`` and ``curves.png``."""
        MetricsFile(history=self.history, summary=summary).write(self.output_dir)
        plot_curves(
            self.output_dir,
            self.history,
            title=self.title,
            x_label=self.unit,
            num_labels=len(self.label_map),
        )
