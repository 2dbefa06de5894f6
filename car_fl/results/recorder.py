"""One recorder for a run's rounds (federated) or epochs (centralised).

:class:`Recorder` takes each evaluated :class:`~car_fl.results.rows.RoundRow` and does the same
for both paths: one log line (:func:`round_line`), checkpoints (per round if asked, best on
validation, final), selection on validation (:mod:`car_fl.results.selection`), the metrics files
and the plot. The federation feeds it through :class:`car_fl.server.round_recorder.RoundRecorder`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from car_fl.data.labels import LabelMap
from car_fl.results.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from car_fl.results.plots import plot_curves
from car_fl.results.rows import (
    MetricsFile,
    RoundRow,
    RunSummary,
)
from car_fl.results.selection import is_better, patience_spent, select_best
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)

#: Seconds between two drawings of a running run's ``curves.png`` (its end always draws it).
PLOT_SECONDS = 30.0


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


def brief(metrics: dict[str, float]) -> str:
    """``val``/``test`` loss and top-1 of a row's metrics, those that were evaluated."""
    parts = [
        f"{split} loss {metrics[f'{split}_loss']:.4f} top1 {metrics[f'{split}_top1']:.4f}"
        for split in ("val", "test")
        if math.isfinite(metrics.get(f"{split}_top1", math.nan))
    ]
    return ", ".join(parts) or "not evaluated"


def rows_since_best(
    rows: list[RoundRow], best: RoundRow, counts: Callable[[RoundRow], bool] | None = None
) -> int:
    """The rows after ``best`` that ``counts`` (default: every row): what the patience spends."""
    later = (row for row in rows if row.round > best.round)
    return sum(1 for row in later if counts is None or counts(row))


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
    #: The trainable state of :attr:`best` when it was recorded in this process (for its test
    #: metrics at the end, :meth:`test_at_end`).
    best_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    #: When ``curves.png`` was last drawn (``time.monotonic``), if it was.
    plotted_at: float | None = field(default=None, repr=False)

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
            self.best_state = state
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
            self.best_state = state
            save_checkpoint(self.checkpoints / "best", checkpoint)

    def since_best(self, counts: Callable[[RoundRow], bool] | None = None) -> int | None:
        """:func:`rows_since_best` of this run; None before any best."""
        return None if self.best is None else rows_since_best(self.history, self.best, counts)

    def stalled(
        self, patience: int | None, counts: Callable[[RoundRow], bool] | None = None
    ) -> bool:
        """Whether ``patience`` rows that count have been recorded after :attr:`best`
        (:func:`~car_fl.results.selection.patience_spent`)."""
        since = self.since_best(counts)
        return since is not None and patience_spent(since, patience)

    def resume(self, history: list[RoundRow], initial: dict[str, float]) -> None:
        """Go on after ``history`` (rows read back), whose starting point had ``initial``."""
        self.history = history
        start = RoundRow(round=0, epochs=0, metrics=initial, seconds=0.0) if initial else None
        self.initial = start
        self.best = best_row(history, initial=start)

    def test_at_end(
        self,
        test: Callable[[dict[str, torch.Tensor]], dict[str, float]],
        final_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The test metrics of the state selected on validation and of the final state
        (``final_state``, else its round's checkpoint), for rows not tested in their round,
        written into their rows and checkpoints."""
        if not self.history:
            return
        best, final = self.best, self.history[-1]
        tested: dict[int, dict[str, float]] = {}
        for row in [best, final] if final is not best else [final]:
            if row is None or math.isfinite(row.metrics.get("test_top1", math.nan)):
                continue  # tested in its round
            state = final_state if row is final and final_state is not None else self.state_of(row)
            if row.round not in tested:
                tested[row.round] = test(state)
            row.metrics.update(tested[row.round])
            what = "selected on validation" if row is best else "final"
            log.info("%s %3d (%s) | %s", self.unit, row.round, what, brief(row.metrics))
            checkpoint = self.checkpoint(state, row, epsilon=row.epsilon)
            if row is best:
                save_checkpoint(self.checkpoints / "best", checkpoint)
            if self.round_checkpoints:
                save_checkpoint(self.checkpoints / f"round-{row.round:03d}", checkpoint)

    def state_of(self, row: RoundRow) -> dict[str, torch.Tensor]:
        """The trainable state of a recorded row: in memory, else from its checkpoint."""
        best = row is self.best
        if best and self.best_state is not None:
            return self.best_state
        if self.round_checkpoints:
            return load_checkpoint(self.checkpoints / f"round-{row.round:03d}").state
        if best:
            return load_checkpoint(self.checkpoints / "best").state
        raise RuntimeError(f"round {row.round}: its state was not kept (no round checkpoints)")

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

    def write(self, summary: RunSummary, *, plot: bool = True) -> None:
        """``metrics.json``, ``metrics.csv`` and (``plot``) ``curves.png``: at a run's end, and
        while it runs at most every :data:`PLOT_SECONDS` (a plot costs a few tenths of a
        second, more than a round of a small head)."""
        MetricsFile(history=self.history, summary=summary).write(self.output_dir)
        now = time.monotonic()
        recent = self.plotted_at is not None and now - self.plotted_at < PLOT_SECONDS
        if not plot or (recent and not summary.complete):
            return
        self.plotted_at = now
        plot_curves(
            self.output_dir,
            self.history,
            title=self.title,
            x_label=self.unit,
            num_labels=len(self.label_map),
            selected=self.best.round if self.best is not None else None,
        )
