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

Longer than 300 lines because it records a round for every concern of the server (evaluation,
privacy verdicts, resume, checkpoints); splitting it is issue 42's open part.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, MetricRecord

from car_fl.protocol.messages import from_record
from car_fl.results.checkpoint import load_checkpoint, save_checkpoint
from car_fl.results.recorder import Recorder, best_row
from car_fl.results.rows import CLIENTS_CSV, ClientDP, ClientRow, RoundRow, RunSummary, wire_key
from car_fl.server.privacy_check import PrivacyCheck, Verdict
from car_fl.server.round_stats import RoundStats
from car_fl.settings.dp_plan import dp_active, record_plan
from car_fl.settings.schema import DPMode

log = logging.getLogger(__name__)


def client_rows_of(
    stats: RoundStats, verdicts: dict[int, Verdict] | None = None
) -> list[ClientRow]:
    """One row per client the round involved, in node order, with the server's ε verdicts."""
    verdicts = verdicts or {}
    rows = []
    nodes = sorted({*stats.bytes_sent, *stats.client_metrics, *stats.rejected, *stats.failed})
    for node in nodes:
        # a reply the norm bound rejected keeps its metrics: its n is part of the server's ε
        metrics = stats.client_metrics.get(node) or stats.released.get(node, {})
        if node in stats.client_metrics:
            status = "ok"
        else:
            status = "rejected" if node in stats.rejected else "failed"
        rows.append(
            ClientRow(
                round=stats.round,
                node=node,
                status=status,
                reason=stats.rejected.get(node) or stats.failed.get(node) or "",
                bytes_sent=stats.bytes_sent.get(node, 0),
                bytes_received=stats.bytes_received.get(node, 0),
                update_norm=stats.update_norms.get(node),
                **{name: metrics.get(wire_key(name)) for name in ClientRow.FROM_WIRE},
                server_epsilon=verdicts[node].epsilon if node in verdicts else None,
                claim_mismatch=verdicts[node].mismatch if node in verdicts else "",
            )
        )
    return rows


def brief(metrics: dict[str, float]) -> str:
    """``val``/``test`` loss and top-1 of a row's metrics, those that were evaluated."""
    parts = [
        f"{split} loss {metrics[f'{split}_loss']:.4f} top1 {metrics[f'{split}_top1']:.4f}"
        for split in ("val", "test")
        if math.isfinite(metrics.get(f"{split}_top1", math.nan))
    ]
    return ", ".join(parts) or "not evaluated"


@dataclass
class Evaluation:
    """One global state waiting to be evaluated and recorded."""

    round: int  # the run's round (after a resume's offset); 0: the initial state
    arrays: ArrayRecord
    stats: RoundStats | None  # None for round 0
    #: The round's wall seconds when its evaluation does not count (background), else None.
    seconds: float | None = None
    future: Future[None] | None = None


@dataclass
class RoundRecorder:
    """``evaluate_fn`` for ``Strategy.start``: after each round, evaluate, record, write files."""

    recorder: Recorder
    #: The server's evaluation of a global model: ``val_*`` and ``test_*`` metrics.
    evaluate: Callable[[ArrayRecord], dict[str, float]]
    #: What the summary says of the run beyond its rows (clients, data, selection, ...).
    describe: Callable[[], RunSummary]
    client_rows: list[ClientRow] = field(default_factory=list)
    #: The server's ε of each node (by node id) after its last reply.
    client_epsilon: dict[int, float] = field(default_factory=dict)
    #: Record-level DP (dp=record): each client's σ, q, steps and ε, by partition id, as the
    #: server computes them.
    client_dp: dict[int, ClientDP] = field(default_factory=dict)
    #: Which node's row each partition id's key holds (the first node to claim it).
    dp_owner: dict[int, int] = field(default_factory=dict)
    #: Nodes whose ε claim differed from the server's figure in some round.
    flagged: set[int] = field(default_factory=set)
    last_epsilon: float = 0.0
    initial: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    round_offset: int = 0
    #: The strategy's statistics of the round that just ended (see :meth:`receive`).
    pending: RoundStats | None = None
    #: Test metrics of a trainable state, evaluated at the end for the selected and the
    #: final state; None: every round's ``evaluate`` already has them.
    test: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None
    #: Evaluate round r in a thread while round r + 1 trains.
    background: bool = False
    #: The evaluation running in the background, recorded at the next call or at the end.
    running: Evaluation | None = None
    #: The trainable state of :attr:`recorder`'s best row (for its test metrics at the end).
    best_state: dict[str, torch.Tensor] | None = None
    executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    #: The releases received from each node, and the ε the server computes from them.
    privacy: PrivacyCheck = field(init=False)
    verdicts: dict[int, Verdict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.privacy = PrivacyCheck(self.recorder.settings)

    def receive(self, stats: RoundStats) -> None:
        """The strategy hands over each round's statistics (aggregated or not) before evaluation."""
        self.pending = stats

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        self.flush()  # the previous round's evaluation, done while this round trained
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
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        if stats is not None:  # the round's own time: its evaluation runs during the next
            job.seconds = time.perf_counter() - stats.started
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="car-fl-evaluation")
        # the evaluation and the round's files (log line, metrics, plot, checkpoints) both
        # in the thread; the next call waits for them before it touches the recorder again
        job.future = self.executor.submit(lambda: self.complete(job, self.evaluate(arrays)))
        self.running = job
        return None  # Flower's result holds no server metrics: car-fl's files do

    def flush(self) -> None:
        """Wait for the evaluation running in the background, and its recording, if any (an
        error in either is raised here)."""
        job, self.running = self.running, None
        if job is not None:
            assert job.future is not None
            job.future.result()

    def complete(self, job: Evaluation, metrics: dict[str, float]) -> None:
        """Record an evaluated state: round 0's metrics, or the round's row and files."""
        if job.stats is None:
            if job.round == 0:  # the starting point: a candidate for best, like any round
                self.initial = metrics
                start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=0.0)
                state = from_record(job.arrays)
                self.recorder.start(start, state, epsilon=0.0)
                if self.recorder.best is start:
                    self.best_state = state
            else:
                log.info("resumed after round %d: %s", job.round, brief(metrics))
            return
        row = self.row(job.stats, metrics, seconds=job.seconds)
        self.client_rows.extend(client_rows_of(job.stats, self.verdicts))
        note = f" | asked {', '.join(map(str, job.stats.asked))}"
        state = from_record(job.arrays)
        self.recorder.record(row, state, epsilon=row.epsilon, note=note)
        if self.recorder.best is row:
            self.best_state = state
        self.write(final=False)

    def finish(self, final_state: dict[str, torch.Tensor] | None = None) -> None:
        """After the last round: record what is still being evaluated, then (with ``test``)
        the test metrics of the state selected on validation and of the final state
        (``final_state``, else its round's checkpoint), written into their rows and
        checkpoints."""
        self.flush()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        history = self.recorder.history
        if self.test is None or not history:
            return
        best, final = self.recorder.best, history[-1]
        tested: dict[int, dict[str, float]] = {}
        for row in [best, final] if final is not best else [final]:
            if row is None:
                continue
            if math.isfinite(row.metrics.get("test_top1", math.nan)):
                continue  # tested in its round
            state = final_state if row is final and final_state is not None else self.state_of(row)
            if row.round not in tested:
                tested[row.round] = self.test(state)
            row.metrics.update(tested[row.round])
            what = "selected on validation" if row is best else "final"
            log.info("round %3d (%s) | %s", row.round, what, brief(row.metrics))
            checkpoint = self.recorder.checkpoint(state, row, epsilon=row.epsilon)
            if row is best:
                save_checkpoint(self.recorder.checkpoints / "best", checkpoint)
            if self.recorder.round_checkpoints:
                save_checkpoint(self.recorder.checkpoints / f"round-{row.round:03d}", checkpoint)

    def state_of(self, row: RoundRow) -> dict[str, torch.Tensor]:
        """The trainable state of a recorded row: in memory, else from its checkpoint."""
        best = row is self.recorder.best
        if best and self.best_state is not None:
            return self.best_state
        if self.recorder.round_checkpoints:
            return load_checkpoint(self.recorder.checkpoints / f"round-{row.round:03d}").state
        if best:
            return load_checkpoint(self.recorder.checkpoints / "best").state
        raise RuntimeError(f"round {row.round}: its state was not kept (no round checkpoints)")

    def row(
        self, stats: RoundStats, metrics: dict[str, float], *, seconds: float | None = None
    ) -> RoundRow:
        """The round's row from the strategy's statistics and the server's evaluation;
        ``seconds``: the round's wall time (default: until now)."""
        replies = stats.client_metrics.values()
        epsilon = self.epsilon(stats)  # the server's figure, and this round's verdicts
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
            claims_flagged=sum(1 for v in self.verdicts.values() if v.mismatch),
            max_client_train_seconds=max(
                (m.get(wire_key("train_seconds"), 0.0) for m in replies), default=0.0
            ),
        )

    def epsilon(self, stats: RoundStats) -> float:
        """Max over nodes of the server's ε; nodes that did not reply keep theirs.

        Every well-formed reply counts, also one the update-norm bound rejected: the server saw
        its update (a rejection must not leave an honest client flagged later for claiming the
        release it made).

        Each reply's claim is checked against the server's figure (:attr:`verdicts`); a node
        whose claim differs is flagged and logged, and its claim is used nowhere.
        """
        self.verdicts = {}
        for node, metrics in sorted(stats.released.items()):  # rejected replies too: seen
            verdict = self.privacy.receive(stats.round, node, metrics)
            self.verdicts[node] = verdict
            self.client_epsilon[node] = verdict.epsilon
            if verdict.mismatch:
                self.flagged.add(node)
                log.warning(
                    "round %d: node %d's privacy claim is flagged: %s (the report uses the "
                    "server's ε %.4g)",
                    stats.round,
                    node,
                    verdict.mismatch,
                    verdict.epsilon,
                )
            if self.recorder.settings.dp.mode is DPMode.RECORD:  # by partition id (or node)
                claimed = metrics.get(wire_key("partition_id"), float(node))
                place = int(claimed) if math.isfinite(claimed) else node
                self.client_dp[self.dp_key(place, node)] = self.record_dp(node, verdict)
        self.last_epsilon = max(self.client_epsilon.values(), default=0.0)
        return self.last_epsilon

    def dp_key(self, place: int, node: int) -> int:
        """The key of ``node``'s record-level row: the partition id it claims, unless another
        node claimed that partition first (then its node id: a node cannot overwrite the row
        of another by claiming its partition)."""
        owner = self.dp_owner.setdefault(place, node)
        return place if owner == node else node

    def record_dp(self, node: int, verdict: Verdict) -> ClientDP:
        """A node's record-level DP as the server computes it: the plan it sent, the steps
        of the replies it received, their ε."""
        plan = record_plan(self.recorder.settings)
        accountant = self.privacy.accountants.get(node)
        steps = len(accountant) if accountant is not None else 0
        return ClientDP(
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            steps=float(steps),
            epsilon=verdict.epsilon,
        )

    def resume(
        self,
        history: list[RoundRow],
        client_rows: list[ClientRow],
        initial: dict[str, float],
        done: int,
    ) -> None:
        """Continue after round ``done`` of a run whose rows were read back."""
        self.recorder.history, self.client_rows, self.initial = history, client_rows, initial
        self.flagged = {row.node for row in client_rows if row.claim_mismatch}
        # The releases the server saw before the resume count in its ε after it, too
        for row in client_rows:
            if row.round > done or row.server_epsilon is None or row.num_examples is None:
                continue  # not a release the server saw (or a file from before the check)
            # clients.csv keeps no bound: a per-step run resumes with fl.max_examples_per_client
            # as the bound, or ε = ∞ without it (never the node's claim)
            seen = {wire_key("num_examples"): float(row.num_examples)}
            verdict = self.privacy.receive(row.round, row.node, seen)
            self.client_epsilon[row.node] = verdict.epsilon
            if self.recorder.settings.dp.mode is DPMode.RECORD:
                place = row.partition_id if row.partition_id is not None else row.node
                self.client_dp[self.dp_key(int(place), row.node)] = self.record_dp(
                    row.node, verdict
                )
        start = RoundRow(round=0, epochs=0, metrics=initial, seconds=0.0) if initial else None
        self.recorder.initial = start
        self.recorder.best = best_row(history, initial=start)
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
        summary.flagged_clients = sorted(self.flagged)
        summary.dp_clients = dict(self.client_dp)
        summary.complete = final
        return summary

    def write(self, *, final: bool) -> None:
        """The metrics files, ``clients.csv`` and the plot, as they stand."""
        self.recorder.write(self.summary(final=final))
        ClientRow.write_csv(self.recorder.output_dir / CLIENTS_CSV, self.client_rows)
