"""``car-fl ledger``: a node owner reads the privacy ledger of its data (table or JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "ledger"
HELP = "the privacy ledger of this node's data: every release and the lifetime ε"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "policy", help="the node's privacy policy (its --node-config privacy-policy)"
    )
    parser.add_argument("data", help="the node's data file (its --node-config data-path)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Print every release recorded for ``data`` and the lifetime ε at the policy's δ."""
    from car_fl.client.ledger import Ledger, record_keys
    from car_fl.client.policy import NodePolicy

    # a wrong policy, data file or ledger: one line, exit 1 (car_fl.cli)
    policy = NodePolicy.load(args.policy)
    if not Path(args.data).expanduser().is_file():
        raise FileNotFoundError(f"data file {args.data} is not a file")
    ledger = Ledger(policy.ledger)  # read only: nothing is created
    entries = ledger.entries()
    # the most-spent record of the data file as it is now
    lifetime = ledger.epsilon(policy.max_delta, record_keys(args.data))
    non_private = ledger.non_private()
    if args.json:
        content = {
            "ledger": str(ledger.path),
            "delta": policy.max_delta,
            "lifetime_epsilon": lifetime,
            "cap": policy.lifetime_epsilon,
            "non_private_releases": non_private,
            "entries": [e.to_dict() for e in entries],
        }
        print(json.dumps(content, indent=2))
        return 0
    print(f"{ledger.path}: {len(entries)} rounds released")
    print(f"{'time':<26} {'run':>12} {'round':>5} {'mode':<9} {'release':<22} {'ε after':>9}")
    for e in entries:
        release = f"{e.release.count} {e.release.kind.value}"
        print(f"{e.time:<26} {e.run:>12} {e.round:>5} {e.mode:<9} {release:<22} {e.epsilon:>9.4g}")
    cap = f" (cap {policy.lifetime_epsilon:g})" if policy.lifetime_epsilon else " (no cap)"
    print(f"lifetime ε {lifetime:.4g} at δ {policy.max_delta:g}{cap}", end="")
    print(f"; {non_private} non-private releases" if non_private else "")
    return 0
