"""Server-side orchestration of a federated run: nodes, initial model, rounds, results.

:func:`run_federation` checks the node count, builds the initial state (as a centralised run),
runs the strategy for ``fl.rounds`` rounds (fewer with ``train.patience``) and evaluates and
records every round.

Its ``evaluate_fn`` (:class:`RoundRecorder`) gives each round's statistics and evaluation to the
run's :class:`~car_fl.results.run.Run`. The ε reported is the server's own
(:class:`~car_fl.server.privacy_check.PrivacyCheck`), never a client's claim. With
``background`` a round's evaluation runs in a thread while the next round trains
(:class:`EvaluationScheduler`), except when it alone decides the patience. A run the patience
ends raises :class:`PatienceSpent` out of ``Strategy.start``.

The server's evaluation of the global model (:class:`ServerEvaluator`) holds validation and
test: every round's global model on validation (selection), and on test every round or once at
the end (:class:`EvalPlan`). Clients never evaluate: selection rests on the server's own
figures.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.experts import MixtureHead
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.model.sources import check_sources, hub_commit, is_hub_id
from car_fl.protocol.messages import COMMIT_KEY, LAYOUT_KEY, from_record, to_record
from car_fl.results.plots import data_label, model_label
from car_fl.results.rows import RoundRow, RunSummary, wire_key
from car_fl.results.run import FEDERATED, ResumePoint, Run, brief, eval_row, open_run_dir
from car_fl.server.failure_summary import failure_summary
from car_fl.server.privacy_check import PrivacyCheck, client_rows_of
from car_fl.server.simulation_exit import end_ray_on_exit
from car_fl.server.strategy import GuardedStrategy, RoundStats, spec_of
from car_fl.serving.checkpoint import checkpoint_extra
from car_fl.settings.compose import fingerprint, settings_from_yaml
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import dp_active
from car_fl.settings.schema import Mode, Settings, federation_refusal
from car_fl.training.train import HeldOut, LazyRetriever, probe_round


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
    #: What the strategy saw in each round of this process, the last one ended (its history).
    rounds: list[RoundStats] = field(default_factory=list)
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

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        self.schedule.flush()  # the previous round's evaluation, done while this round trained
        stats = None
        if server_round > 0:  # Flower's round 0 is the initial (or the resumed) state
            expected = server_round + self.round_offset
            stats = self.rounds[-1] if self.rounds else None
            if stats is None or stats.round != expected:
                raise RuntimeError(f"round {expected}: the strategy recorded no statistics")
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


def is_simulation(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation engine (all its SuperNodes exist from the start)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def wait_for_nodes(
    grid: Grid,
    expected: int,
    *,
    timeout: float,
    poll: float = 0.5,
    simulation: bool = False,
) -> list[int]:
    """Wait until ``expected`` nodes are connected; fail clearly on too many or too few."""
    deadline = time.monotonic() + timeout
    seen = -1
    while True:
        nodes = sorted(grid.get_node_ids())
        if simulation and nodes and len(nodes) != expected and len(nodes) == seen:
            raise ValueError(
                f"this simulation runs {len(nodes)} SuperNodes but fl.clients={expected}: run "
                f"it with --federation-config 'num-supernodes={expected}' (car-fl run does "
                f"that for you), or set fl.clients={len(nodes)}"
            )
        if len(nodes) > expected and not simulation:
            raise ValueError(
                f"{len(nodes)} SuperNodes are connected but the run is configured for "
                f"fl.clients={expected}: set fl.clients={len(nodes)} (e.g. --run-config "
                f"'fl.clients={len(nodes)}') or run {expected} nodes"
            )
        if len(nodes) == expected:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"only {len(nodes)} of fl.clients={expected} SuperNodes connected within "
                f"{timeout:.0f}s (fl.wait_for_nodes); start the missing nodes or set "
                f"fl.clients={len(nodes)}"
            )
        seen = len(nodes)
        time.sleep(poll)


def run_federation(grid: Grid, settings: Settings) -> dict[str, Any]:
    """The whole federated run on the server side; returns the summary."""
    check_federable(settings)
    end_ray_on_exit()  # a stopped simulation leaves none of Ray's processes behind
    if settings.resume:
        check_noise_kept(Path(settings.resume), settings)
    output_dir, point = open_run_dir(settings, FEDERATED)
    check_sources(settings, where="on the server")  # the server evaluates: data and encoder
    simulation = is_simulation(grid)
    wait_for_nodes(
        grid, settings.fl.clients, timeout=settings.fl.wait_for_nodes, simulation=simulation
    )
    if simulation:
        log.info(
            "Flower's simulation starts Ray beside this ServerApp, and its %d ClientApps in "
            "Ray's workers: round 1's replies come once they are up and have loaded the "
            "encoder (tens of seconds on a 2-core machine)",
            settings.fl.clients,
        )
    evaluator = ServerEvaluator.build(settings)
    initial = to_record(evaluator.model.trainable_state_dict(), dtype=settings.comm.dtype)
    layout = evaluator.layout.to_text() if evaluator.layout is not None else None
    strategy = GuardedStrategy.for_run(
        settings, spec=spec_of(initial), shard_sizes=evaluator.shard_sizes, layout=layout
    )
    recorder = round_recorder(settings, evaluator, output_dir)
    recorder.run.begin(point, data=evaluator.data_stats)
    recorder.rounds = strategy.history  # each round's statistics, as the strategy saw it
    done = 0
    if point is not None:  # continue after the last complete round
        done = point.done
        initial = to_record(point.checkpoint.state, dtype=settings.comm.dtype)
        recorder.resume(point)
        strategy.round_offset = done
    if point is not None and (point.finished or recorder.run.stop_if_stalled(done)):
        final, last = initial, done  # every round ran (or the patience ran out): the end only
    else:
        try:
            result = strategy.start(
                grid=grid,
                initial_arrays=initial,
                num_rounds=settings.fl.rounds - done,
                timeout=settings.fl.round_timeout,
                train_config=train_config(settings, evaluator, layout),
                evaluate_fn=recorder,
            )
            final, last = result.arrays or initial, settings.fl.rounds
        except PatienceSpent as stop:
            final, last = stop.arrays, stop.round
    # what is still evaluated, the test split for the selected and final state, the files
    summary = recorder.close(from_record(final), round=last)
    check_outcome(summary, strategy, output_dir, rounds=last)
    return summary.to_dict()


def check_federable(settings: Settings) -> None:
    """Refuse, before any work, a run a federation cannot train (:func:`federation_refusal`)."""
    reason = federation_refusal(settings)
    if reason:
        raise ValueError(reason)


def check_noise_kept(run_dir: Path, settings: Settings) -> None:
    """Refuse a new ``fl.rounds`` that would change DP-SGD's σ (calibrated to the planned
    rounds): the rounds already run would be counted with the new σ."""
    config, mode = run_dir / "config.yaml", MODES[settings.dp.mode]
    if not mode.calibrated_to_rounds(settings) or not config.is_file():
        return  # σ does not follow fl.rounds, or not a run (refused next, by the resume)
    planned = settings_from_yaml(config.read_text("utf-8")).fl.rounds
    if planned == settings.fl.rounds:
        return
    before = mode.noise_floor(replace(settings, fl=replace(settings.fl, rounds=planned)))
    after = mode.noise_floor(settings)
    if before != after:
        raise ValueError(
            f"resume={run_dir}: under dp={settings.dp.mode} with dp.target_epsilon, σ is "
            f"calibrated to fl.rounds: {planned} rounds gave σ {before:.4g}, "
            f"fl.rounds={settings.fl.rounds} gives {after:.4g}, and the rounds "
            f"already run used the first; resume with fl.rounds={planned} (car-fl train: "
            f"train.epochs={planned}), or start a new run"
        )


def round_recorder(
    settings: Settings, evaluator: ServerEvaluator, output_dir: Path
) -> RoundRecorder:
    """The run's ``evaluate_fn``: its Run, the server's evaluation; in adapter mode by default
    the test split once at the end and each round's evaluation in the background while the
    next round trains (docs/performance.md)."""
    return RoundRecorder(
        Run(
            settings=settings,
            kind=FEDERATED,
            output_dir=output_dir,
            label_map=evaluator.label_map,
            title=(
                f"FL, {settings.fl.clients} clients, {data_label(settings.dataset)}, "
                f"{model_label(settings.model)}"
            ),
            describe=lambda: describe(settings, evaluator),
            extra=checkpoint_extra(settings, evaluator.label_map.names, evaluator.model),
        ),
        evaluate=evaluator,
        test=None if evaluator.tests_every_round else evaluator.test,
        background=evaluator.plan.background,
    )


def train_config(
    settings: Settings, evaluator: ServerEvaluator, layout: str | None
) -> ConfigRecord:
    """What every train message carries: the fingerprint, the label map, an MoE layout, and
    the commit a Hub model's revision resolved to here (read after the evaluator loaded it),
    which the nodes load, whatever their own cache's branch says."""
    commit = hub_commit(settings.model) if is_hub_id(settings.model.name_or_path) else None
    return ConfigRecord(
        {
            "fingerprint": fingerprint(settings),
            "labels": evaluator.label_map.to_list(),
            **({LAYOUT_KEY: layout} if layout is not None else {}),
            **({COMMIT_KEY: commit} if commit is not None else {}),
        }
    )


def check_outcome(
    summary: RunSummary, strategy: GuardedStrategy, output_dir: Path, *, rounds: int
) -> None:
    """Fail a run in which every round it ran failed, naming why per failure code."""
    if len(summary.skipped_rounds or []) == rounds:
        raise RuntimeError(
            f"every round failed: no client sent a valid update in {rounds} rounds: "
            f"{failure_summary(strategy.history)} (results: {output_dir})"
        )


def describe(settings: Settings, evaluator: ServerEvaluator) -> RunSummary:
    """The federated summary's fields that do not change from round to round."""
    return RunSummary(
        kind="federated",
        clients=settings.fl.clients,
        mode=settings.train.mode,
        head=settings.head.kind,
        num_labels=len(evaluator.label_map),
        rounds=settings.fl.rounds,
        local_epochs=settings.fl.local_epochs,
        final=None,
        best=None,
        total_seconds=0.0,
        test_examples=len(evaluator.held_out.test),
        selection=evaluator.selection,
        data=evaluator.data_stats,
        dp=settings.dp.mode,
        delta=settings.dp.delta,
    )
