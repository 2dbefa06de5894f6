"""``car-fl worker``: this node's worker, started by its owner beside the SuperNode.

    car-fl worker --dir ~/.car-fl/worker \\
        --node-config 'partition-id=1 num-partitions=3 data-path="/data/sms.tsv" device="mps"'

It holds the encoder, the features and the training across rounds; the SuperNode's node config
names its folder (``worker=...``). Give it the SuperNode's node config: it trains with its own
values. Restarted when it dies, unless ``--no-restart``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "worker"
HELP = "this node's worker: holds the encoder across rounds and runs (start beside the SuperNode)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="the worker's folder (its socket, secret, run states and default cache); the "
        'SuperNode\'s node config names it: worker="DIR"',
    )
    parser.add_argument(
        "--node-config",
        required=True,
        help="this node's configuration, as given to flower-supernode (or a .toml file): "
        "partition-id, num-partitions, data-path, device, cache-dir, ...",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="serve in this process only; by default a supervisor holds the socket and "
        "starts the worker again when it dies",
    )
    parser.add_argument(
        "--supernode-group",
        default=None,
        help="the group of the SuperNode's own account, when it is not yours: it may then use "
        "the worker's socket and secret and nothing else of this node's; the worker refuses "
        "to start while that group could read the data, cache or ledger "
        "(docs/deployment.md, 'A SuperNode that cannot read the data')",
    )
    # the supervisor's listening socket, inherited by the worker it starts
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Serve rounds until stopped (a supervisor restarts the worker unless --no-restart)."""
    from flwr.common.config import parse_config_args

    from car_fl.client.confinement import group_id
    from car_fl.client.worker import hold_folder, own_node_config, serve, supervise
    from car_fl.common.progress import setup_logging

    setup_logging()
    folder = args.dir.expanduser().resolve()
    group = group_id(args.supernode_group) if args.supernode_group else None
    try:  # a wrong node config fails here, before anything starts
        own_node_config(folder, parse_config_args([args.node_config]))
    except (ValueError, OSError) as err:
        raise ValueError(f"--node-config {args.node_config!r}: {err}") from err
    if args.listen_fd is None:  # a folder another worker serves: one line, before anything starts
        with hold_folder(folder):
            pass
    if args.no_restart or args.listen_fd is not None:
        node_config = parse_config_args([args.node_config])
        return serve(folder, node_config, listen_fd=args.listen_fd, group=group)
    child = [sys.executable, "-m", "car_fl.cli", NAME, "--dir", str(folder)]
    if args.supernode_group:
        child += ["--supernode-group", args.supernode_group]
    return supervise(folder, [*child, "--node-config", args.node_config], group=group)
