"""Server-side orchestration of a federated run: nodes, initial model, rounds, results.

The ServerApp calls :func:`run_federation`. It checks that the number of connected nodes
matches ``fl.clients``, builds the initial trainable state (same seed and initialisation as a
centralised run), runs the configured strategy (:func:`~car_fl.aggregation.build_strategy`) for
``fl.rounds`` rounds and, after every round, evaluates the global model on the held-out split,
logs one line, and writes the metrics files, the plot and a checkpoint.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from car_fl.aggregation import build_strategy
from car_fl.centralized import round_line
from car_fl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from car_fl.config import (
    Settings,
    fingerprint,
    settings_from_yaml,
    settings_to_yaml,
    trains_nothing,
)
from car_fl.data import load_splits, partition
from car_fl.data.labels import LabelMap
from car_fl.features import LocalData, prepare_for
from car_fl.io import atomic_write_text
from car_fl.model import CaRRetriever, build_retriever
from car_fl.records import from_record, to_record
from car_fl.report import CLIENTS_CSV, plot_curves, write_csv, write_metrics
from car_fl.retrieval import label_documents
from car_fl.selection import eval_row, is_better, select_best
from car_fl.strategy import GuardedStrategy, RoundStats, spec_of
from car_fl.train import evaluate

log = logging.getLogger(__name__)


def wait_for_nodes(grid: Grid, expected: int, *, timeout: float, poll: float = 0.5) -> list[int]:
    """Wait until ``expected`` nodes are connected; fail clearly on too many or too few."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) > expected:
            raise ValueError(
                f"{len(nodes)} SuperNodes are connected but the run is configured for "
                f"fl.clients={expected}: set fl.clients={len(nodes)} (e.g. --run-config "
                f"'overrides=\"fl.clients={len(nodes)}\"') or run {expected} nodes "
                f"(simulation: --federation-config 'num-supernodes={expected}')"
            )
        if len(nodes) == expected:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"only {len(nodes)} of fl.clients={expected} SuperNodes connected within "
                f"{timeout:.0f}s (fl.wait_for_nodes); start the missing nodes or set "
                f"fl.clients={len(nodes)}"
            )
        time.sleep(poll)


@dataclass
class ServerEvaluator:
    """The global model's evaluation on the server, which holds validation and test.

    Clients' shards come from the training split only; validation selects the best round,
    test is reported.
    """

    settings: Settings
    label_map: LabelMap
    test: LocalData
    model: CaRRetriever
    validation: LocalData | None = None
    #: Examples in each client's shard of this run (partition id → count), the reply cap.
    shard_sizes: dict[int, int] = field(default_factory=dict)
    #: Split sizes and the duplicates removed before splitting.
    data_stats: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, settings: Settings) -> ServerEvaluator:
        splits = load_splits(settings.dataset, seed=settings.seed)
        names = splits.label_map.names
        documents = label_documents(names, settings.dataset.label_texts)
        holder: dict[str, CaRRetriever] = {}

        def get_model() -> CaRRetriever:
            if "model" not in holder:
                holder["model"] = build_retriever(settings, len(names), documents=documents)
            return holder["model"]

        test = prepare_for(
            settings,
            splits.test["text"],
            splits.test["label"],
            get_model=get_model,
            desc="server test features",
        )
        validation = (
            prepare_for(
                settings,
                splits.validation["text"],
                splits.validation["label"],
                get_model=get_model,
                desc="server validation features",
            )
            if len(splits.validation)
            else None
        )
        if "model" in holder:
            model = holder["model"]
        else:  # classifier mode with cached test features: no encoder needed on the server
            assert test.features is not None
            model = build_retriever(
                settings, len(splits.label_map), hidden_size=int(test.features.shape[1])
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
            test=test,
            validation=validation,
            model=model,
            shard_sizes=shard_sizes,
            data_stats=splits.stats,
        )

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of the global model ``arrays``."""
        self.model.load_trainable_state_dict(from_record(arrays))
        batch, top_k = self.settings.train.eval_batch_size, self.settings.eval.top_k
        return eval_row(
            evaluate(self.model, self.validation, batch_size=batch, top_k=top_k)
            if self.validation is not None
            else None,
            evaluate(self.model, self.test, batch_size=batch, top_k=top_k),
        )


@dataclass
class RoundRecorder:
    """``evaluate_fn`` for ``FedAvg.start``: evaluates, logs, writes files after each round."""

    settings: Settings
    output_dir: Path
    evaluator: ServerEvaluator
    strategy: GuardedStrategy
    history: list[dict[str, Any]] = field(default_factory=list)
    client_rows: list[dict[str, Any]] = field(default_factory=list)
    client_epsilon: dict[int, float] = field(default_factory=dict)
    #: Record-level DP (dp=record): each client's σ, q, steps and ε, by partition id.
    client_dp: dict[int, dict[str, float]] = field(default_factory=dict)
    last_epsilon: float = 0.0
    initial: dict[str, float] = field(default_factory=dict)
    best: dict[str, Any] | None = None
    started: float = field(default_factory=time.perf_counter)
    round_offset: int = 0

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        metrics = self.evaluator(arrays)
        if server_round == 0 and self.round_offset:
            log.info(
                "resumed after round %d: test loss %.4f top1 %.4f",
                self.round_offset,
                metrics["test_loss"],
                metrics["test_top1"],
            )
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        server_round += self.round_offset
        if server_round == 0:
            self.initial = metrics
            log.info(
                "round   0 | initial global model: test loss %.4f top1 %.4f",
                metrics["test_loss"],
                metrics["test_top1"],
            )
            return MetricRecord({k: float(v) for k, v in metrics.items()})
        stats = self.strategy.history[-1]
        row: dict[str, Any] = {
            "round": server_round,
            "epochs": server_round * self.settings.fl.local_epochs,
            "train_loss": stats.weighted("train-loss"),
            "train_accuracy": stats.weighted("train-accuracy"),
            **metrics,
            "seconds": time.perf_counter() - stats.started,
            "bytes_sent": sum(stats.bytes_sent.values()),
            "bytes_received": sum(stats.bytes_received.values()),
            "bytes_sent_per_client": max(stats.bytes_sent.values(), default=0),
            "clients_asked": len(stats.asked),
            "clients_ok": len(stats.client_metrics),
            "clients_rejected": len(stats.rejected),
            "clients_failed": len(stats.failed),
            "skipped": int(not stats.aggregated),
            "dp_active": int(any(m.get("dp-active") for m in stats.client_metrics.values())),
            # The largest ε any client has spent so far (δ = dp.delta); 0 without DP.
            "epsilon": self.epsilon(stats),
            "max_client_train_seconds": max(
                (m.get("train-seconds", 0.0) for m in stats.client_metrics.values()), default=0.0
            ),
        }
        self.history.append(row)
        self.client_rows.extend(client_rows(stats))
        log.info("%s | asked %s", round_line(row), ", ".join(map(str, stats.asked)))
        checkpoint = Checkpoint(
            state=from_record(arrays),
            label_map=self.evaluator.label_map,
            settings=self.settings,
            round=server_round,
            metrics=row,
            epsilon=row["epsilon"],
        )
        save_checkpoint(self.output_dir / "checkpoints" / f"round-{server_round:03d}", checkpoint)
        if is_better(row, self.best):  # on validation, never on test
            self.best = row
            save_checkpoint(self.output_dir / "checkpoints" / "best", checkpoint)
        self.write(final=False)
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "federated",
            "clients": self.settings.fl.clients,
            "mode": self.settings.train.mode,
            "head": self.settings.head.kind,
            "num_labels": len(self.evaluator.label_map),
            "rounds": self.settings.fl.rounds,
            "local_epochs": self.settings.fl.local_epochs,
            "initial": self.initial,
            "final": self.history[-1] if self.history else None,
            "best": self.best,
            "total_seconds": time.perf_counter() - self.started,
            "test_examples": len(self.evaluator.test),
            "selection": "validation"
            if self.evaluator.validation is not None
            else "final (no validation split)",
            "data": self.evaluator.data_stats,
            "skipped_rounds": [r["round"] for r in self.history if r["skipped"]],
            "dp": self.settings.dp.mode,
            "delta": self.settings.dp.delta,
            "epsilon": self.last_epsilon,
            **({"dp_clients": self.client_dp} if self.client_dp else {}),
        }

    def epsilon(self, stats: RoundStats) -> float:
        """Max over clients of the ε they report; clients that did not reply keep theirs."""
        for node, metrics in stats.client_metrics.items():
            if "dp-epsilon" in metrics:
                self.client_epsilon[node] = metrics["dp-epsilon"]
            if "dp-steps" in metrics:  # record-level DP
                self.client_dp[int(metrics.get("partition-id", node))] = {
                    k: metrics[f"dp-{k.replace('_', '-')}"]
                    for k in ("noise_multiplier", "sample_rate", "steps", "epsilon")
                }
        self.last_epsilon = max(self.client_epsilon.values(), default=0.0)
        return self.last_epsilon

    def write(self, *, final: bool) -> None:
        write_metrics(
            self.output_dir,
            kind="federated",
            history=self.history,
            summary={**self.summary(), "complete": final},
        )
        write_csv(self.output_dir / CLIENTS_CSV, self.client_rows)
        plot_curves(
            self.output_dir,
            self.history,
            title=f"FL {self.settings.dataset.name}, {self.settings.fl.clients} clients",
        )


def client_rows(stats: RoundStats) -> list[dict[str, Any]]:
    """One row per client of a round: status, examples, train metrics, bytes, seconds.

    Under DP a client sends no train metrics: those cells stay empty.
    """
    rows = []
    nodes = sorted({*stats.bytes_sent, *stats.client_metrics, *stats.rejected, *stats.failed})
    for node in nodes:
        metrics = stats.client_metrics.get(node, {})
        if node in stats.client_metrics:
            status = "ok"
        else:
            status = "rejected" if node in stats.rejected else "failed"
        rows.append(
            {
                "round": stats.round,
                "node": node,
                "status": status,
                "reason": stats.rejected.get(node) or stats.failed.get(node) or "",
                "partition_id": metrics.get("partition-id"),
                "num_examples": metrics.get("num-examples"),
                "train_loss": metrics.get("train-loss"),
                "train_accuracy": metrics.get("train-accuracy"),
                "train_seconds": metrics.get("train-seconds"),
                "encoder_loads": metrics.get("encoder-loads"),
                "torch_threads": metrics.get("torch-threads"),
                "bytes_sent": stats.bytes_sent.get(node, 0),
                "bytes_received": stats.bytes_received.get(node, 0),
                "update_norm": stats.update_norms.get(node),
                "dp_active": metrics.get("dp-active"),
                "dp_epsilon": metrics.get("dp-epsilon"),
                "dp_releases": metrics.get("dp-releases"),
                "dp_noise_multiplier": metrics.get("dp-noise-multiplier"),
                "dp_sample_rate": metrics.get("dp-sample-rate"),
                "dp_steps": metrics.get("dp-steps"),
            }
        )
    return rows


@dataclass
class ResumePoint:
    """Where an interrupted run continues: its last complete round and what it had written."""

    round: int
    arrays: ArrayRecord
    history: list[dict[str, Any]]
    client_rows: list[dict[str, Any]]
    initial: dict[str, float]


def load_resume_point(run_dir: Path, settings: Settings) -> ResumePoint:
    """The last round whose checkpoint is complete, with the history up to it.

    The run's saved configuration must match this one (``fl.rounds`` may be raised).
    """
    saved_config = run_dir / "config.yaml"
    metrics_file = run_dir / "metrics.json"
    for path in (saved_config, metrics_file):
        if not path.is_file():
            raise FileNotFoundError(f"resume={run_dir}: {path.name} is missing; is it a run dir?")
    saved = settings_from_yaml(saved_config.read_text(encoding="utf-8"))
    saved.fl.rounds = settings.fl.rounds
    if fingerprint(saved) != fingerprint(settings):
        raise ValueError(
            f"resume={run_dir}: that run was made with another configuration (see its "
            "config.yaml); resume it with the same overrides (only fl.rounds may change)"
        )
    metrics = json.loads(metrics_file.read_text(encoding="utf-8"))
    for row in reversed(metrics["history"]):
        folder = run_dir / "checkpoints" / f"round-{int(row['round']):03d}"
        try:
            checkpoint = load_checkpoint(folder)
        except (OSError, ValueError) as err:
            log.warning("resume: skipping round %s (%s)", row["round"], err)
            continue
        done = checkpoint.round
        if done >= settings.fl.rounds:
            raise ValueError(
                f"resume={run_dir}: the run already has {done} rounds; raise fl.rounds above it"
            )
        rows_file = run_dir / CLIENTS_CSV
        rows = list(csv.DictReader(rows_file.open())) if rows_file.is_file() else []
        return ResumePoint(
            round=done,
            arrays=to_record(checkpoint.state, dtype=settings.comm.dtype),
            history=[r for r in metrics["history"] if int(r["round"]) <= done],
            client_rows=[r for r in rows if int(r["round"]) <= done],
            initial=metrics["summary"].get("initial", {}),
        )
    raise ValueError(f"resume={run_dir}: no complete round checkpoint to continue from")


def check_local_paths(settings: Settings) -> None:
    """Fail before any node is contacted if a configured local file or folder is missing."""
    for key, value in (
        ("dataset.path", settings.dataset.path),
        ("dataset.test_path", settings.dataset.test_path),
    ):
        if value is not None and not Path(value).expanduser().is_file():
            raise FileNotFoundError(
                f"{key}={value} does not exist on the server; the server needs the dataset "
                "for its held-out evaluation (give an absolute path valid on the aggregator)"
            )
    model = settings.model.name_or_path
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise FileNotFoundError(
            f"model.name_or_path={model} is not a folder on the server; point it at a model "
            "folder on the aggregator (clients may override it with --node-config model-path)"
        )


def default_output_dir(settings: Settings) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{stamp}-{settings.dataset.name}-{settings.model.name}-{settings.train.mode}"
    return Path("runs") / name.replace("+", "-")


def run_federation(grid: Grid, settings: Settings) -> dict[str, Any]:
    """The whole federated run on the server side; returns the summary."""
    resume_dir = Path(settings.resume).resolve() if settings.resume else None
    output_dir = resume_dir or Path(settings.output_dir or default_output_dir(settings)).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = settings_to_yaml(settings)
    log.info("resolved configuration (fingerprint %s):\n%s", fingerprint(settings), config_yaml)
    point = load_resume_point(resume_dir, settings) if resume_dir is not None else None
    atomic_write_text(output_dir / "config.yaml", config_yaml)
    log.info("results: %s", output_dir)

    # Local paths, nodes, test data, initial global model
    if trains_nothing(settings):
        raise ValueError(
            f"head.kind={settings.head.kind} with train.mode={settings.train.mode} has nothing "
            "to train, so there is nothing to federate; evaluate it centrally "
            "(python -m car_fl.centralized ...) or train the adapter with mode=adapter (MIPS)"
        )
    check_local_paths(settings)
    wait_for_nodes(grid, settings.fl.clients, timeout=settings.fl.wait_for_nodes)
    evaluator = ServerEvaluator.build(settings)
    initial = to_record(evaluator.model.trainable_state_dict(), dtype=settings.comm.dtype)
    strategy = build_strategy(settings, spec=spec_of(initial), shard_sizes=evaluator.shard_sizes)
    recorder = RoundRecorder(
        settings=settings, output_dir=output_dir, evaluator=evaluator, strategy=strategy
    )
    done = 0
    if point is not None:  # continue after the last complete round
        done = point.round
        initial = point.arrays
        recorder.history, recorder.client_rows = point.history, point.client_rows
        recorder.initial = point.initial
        recorder.best = dict(select_best(point.history) or {}) or None
        recorder.last_epsilon = max(
            (float(r.get("epsilon", 0)) for r in point.history), default=0.0
        )
        strategy.round_offset = recorder.round_offset = done
        log.info("resuming %s after round %d of %d", output_dir, done, settings.fl.rounds)

    # Rounds
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=settings.fl.rounds - done,
        timeout=settings.fl.round_timeout,
        # Clients check the configuration and encode their labels with the global label map.
        train_config=ConfigRecord(
            {"fingerprint": fingerprint(settings), "labels": evaluator.label_map.to_list()}
        ),
        evaluate_fn=recorder,
    )

    # Final results
    final = Checkpoint(
        state=from_record(result.arrays or initial),
        label_map=evaluator.label_map,
        settings=settings,
        round=settings.fl.rounds,
        metrics=recorder.history[-1],
        epsilon=recorder.last_epsilon,
    )
    save_checkpoint(output_dir / "checkpoints" / "final", final)
    recorder.write(final=True)
    summary = recorder.summary()
    if len(summary["skipped_rounds"]) == settings.fl.rounds:
        raise RuntimeError(
            f"every round failed: no client sent a valid update in {settings.fl.rounds} rounds; "
            f"see the errors above (results in {output_dir})"
        )
    log.info(
        "final test top1 %.4f; best on validation in round %d: test top1 %.4f; results in %s",
        summary["final"]["test_top1"],
        summary["best"]["round"],
        summary["best"]["test_top1"],
        output_dir,
    )
    return summary
