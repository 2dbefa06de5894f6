"""One recorder for a run's rounds (federated) or epochs (centralised).

:class:`Recorder` takes each evaluated :class:`~car_fl.results.RoundRow` and does the same for
both paths: one log line (:func:`round_line`), checkpoints (per round if asked, best on
validation, final), selection on validation (:mod:`car_fl.selection`), the metrics files and
the plot. :class:`RoundRecorder` is the federation's ``evaluate_fn``: the strategy hands it each
round's :class:`~car_fl.round_stats.RoundStats` (:meth:`RoundRecorder.receive`), and it turns
them, with the server's evaluation, into the round's row, client rows and ε.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import ArrayRecord, MetricRecord

from car_fl.checkpoint import Checkpoint, save_checkpoint
from car_fl.config import Settings
from car_fl.data.labels import LabelMap
from car_fl.plots import plot_curves
from car_fl.records import from_record
from car_fl.results import (
    CLIENTS_CSV,
    ClientDP,
    ClientRow,
    MetricsFile,
    RoundRow,
    RunSummary,
    wire_key,
)
from car_fl.round_stats import RoundStats
from car_fl.selection import is_better, select_best

log = logging.getLogger(__name__)


def round_line(row: RoundRow, *, unit: str = "round") -> str:
    """The fixed-format log line of one round (or epoch)."""
    m = row.metrics
    val = f"val loss {m['val_loss']:.4f} top1 {m['val_top1']:.4f} | " if "val_top1" in m else ""
    train_loss = row.train_loss if row.train_loss is not None else float("nan")
    train_acc = row.train_accuracy if row.train_accuracy is not None else float("nan")
    return (
        f"{unit} {row.round:>3d} | train loss {train_loss:.4f} acc {train_acc:.4f} | {val}"
        f"test loss {m['test_loss']:.4f} top1 {m['test_top1']:.4f} | {row.seconds:.1f}s | "
        f"sent {row.bytes_sent:,} B recv {row.bytes_received:,} B"
        + (f" | ε {row.epsilon:.4g}" if row.dp_active else "")
    )


def best_row(rows: list[RoundRow]) -> RoundRow | None:
    """The row selection keeps when the rows arrive in order (on validation)."""
    return select_best(rows, scores=lambda row: row.metrics)


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
        )

    def save_final(
        self,
        state: dict[str, torch.Tensor],
        *,
        round: int | None = None,
        epsilon: float | None = None,
    ) -> None:
        """``checkpoints/final``: ``state`` with the last row's metrics."""
        checkpoint = self.checkpoint(state, self.history[-1], round=round, epsilon=epsilon)
        save_checkpoint(self.checkpoints / "final", checkpoint)

    def write(self, summary: RunSummary) -> None:
        """``metrics.json``, ``metrics.csv`` and ``curves.png``."""
        MetricsFile(history=self.history, summary=summary).write(self.output_dir)
        plot_curves(self.output_dir, self.history, title=self.title, x_label=self.unit)


@dataclass
class RoundRecorder:
    """``evaluate_fn`` for ``Strategy.start``: after each round, evaluate, record, write files."""

    recorder: Recorder
    #: The server's evaluation of a global model: ``val_*`` and ``test_*`` metrics.
    evaluate: Callable[[ArrayRecord], dict[str, float]]
    #: What the summary says of the run beyond its rows (clients, data, selection, ...).
    describe: Callable[[], RunSummary]
    client_rows: list[ClientRow] = field(default_factory=list)
    client_epsilon: dict[int, float] = field(default_factory=dict)
    #: Record-level DP (dp=record): each client's σ, q, steps and ε, by partition id.
    client_dp: dict[int, ClientDP] = field(default_factory=dict)
    last_epsilon: float = 0.0
    initial: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    round_offset: int = 0
    #: The strategy's statistics of the round that just ended (see :meth:`receive`).
    pending: RoundStats | None = None

    def receive(self, stats: RoundStats) -> None:
        """The strategy hands over each round's statistics (aggregated or not) before evaluation."""
        self.pending = stats

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        metrics = self.evaluate(arrays)
        reply = MetricRecord({k: float(v) for k, v in metrics.items()})
        if server_round == 0 and self.round_offset:
            log.info(
                "resumed after round %d: test loss %.4f top1 %.4f",
                self.round_offset,
                metrics["test_loss"],
                metrics["test_top1"],
            )
            return reply
        server_round += self.round_offset
        if server_round == 0:
            self.initial = metrics
            log.info(
                "round   0 | initial global model: test loss %.4f top1 %.4f",
                metrics["test_loss"],
                metrics["test_top1"],
            )
            return reply
        stats, self.pending = self.pending, None
        if stats is None or stats.round != server_round:
            raise RuntimeError(f"round {server_round}: the strategy handed over no statistics")
        row = self.row(stats, metrics)
        self.client_rows.extend(ClientRow.from_stats(stats))
        note = f" | asked {', '.join(map(str, stats.asked))}"
        self.recorder.record(row, from_record(arrays), epsilon=row.epsilon, note=note)
        self.write(final=False)
        return reply

    def row(self, stats: RoundStats, metrics: dict[str, float]) -> RoundRow:
        """The round's row from the strategy's statistics and the server's evaluation."""
        replies = stats.client_metrics.values()
        return RoundRow(
            round=stats.round,
            epochs=stats.round * self.recorder.settings.fl.local_epochs,
            train_loss=stats.weighted(wire_key("train_loss")),
            train_accuracy=stats.weighted(wire_key("train_accuracy")),
            metrics=metrics,
            seconds=time.perf_counter() - stats.started,
            bytes_sent=sum(stats.bytes_sent.values()),
            bytes_received=sum(stats.bytes_received.values()),
            bytes_sent_per_client=max(stats.bytes_sent.values(), default=0),
            clients_asked=len(stats.asked),
            clients_ok=len(stats.client_metrics),
            clients_rejected=len(stats.rejected),
            clients_failed=len(stats.failed),
            skipped=int(not stats.aggregated),
            dp_active=int(any(m.get(wire_key("dp_active")) for m in replies)),
            epsilon=self.epsilon(stats),
            max_client_train_seconds=max(
                (m.get(wire_key("train_seconds"), 0.0) for m in replies), default=0.0
            ),
        )

    def epsilon(self, stats: RoundStats) -> float:
        """Max over clients of the ε they report; clients that did not reply keep theirs."""
        for node, metrics in stats.client_metrics.items():
            if wire_key("dp_epsilon") in metrics:
                self.client_epsilon[node] = metrics[wire_key("dp_epsilon")]
            dp = ClientDP.from_wire(metrics)
            if dp is not None:  # record-level DP, by partition (a non-finite claim: by node)
                claimed = metrics.get(wire_key("partition_id"), float(node))
                self.client_dp[int(claimed) if math.isfinite(claimed) else node] = dp
        self.last_epsilon = max(self.client_epsilon.values(), default=0.0)
        return self.last_epsilon

    def resume(
        self,
        history: list[RoundRow],
        client_rows: list[ClientRow],
        initial: dict[str, float],
        done: int,
    ) -> None:
        """Continue after round ``done`` of a run whose rows were read back."""
        self.recorder.history, self.client_rows, self.initial = history, client_rows, initial
        self.recorder.best = best_row(history)
        self.last_epsilon = max((row.epsilon or 0.0 for row in history), default=0.0)
        self.round_offset = done

    def summary(self, *, final: bool) -> RunSummary:
        history = self.recorder.history
        summary = self.describe()
        summary.initial = self.initial
        summary.final = history[-1] if history else None
        summary.best = self.recorder.best
        summary.total_seconds = time.perf_counter() - self.started
        summary.skipped_rounds = [row.round for row in history if row.skipped]
        summary.epsilon = self.last_epsilon
        summary.dp_clients = dict(self.client_dp)
        summary.complete = final
        return summary

    def write(self, *, final: bool) -> None:
        """The metrics files, ``clients.csv`` and the plot, as they stand."""
        self.recorder.write(self.summary(final=final))
        ClientRow.write_csv(self.recorder.output_dir / CLIENTS_CSV, self.client_rows)
