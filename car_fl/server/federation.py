"""Server-side orchestration of a federated run: nodes, initial model, rounds, results.

:func:`run_federation` checks the node count, builds the initial state (as a centralised run),
runs the strategy for ``fl.rounds`` rounds (fewer with ``train.patience``) and evaluates and
records every round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from car_fl.model.sources import check_sources, hub_commit, is_hub_id
from car_fl.protocol.messages import COMMIT_KEY, LAYOUT_KEY, from_record, to_record
from car_fl.results.plots import data_label, model_label
from car_fl.results.rows import RunSummary
from car_fl.results.run import FEDERATED, Run, open_run_dir
from car_fl.server.aggregation import build_strategy
from car_fl.server.failure_summary import failure_summary
from car_fl.server.round_recorder import PatienceSpent, RoundRecorder, ServerEvaluator
from car_fl.server.simulation_exit import end_ray_on_exit
from car_fl.server.strategy import GuardedStrategy, spec_of
from car_fl.serving.checkpoint import checkpoint_extra
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.flower import fingerprint
from car_fl.settings.schema import Settings, federation_refusal

log = logging.getLogger(__name__)


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
    strategy = build_strategy(
        settings, spec=spec_of(initial), shard_sizes=evaluator.shard_sizes, layout=layout
    )
    recorder = round_recorder(settings, evaluator, output_dir)
    recorder.run.begin(point, data=evaluator.data_stats)
    strategy.on_round = recorder.receive  # the strategy hands each round's statistics over
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
