"""Register SuperNode public keys with a SuperLink started with --node-auth.

    python scripts/register_nodes.py --connection lab certs/node0.key.pub certs/node1.key.pub

The connection must exist in $FLWR_HOME/config.toml (see scripts/local_cluster.py or the
docs/deployment.md); only registered SuperNodes are then allowed to connect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from car_fl.deploy.connection import register_node


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connection", required=True, help="flwr connection name of the SuperLink")
    parser.add_argument("keys", nargs="+", type=Path, help="public key files (*.pub)")
    args = parser.parse_args()
    failed = 0
    for key in args.keys:
        result = register_node(key, args.connection)
        ok = result.returncode == 0
        failed += not ok
        print(f"{key}: {'registered' if ok else 'FAILED'}\n{result.stdout}{result.stderr}".strip())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
