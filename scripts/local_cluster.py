"""A whole car-fl deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1.

    python scripts/local_cluster.py start --dir /tmp/cluster --nodes 3 --data data.tsv [--tls]
    python scripts/local_cluster.py run --dir /tmp/cluster --overrides "model=minilm fl.clients=3"
    python scripts/local_cluster.py stop --dir /tmp/cluster

The deployment path (gRPC Fleet API, a new ClientApp process per message) without several
computers. PIDs, logs, certificates and the flwr configuration (FLWR_HOME) live in --dir;
`stop` ends exactly the processes `start` started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from car_fl.deploy import (
    LocalCluster,
    make_certificates,
    make_node_key,
    node_config_string,
    register_node,
    start_run,
    superlink_command,
    supernode_command,
    wait_for_run,
    write_connection,
)

PROJECT = Path(__file__).resolve().parents[1]
CONNECTION = "car-fl-local"


def env_for(folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLWR_HOME": str(folder / "flwr"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }


def start(args: argparse.Namespace) -> None:
    folder = args.dir.resolve()
    cluster = LocalCluster(folder)
    env = env_for(folder)
    fleet, control = f"127.0.0.1:{args.port}", args.port + 1
    tls = make_certificates(folder / "certs", ["127.0.0.1", "localhost"]) if args.tls else None
    cluster.start(
        "superlink",
        superlink_command(
            fleet_address=fleet,
            control_host="127.0.0.1",
            control_port=control,
            database=folder / "state.db",
            tls=tls,
            node_auth=args.node_auth,
        ),
        env=env,
    )
    write_connection(
        folder / "flwr", CONNECTION, f"127.0.0.1:{control}", root_cert=tls.ca_cert if tls else None
    )
    keys = []
    if args.node_auth:
        time.sleep(5)  # let the SuperLink come up before registering keys
        for i in range(args.nodes):
            private, public = make_node_key(folder / "certs" / f"node{i}.key")
            result = register_node(public, CONNECTION, env=env)
            if result.returncode != 0:
                sys.exit(f"registering {public} failed: {result.stdout}{result.stderr}")
            keys.append(private)
    for i in range(args.nodes):
        cluster.start(
            f"supernode-{i}",
            supernode_command(
                superlink=fleet,
                runtime_port=args.port + 10 + i,
                root_cert=tls.ca_cert if tls else None,
                private_key=keys[i] if keys else None,
                node_config=node_config_string(
                    partition_id=i,
                    num_partitions=args.nodes,
                    data_path=args.data,
                    cache_dir=folder / f"cache-{i}",
                    device=args.device,
                ),
            ),
            env=env,
        )
    print(json.dumps(cluster.processes, indent=2))
    print(
        f"connection '{CONNECTION}' written to {folder / 'flwr' / 'config.toml'}; logs in {folder}"
    )


def run(args: argparse.Namespace) -> None:
    folder = args.dir.resolve()
    env = env_for(folder)
    run_id = start_run(PROJECT, CONNECTION, args.overrides, env=env)
    print(
        f"run {run_id} started; waiting for it to finish (flwr ls {CONNECTION} "
        f"--run-id {run_id} with FLWR_HOME={folder / 'flwr'})",
        flush=True,
    )
    status = wait_for_run(CONNECTION, run_id, timeout=args.timeout, env=env)
    print(json.dumps(status, indent=2))
    sys.exit(0 if status["status"] == "finished:completed" else 1)


def stop(args: argparse.Namespace) -> None:
    cluster = LocalCluster.load(args.dir.resolve())
    stopped = dict(cluster.processes)
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
    args.func(args)


if __name__ == "__main__":
    main()
