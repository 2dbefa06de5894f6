"""Start a Flower SuperNode (a client machine) for car-fl, connected to a SuperLink.

Its shard (--partition-id of --num-partitions), its local data file, its device, an optional
local model folder and feature cache travel as Flower --node-config; data never travels in the
app bundle. With --worker DIR the node's worker (`car-fl worker --dir DIR`, started first with
the node config this script prints) trains each round. Runs in the foreground: stop it with
Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from car_fl.deploy.commands import (
    FLEET_PORT,
    FlowerNotFound,
    flower_env,
    node_config_string,
    supernode_command,
    worker_command,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--superlink", required=True, help=f"aggregator address, e.g. 192.168.1.10:{FLEET_PORT}"
    )
    parser.add_argument("--partition-id", type=int, required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="this node's copy of the dataset file (dataset.path)",
    )
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local model folder, if not downloaded from the hub",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="feature cache folder")
    parser.add_argument(
        "--data-is-shard",
        action="store_true",
        help="--data holds only this node's examples: train on all of them "
        "instead of taking partition --partition-id of the full dataset",
    )
    parser.add_argument(
        "--worker",
        type=Path,
        default=None,
        help="folder of this node's worker (car-fl worker --dir), which then trains each round",
    )
    parser.add_argument(
        "--privacy-policy",
        type=Path,
        default=None,
        help="this node's privacy policy (TOML, docs/privacy.md); also in the worker's command",
    )
    parser.add_argument("--port", type=int, default=9094, help="this node's local runtime API")
    parser.add_argument(
        "--root-cert",
        type=Path,
        default=None,
        help="the CA certificate (ca.crt) for TLS; default insecure",
    )
    parser.add_argument(
        "--auth-key",
        type=Path,
        default=None,
        help="private key registered with the SuperLink (node authentication)",
    )
    parser.add_argument(
        "--trusted-entities",
        type=Path,
        default=None,
        help="YAML of Ed25519 keys a FAB must be signed by (Flower Hub apps only in Flower "
        "1.39: every FAB of 'flwr run .' is refused; docs/deployment.md, 5c)",
    )
    parser.add_argument("--print", action="store_true", help="print the command, do not run it")
    args = parser.parse_args()
    node: dict[str, Any] = {
        "partition_id": args.partition_id,
        "num_partitions": args.num_partitions,
        "data_path": args.data,
        "device": args.device,
        "model_path": args.model,
        "cache_dir": args.cache_dir,
        "data_is_shard": args.data_is_shard,
        "privacy_policy": args.privacy_policy,
    }
    try:
        cmd = supernode_command(
            superlink=args.superlink,
            runtime_port=args.port,
            root_cert=args.root_cert,
            private_key=args.auth_key,
            trusted_entities=args.trusted_entities,
            node_config=node_config_string(**node, worker=args.worker),
        )
    except FlowerNotFound as err:
        sys.exit(f"supernode.py: {err}")
    if args.worker:
        mine = node_config_string(**node)  # the worker's: the same values and policy, no worker
        worker = worker_command(folder=args.worker.expanduser(), node_config=mine)
        print("this node's worker (start it first):", shlex.join(worker), flush=True)
    if not args.print:
        from car_fl.deploy.ports import port_in_use

        if port_in_use("127.0.0.1", args.port):
            sys.exit(
                f"supernode.py: port {args.port} on 127.0.0.1 (this node's local runtime API) "
                f"is already in use (another SuperNode?); choose a free one with --port, e.g. "
                f"--port {args.port + 100}"
            )
    print(shlex.join(cmd), flush=True)
    if not args.print:
        # the SuperNode starts flower-superexec (and that flwr-clientapp) by name from PATH
        os.execvpe(cmd[0], cmd, flower_env())


if __name__ == "__main__":
    main()
