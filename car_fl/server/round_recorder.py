"""The federation's ``evaluate_fn``: each round's statistics and evaluation, given to its Run.

The ε reported is the server's own (:class:`~car_fl.server.privacy_check.PrivacyCheck`), never
a client's claim. With ``background`` a round's evaluation runs in a thread while the next
round trains (:class:`EvaluationScheduler`), except when it alone decides the patience. A run
the patience ends raises :class:`PatienceSpent` out of ``Strategy.start``.

The server's evaluation of the global model (:class:`ServerEvaluator`), which holds
validation and test: every round's global model on validation (selection), and on test every
round or once at the end (:class:`EvalPlan`). Clients never evaluate: selection rests on the
server's own figures.
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

from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.experts import MixtureHead
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.protocol.messages import from_record
from car_fl.results.rows import RoundRow, RunSummary, wire_key
from car_fl.results.run import ResumePoint, Run, brief, eval_row
from car_fl.server.privacy_check import PrivacyCheck, client_rows_of
from car_fl.server.strategy import RoundStats
from car_fl.settings.dp_plan import dp_active
from car_fl.settings.schema import Mode, Settings
from car_fl.training.probe import probe_round
from car_fl.training.train import HeldOut, LazyRetriever


@dataclass(frozen=True)
class EvalPlan:
    """What the server evaluates when, from ``eval.*`` (null: by mode)."""

    #: Test metrics every round; else once at the end, for the final and the selected state.
    test_every_round: bool
    #: Validation examples evaluated each round (0: all).
    val_sample: int
    #: Round r's evaluation runs while round r + 1 trains.
    background: bool

    @classmethod
    def of(cls, settings: Settings) -> EvalPlan:
        cheap = settings.train.mode is Mode.CLASSIFIER  # cached features: a head's pass
        test, background = settings.eval.test_every_round, settings.eval.background
        return cls(
            test_every_round=cheap if test is None else test,
            val_sample=settings.eval.val_sample,
            background=(not cheap) if background is None else background,
        )


@dataclass
class ServerEvaluator:
    """The global model's evaluation on the server, which holds validation and test."""

    settings: Settings
    label_map: LabelMap
    held_out: HeldOut
    model: CaRRetriever
    #: Examples in each client's shard of this run (partition id → count), the reply cap.
    shard_sizes: dict[int, int] = field(default_factory=dict)
    #: Split sizes and the duplicates removed before splitting.
    data_stats: dict[str, int] = field(default_factory=dict)
    #: What is evaluated each round (exact, every round, by default).
    plan: EvalPlan = EvalPlan(test_every_round=True, val_sample=0, background=False)
    #: The validation each round is evaluated on (``held_out``'s, or its seeded sample).
    per_round: HeldOut | None = None

    def __post_init__(self) -> None:
        if self.per_round is None:
            self.per_round = self.held_out.sample_validation(
                self.plan.val_sample, seed=self.settings.seed
            )

    @classmethod
    def build(cls, settings: Settings) -> ServerEvaluator:
        splits = load_splits(settings.dataset, seed=settings.seed)
        lazy = LazyRetriever(settings, splits)
        held_out = HeldOut.prepare(settings, splits, get_model=lazy, desc="server ")
        if lazy.model is not None:
            model = lazy.model
        else:  # classifier mode with cached test features: no encoder needed on the server
            assert held_out.test.features is not None
            model = build_retriever(
                settings,
                len(splits.label_map),
                hidden_size=int(held_out.test.features.shape[1]),
                documents=lazy.documents,
            )
        shard_sizes = {
            pid: len(
                partition(
                    splits.train,
                    partition_id=pid,
                    num_partitions=settings.fl.clients,
                    scheme=settings.fl.partitioning,
                    alpha=settings.fl.alpha,
                    seed=settings.seed,
                )
            )
            for pid in range(settings.fl.clients)
        }
        return cls(
            settings=settings,
            label_map=splits.label_map,
            held_out=held_out,
            model=model,
            shard_sizes=shard_sizes,
            data_stats=splits.stats,
            plan=EvalPlan.of(settings),
        )

    @property
    def layout(self) -> ExpertLayout | None:
        """The mixture of experts' layout (the server's clustering), sent to every client."""
        head = self.model.head
        return head.layout if isinstance(head, MixtureHead) else None

    @property
    def tests_every_round(self) -> bool:
        """Whether each round has test metrics (always without a validation split)."""
        return self.plan.test_every_round or self.held_out.validation is None

    @property
    def selection(self) -> str:
        """How the best state is chosen (the summary's ``selection``)."""
        held = self.per_round
        assert held is not None
        if held.validation is None or held.validation is self.held_out.validation:
            return self.held_out.selection
        whole = len(self.held_out.validation or [])
        return f"validation sample ({len(held.validation)} of {whole})"

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        """One round's metrics of the global model ``arrays``: ``val_*`` (on the sample, if
        one is set) and ``test_*``, which are NaN when the test set waits for the end."""
        self.model.load_trainable_state_dict(from_record(arrays))
        held = self.per_round
        assert held is not None
        if self.tests_every_round:
            return held.evaluate(self.model, self.settings)
        validation = held.metrics_on(held.validation, self.model, self.settings)
        assert validation is not None
        later = {name: math.nan for name in validation}  # the same metrics, on test, later
        return eval_row(validation, later)

    def test(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """``test_*`` metrics of the trainable ``state`` (the whole test split)."""
        self.model.load_trainable_state_dict(state)
        return eval_row(None, self.held_out.on_test(self.model, self.settings))


log = logging.getLogger(__name__)


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
class EvaluationScheduler:
    """Runs each round's evaluation and recording, now or in the background."""

    #: Evaluate round r in a thread while round r + 1 trains.
    background: bool = False
    #: The evaluation running in the background, recorded at the next call or at the end.
    running: Evaluation | None = None
    executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    def run(self, job: Evaluation, work: Callable[[], None]) -> None:
        """``work`` (evaluate ``job`` and record it) now, or in the thread with ``background``."""
        if not self.background:
            work()
            return
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="car-fl-evaluation")
        job.future = self.executor.submit(work)
        self.running = job

    def flush(self) -> None:
        """Wait for the background evaluation and its recording, if any (raising their error)."""
        job, self.running = self.running, None
        if job is not None:
            assert job.future is not None
            job.future.result()

    def close(self) -> None:
        """Wait for what is running, then end the thread."""
        self.flush()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


class PatienceSpent(Exception):
    """``train.patience`` rounds without a better one on validation: the run ends after round
    ``round``, whose global model is ``arrays`` (raised out of ``Strategy.start``)."""

    def __init__(self, round: int, arrays: ArrayRecord) -> None:
        super().__init__(f"train.patience ran out after round {round}")
        self.round, self.arrays = round, arrays


@dataclass
class RoundRecorder:
    """``evaluate_fn`` for ``Strategy.start``: after each round, evaluate, record, write files."""

    run: Run
    #: The server's evaluation of a global model: ``val_*`` and ``test_*`` metrics.
    evaluate: Callable[[ArrayRecord], dict[str, float]]
    #: Rounds done before a resume: Flower counts from 1 again, the run's rows go on.
    round_offset: int = 0
    #: The strategy's statistics of the round that just ended (see :meth:`receive`).
    pending: RoundStats | None = None
    #: Test metrics of a state, evaluated at the end (None: every round already has them).
    test: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None
    #: Evaluate round r in a thread while round r + 1 trains.
    background: bool = False
    schedule: EvaluationScheduler = field(init=False)
    #: The releases received from each node, and the ε the server computes from them.
    privacy: PrivacyCheck = field(init=False)

    def __post_init__(self) -> None:
        settings = self.run.settings
        self.privacy = PrivacyCheck(settings)
        self.schedule = EvaluationScheduler(background=self.background)
        self.run.counts = lambda row: not row.skipped and not probe_round(settings, row.round)
        describe = self.run.describe
        assert describe is not None

        def with_privacy() -> RunSummary:
            summary = describe()
            self.privacy.summarise(summary)
            return summary

        self.run.describe = with_privacy
        if self.run.client_rows is None:
            self.run.client_rows = []

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
            self.stop_if_stalled(job)
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        if stats is not None:  # the round's own time: its evaluation runs during the next
            job.seconds = time.perf_counter() - stats.started
        # the evaluation and the round's files (log line, metrics, plot, checkpoints) both
        # in the thread; the next call waits for them before it touches the run again
        # read before the thread starts: it appends to the run's rows
        decides = self.run.stalled() is not None or self.decides_patience(job)
        self.schedule.run(job, lambda: self.complete(job, self.evaluate(arrays)))
        if decides:
            self.schedule.flush()  # its validation alone decides whether the run goes on
            self.stop_if_stalled(job)  # this round trained: it is evaluated all the same
        return None  # Flower's result holds no server metrics: car-fl's files do

    def decides_patience(self, job: Evaluation) -> bool:
        """Whether ``job``'s round, not yet evaluated, spends the patience unless it beats the
        best round: it trained and counts, and one more counted round stalls the run."""
        if job.stats is None or not job.stats.aggregated:
            return False
        if probe_round(self.run.settings, job.round):
            return False
        return self.run.stalled(ahead=1) is not None

    def stop_if_stalled(self, job: Evaluation) -> None:
        """End the run after ``job``'s round (:class:`PatienceSpent`) when its patience is spent."""
        if self.run.stop_if_stalled(job.round):
            raise PatienceSpent(job.round, job.arrays)

    def complete(self, job: Evaluation, metrics: dict[str, float]) -> None:
        """Record an evaluated state: round 0's metrics, or the round's row and files."""
        if job.stats is None:
            if job.round == 0:  # the starting point: a candidate for best, like any round
                start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=0.0)
                self.run.start(start, from_record(job.arrays), epsilon=0.0)
            else:
                log.info("resumed after round %d: %s", job.round, brief(metrics))
            return
        row = self.row(job.stats, metrics, seconds=job.seconds)
        assert self.run.client_rows is not None
        self.run.client_rows.extend(client_rows_of(job.stats, self.privacy.verdicts))
        note = f" | asked {', '.join(map(str, job.stats.asked))}"
        self.run.record(row, from_record(job.arrays), epsilon=row.epsilon, note=note)

    def close(self, final_state: dict[str, torch.Tensor], *, round: int) -> RunSummary:
        """The run's end: what is still evaluated, the test split of the selected and final
        state (with ``test``), the final checkpoint with the server's ε, the files."""
        self.schedule.close()
        return self.run.end(
            final_state, round=round, epsilon=self.privacy.last_epsilon, test=self.test
        )

    def row(
        self, stats: RoundStats, metrics: dict[str, float], *, seconds: float | None = None
    ) -> RoundRow:
        """The round's row from the strategy's statistics and the server's evaluation."""
        settings = self.run.settings
        replies = stats.client_metrics.values()
        epsilon = self.privacy.round(stats)  # the server's figure, and this round's verdicts
        private = dp_active(settings, stats.round)
        # Under DP an honest client sends no train metric: one sent anyway is not used.
        return RoundRow(
            round=stats.round,
            epochs=stats.round * settings.fl.local_epochs,
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
            max_client_train_seconds=0.0
            if private
            else max((m.get(wire_key("train_seconds"), 0.0) for m in replies), default=0.0),
        )

    def resume(self, point: ResumePoint) -> None:
        """Continue after a stopped run's last complete round (rows read back by the Run)."""
        self.round_offset = point.done
        epsilon = max((row.epsilon or 0.0 for row in point.history), default=0.0)
        self.privacy.resume(point.client_rows, done=point.done, epsilon=epsilon)
