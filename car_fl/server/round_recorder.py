"""The federation's ``evaluate_fn``: each round's statistics and evaluation, recorded.

The strategy hands :class:`RoundRecorder` each round's
:class:`~car_fl.server.round_stats.RoundStats` (:meth:`RoundRecorder.receive`); it turns them,
with the server's evaluation, into the round's row, client rows and ε, and gives them to the
run's :class:`~car_fl.results.recorder.Recorder`. The ε it reports is the server's own figure
(:class:`~car_fl.server.privacy_check.PrivacyCheck`), never a client's claim; a client whose
claim differs is flagged in the round's row, its ``clients.csv`` row, the summary and the log.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, MetricRecord

from car_fl.protocol.messages import from_record
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
    #: The releases received from each node, and the ε the server computes from them.
    privacy: PrivacyCheck = field(init=False)
    verdicts: dict[int, Verdict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.privacy = PrivacyCheck(self.recorder.settings)

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
        if server_round == 0:  # the starting point: a candidate for best, like any round
            self.initial = metrics
            start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=0.0)
            self.recorder.start(start, from_record(arrays), epsilon=0.0)
            return reply
        stats, self.pending = self.pending, None
        if stats is None or stats.round != server_round:
            raise RuntimeError(f"round {server_round}: the strategy handed over no statistics")
        row = self.row(stats, metrics)
        self.client_rows.extend(client_rows_of(stats, self.verdicts))
        note = f" | asked {', '.join(map(str, stats.asked))}"
        self.recorder.record(row, from_record(arrays), epsilon=row.epsilon, note=note)
        self.write(final=False)
        return reply

    def row(self, stats: RoundStats, metrics: dict[str, float]) -> RoundRow:
        """The round's row from the strategy's statistics and the server's evaluation."""
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
            seconds=time.perf_counter() - stats.started,
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
        steps = sum(r.count for r in self.privacy.releases.get(node, []))
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
