"""The ``car-fl`` command: wiring only; each subcommand lives in :mod:`car_fl.commands`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from car_fl.commands import ledger, report, retrieve, worker

#: The subcommands, in the order ``car-fl --help`` lists them.
COMMANDS: tuple[ModuleType, ...] = (retrieve, report, ledger, worker)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="car-fl",
        description="Federated, differentially private Classifier-as-Retriever (CaR).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        command.add_arguments(child)
        child.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
