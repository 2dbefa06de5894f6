"""The federation's ``evaluate_fn``: each round's statistics and evaluation, recorded.

The strategy hands :class:`RoundRecorder` each round's
:class:`~car_fl.server.round_stats.RoundStats` (:meth:`RoundRecorder.receive`); it turns them,
with the server's evaluation, into the round's row, client rows and ε, and gives them to the
run's :class:`~car_fl.results.recorder.Recorder`. The ε it reports is the server's own figure
(:class:`~car_fl.server.privacy_check.PrivacyCheck`), never a client's claim; a client whose
claim differs is flagged in the round's row, its ``clients.csv`` row, the summary and the log.

With ``background`` a round's evaluation and its recording (row, log line, files, checkpoints)
run in a thread while the next round trains; the next call (or :meth:`RoundRecorder.finish`)
waits for them before it touches the recorder.
With ``test`` the rows' test metrics wait for the end (NaN until then): :meth:`finish` evaluates
the test split for the state selected on validation and for the final state, and writes them
into those rows and their checkpoints.
With ``patience`` (``train.patience``) the run ends once that many rounds that trained (skipped
rounds do not count) have not improved on the round validation selects (:class:`PatienceSpent`).
With ``background`` too it ends after that round: when a round's validation alone decides
whether the patience is spent, the server waits for that evaluation before it starts the next
round (rather than train a round the run would then drop); every other round's evaluation
overlaps the next round's training. A resumed run that had stalled before it was interrupted
ends at once.

"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, MetricRecord

from car_fl.protocol.messages import from_record
from car_fl.results.recorder import Recorder, brief
from car_fl.results.rows import CLIENTS_CSV, ClientRow, RoundRow, RunSummary, wire_key
from car_fl.results.selection import patience_spent
from car_fl.server.evaluation_scheduler import Evaluation, EvaluationScheduler
from car_fl.server.privacy_check import PrivacyCheck, client_rows_of
from car_fl.server.round_stats import RoundStats
from car_fl.settings.dp_plan import dp_active
from car_fl.training.probe import probe_round

log = logging.getLogger(__name__)


class PatienceSpent(Exception):
    """``train.patience`` rounds without a better one on validation: the run ends after round
    ``round``, whose global model is ``arrays`` (raised out of ``Strategy.start``)."""

    def __init__(self, round: int, arrays: ArrayRecord) -> None:
        super().__init__(f"train.patience ran out after round {round}")
        self.round, self.arrays = round, arrays


@dataclass
class RoundRecorder:
    """``evaluate_fn`` for ``Strategy.start``: after each round, evaluate, record, write files.

    Three owners, one each: the run's :class:`~car_fl.results.recorder.Recorder` (rows, best,
    checkpoints, the end's tests), the server's :class:`~car_fl.server.privacy_check.PrivacyCheck`
    (ε, verdicts, flags, DP rows) and the :class:`EvaluationScheduler` (now or in a thread).
    """

    recorder: Recorder
    #: The server's evaluation of a global model: ``val_*`` and ``test_*`` metrics.
    evaluate: Callable[[ArrayRecord], dict[str, float]]
    #: What the summary says of the run beyond its rows (clients, data, selection, ...).
    describe: Callable[[], RunSummary]
    client_rows: list[ClientRow] = field(default_factory=list)
    initial: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    #: Rounds done before a resume: Flower counts from 1 again, the run's rows go on.
    round_offset: int = 0
    #: The strategy's statistics of the round that just ended (see :meth:`receive`).
    pending: RoundStats | None = None
    #: Test metrics of a trainable state, evaluated at the end for the selected and the
    #: final state; None: every round's ``evaluate`` already has them.
    test: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None
    #: Evaluate round r in a thread while round r + 1 trains.
    background: bool = False
    #: ``train.patience``: end the run after this many rounds without a better one.
    patience: int | None = None
    #: The round after which :attr:`patience` ended the run (None: it has not).
    stopped_early: int | None = None
    schedule: EvaluationScheduler = field(init=False)
    #: The releases received from each node, and the ε the server computes from them.
    privacy: PrivacyCheck = field(init=False)

    def __post_init__(self) -> None:
        self.privacy = PrivacyCheck(self.recorder.settings)
        self.schedule = EvaluationScheduler(background=self.background)

    def receive(self, stats: RoundStats) -> None:
        """The strategy hands over each round's statistics (aggregated or not) before evaluation."""
        self.pending = stats

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        self.schedule.flush()  # the previous round's evaluation, done while this round trained
        stats = None
        if server_round > 0:  # Flower's round 0 is the initial (or the resumed) state
            stats, self.pending = self.pending, None
            expected = server_round + self.round_offset
            if stats is None or stats.round != expected:
                raise RuntimeError(f"round {expected}: the strategy handed over no statistics")
        job = Evaluation(server_round + self.round_offset, arrays, stats)
        if not self.background:
            metrics = self.evaluate(arrays)
            self.complete(job, metrics)
            self.stop_if_stalled(job, self.stalled())
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        if stats is not None:  # the round's own time: its evaluation runs during the next
            job.seconds = time.perf_counter() - stats.started
        stalled = self.stalled()  # as of the rounds recorded: nothing runs in the thread now
        # the evaluation and the round's files (log line, metrics, plot, checkpoints) both
        # in the thread; the next call waits for them before it touches the recorder again
        self.schedule.run(job, lambda: self.complete(job, self.evaluate(arrays)))
        if stalled is None and self.decides_patience(job):
            self.schedule.flush()  # its validation alone decides whether the run goes on
            stalled = self.stalled()
        self.stop_if_stalled(job, stalled)  # this round trained: it is evaluated all the same
        return None  # Flower's result holds no server metrics: car-fl's files do

    def stalled(self) -> int | None:
        """The round validation selects as best, once :attr:`patience` rounds that trained
        (aggregated: a skipped round leaves the model as it was) have been recorded after it;
        None before. Without a validation split every round is "best": it never stalls. Probe
        rounds (``fl.probe_rounds``) do not count: the adapter gets its ``patience`` rounds to
        beat the probed head."""
        best = self.recorder.best
        if best is None or not self.recorder.stalled(self.patience, self.counts_row):
            return None
        return best.round

    def counts_row(self, row: RoundRow) -> bool:
        """Whether a recorded round spends the patience (:meth:`counts`)."""
        return self.counts(row.round, not row.skipped)

    def counts(self, round: int, trained: bool) -> bool:
        """Whether a round spends the patience: it trained (aggregated) and was no probe round."""
        return trained and not probe_round(self.recorder.settings, round)

    def decides_patience(self, job: Evaluation) -> bool:
        """Whether ``job``'s round, not yet evaluated, spends the patience unless it beats the
        best round: it trained and counts, and the rounds recorded since the best are one
        short of :attr:`patience`. Never the run's last round (nothing to stop)."""
        since = self.recorder.since_best(self.counts_row)
        if (
            since is None
            or job.stats is None
            or not self.counts(job.round, job.stats.aggregated)
            or job.round >= self.recorder.settings.fl.rounds
        ):
            return False
        return patience_spent(since + 1, self.patience)

    def stop_if_stalled(self, job: Evaluation, best: int | None) -> None:
        """End the run after ``job``'s round (:class:`PatienceSpent`) when it has stalled since
        round ``best``, unless that round is the run's last anyway (nothing to stop)."""
        if best is None or job.round >= self.recorder.settings.fl.rounds:
            return
        self.stopped_early = job.round
        log.info(
            "early stop after round %d: %d rounds have trained since the best on validation, "
            "round %d (train.patience)",
            job.round,
            self.patience,
            best,
        )
        raise PatienceSpent(job.round, job.arrays)

    def complete(self, job: Evaluation, metrics: dict[str, float]) -> None:
        """Record an evaluated state: round 0's metrics, or the round's row and files."""
        if job.stats is None:
            if job.round == 0:  # the starting point: a candidate for best, like any round
                self.initial = metrics
                start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=0.0)
                self.recorder.start(start, from_record(job.arrays), epsilon=0.0)
            else:
                log.info("resumed after round %d: %s", job.round, brief(metrics))
            return
        row = self.row(job.stats, metrics, seconds=job.seconds)
        self.client_rows.extend(client_rows_of(job.stats, self.privacy.verdicts))
        note = f" | asked {', '.join(map(str, job.stats.asked))}"
        self.recorder.record(row, from_record(job.arrays), epsilon=row.epsilon, note=note)
        self.write(final=False)

    def finish(self, final_state: dict[str, torch.Tensor] | None = None) -> None:
        """After the last round: record what is still being evaluated, then (with ``test``)
        the test metrics of the selected and the final state (:meth:`Recorder.test_at_end`)."""
        self.schedule.close()
        if self.test is not None:
            self.recorder.test_at_end(self.test, final_state)

    def close(self, final_state: dict[str, torch.Tensor], *, round: int) -> RunSummary:
        """The run's end: :meth:`finish`, the final checkpoint (``final_state`` as of
        ``round``, with the server's ε), the files; the summary."""
        self.finish(final_state)
        self.recorder.save_final(final_state, round=round, epsilon=self.privacy.last_epsilon)
        self.write(final=True)
        return self.summary(final=True)

    def row(
        self, stats: RoundStats, metrics: dict[str, float], *, seconds: float | None = None
    ) -> RoundRow:
        """The round's row from the strategy's statistics and the server's evaluation;
        ``seconds``: the round's wall time (default: until now)."""
        replies = stats.client_metrics.values()
        epsilon = self.privacy.round(stats)  # the server's figure, and this round's verdicts
        private = dp_active(self.recorder.settings, stats.round)
        # Under DP an honest client sends no train metric: one sent anyway is not used.
        return RoundRow(
            round=stats.round,
            epochs=stats.round * self.recorder.settings.fl.local_epochs,
            train_loss=math.nan if private else stats.weighted(wire_key("train_loss")),
            train_accuracy=math.nan if private else stats.weighted(wire_key("train_accuracy")),
            metrics=metrics,
            seconds=time.perf_counter() - stats.started if seconds is None else seconds,
            bytes_sent=sum(stats.bytes_sent.values()),
            bytes_received=sum(stats.bytes_received.values()),
            bytes_sent_per_client=max(stats.bytes_sent.values(), default=0),
            clients_asked=len(stats.asked),
            clients_ok=len(stats.client_metrics),
            clients_rejected=len(stats.rejected),
            clients_failed=len(stats.failed),
            skipped=int(not stats.aggregated),
            dp_active=int(bool(replies) and private),
            epsilon=epsilon,
            claims_flagged=sum(1 for v in self.privacy.verdicts.values() if v.mismatch),
            max_client_train_seconds=max(
                (m.get(wire_key("train_seconds"), 0.0) for m in replies), default=0.0
            ),
        )

    def resume(
        self,
        history: list[RoundRow],
        client_rows: list[ClientRow],
        initial: dict[str, float],
        done: int,
    ) -> None:
        """Continue after round ``done`` of a run whose rows were read back."""
        self.client_rows, self.initial, self.round_offset = client_rows, initial, done
        self.recorder.resume(history, initial)
        epsilon = max((row.epsilon or 0.0 for row in history), default=0.0)
        self.privacy.resume(client_rows, done=done, epsilon=epsilon)

    def summary(self, *, final: bool) -> RunSummary:
        history = self.recorder.history
        summary = self.describe()
        summary.initial = self.initial
        summary.final = history[-1] if history else None
        summary.best = self.recorder.best
        summary.total_seconds = time.perf_counter() - self.started
        summary.skipped_rounds = [row.round for row in history if row.skipped]
        summary.stopped_early = self.stopped_early
        self.privacy.summarise(summary)
        summary.complete = final
        return summary

    def write(self, *, final: bool) -> None:
        """The metrics files, ``clients.csv`` and the plot, as they stand."""
        self.recorder.write(self.summary(final=final))
        ClientRow.write_csv(self.recorder.output_dir / CLIENTS_CSV, self.client_rows)
