"""A whole car-fl deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1.

    python scripts/local_cluster.py start --dir /tmp/cluster --nodes 3 --data data.tsv [--tls]
    python scripts/local_cluster.py run --dir /tmp/cluster --overrides "model=minilm fl.clients=3"
    python scripts/local_cluster.py stop --dir /tmp/cluster

The deployment path (gRPC Fleet API, a new ClientApp process per message) without several
computers. Each SuperNode gets its worker (`car-fl worker`, in --dir/worker-<i>), which holds
the encoder across rounds and runs; --no-workers trains in each ClientApp process instead.
PIDs, logs, certificates and the flwr configuration (FLWR_HOME) live in --dir; `stop` ends
exactly the processes `start` started.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from car_fl.deploy.cluster import LocalCluster
from car_fl.deploy.commands import FlowerNotFound
from car_fl.deploy.runs import COMPLETED
from car_fl.results.rows import MetricsFile

PROJECT = Path(__file__).resolve().parents[1]
CONNECTION = "car-fl-local"


def start(args: argparse.Namespace) -> None:
    folder = args.dir.resolve()
    cluster = LocalCluster(folder, connection=CONNECTION, ports=args.port)
    try:
        cluster.start(
            args.nodes,
            data=args.data,
            device=args.device,
            tls=args.tls,
            node_auth=args.node_auth,
            workers=not args.no_workers,
        )
    except RuntimeError as err:  # start() stopped whatever it had started
        sys.exit(f"local_cluster.py start: {err}")
    print(json.dumps(cluster.processes.pids, indent=2))
    print(
        f"connection '{CONNECTION}' written to {cluster.flwr_home / 'config.toml'}; "
        f"logs in {folder}"
    )


def results_folder(folder: Path, overrides: str) -> tuple[str, Path]:
    """The overrides with an ``output_dir`` (``<dir>/runs/<time>`` unless given) and that folder
    (the ServerApp runs in the SuperLink's folder: a relative path is not where you are)."""
    given = [w.split("=", 1)[1] for w in shlex.split(overrides) if w.startswith("output_dir=")]
    if given:
        return overrides, Path(given[-1]).expanduser().resolve()
    out = folder / "runs" / time.strftime("%Y%m%d-%H%M%S")
    return f"{overrides} output_dir={out}".strip(), out


def run(args: argparse.Namespace) -> None:
    folder = args.dir.resolve()
    cluster = LocalCluster.attach(folder, connection=CONNECTION)
    overrides, out = results_folder(folder, args.overrides)
    run_id = cluster.submit(PROJECT, overrides)
    print(f"run {run_id} started, results: {out}; following its log", flush=True)
    status = cluster.follow(run_id, timeout=args.timeout)
    print(f"run {run_id} {status['status']}; {outcome(out)}; results: {out}")
    if status["status"] != COMPLETED:
        print(" ".join(status["status-details"].split()))
    sys.exit(0 if status["status"] == COMPLETED else 1)


def outcome(out: Path) -> str:
    """The run's final and validation-selected test top-1, from its ``metrics.json``."""
    try:
        summary = MetricsFile.read(out).summary
    except (OSError, ValueError):
        return "no metrics written"
    if summary.final is None or summary.best is None:
        return "no round finished"
    return (
        f"final test top1 {summary.final.metrics['test_top1']:.4f}, best on validation round "
        f"{summary.best.round}: test top1 {summary.best.metrics['test_top1']:.4f}"
    )


def stop(args: argparse.Namespace) -> None:
    cluster = LocalCluster.attach(args.dir.resolve(), connection=CONNECTION)
    stopped = dict(cluster.processes.pids)
    cluster.stop()
    print(f"stopped {stopped}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="start a SuperLink and N SuperNodes")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--data", type=Path, required=True, help="data file every node reads")
    p.add_argument(
        "--port", type=int, default=19092, help="Fleet API port; Control API +1, SuperNodes +10..."
    )
    p.add_argument("--device", default=None)
    p.add_argument("--tls", action="store_true", help="TLS with a fresh private CA")
    p.add_argument("--node-auth", action="store_true", help="register node keys (needs --tls)")
    p.add_argument(
        "--no-workers",
        action="store_true",
        help="no node workers: every round's ClientApp process trains (and loads the encoder)",
    )
    p.set_defaults(func=start)
    p = sub.add_parser("run", help="flwr run this project on the cluster and wait for it")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--overrides", default="", help="Hydra overrides for the run")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(func=run)
    p = sub.add_parser("stop", help="stop the processes `start` started")
    p.add_argument("--dir", type=Path, required=True)
    p.set_defaults(func=stop)
    args = parser.parse_args()
    try:
        args.func(args)
    except FlowerNotFound as err:
        sys.exit(f"local_cluster.py {args.command}: {err}")


if __name__ == "__main__":
    main()
