"""The ``car-fl`` command: wiring only; each subcommand lives in :mod:`car_fl.commands`.

A failing subcommand prints one line, ``car-fl <command>: <reason>``, to stderr and exits 1,
or 130 after Ctrl-C (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from car_fl.commands import (
    ask,
    generate_queries,
    ledger,
    report,
    retrieve,
    run,
    serve,
    serve_blocks,
    train,
    worker,
)

#: The subcommands, in the order ``car-fl --help`` lists them.
COMMANDS: tuple[ModuleType, ...] = (
    train,
    run,
    retrieve,
    ask,
    serve,
    serve_blocks,
    generate_queries,
    report,
    ledger,
    worker,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="car-fl",
        description="Federated, differentially private Classifier-as-Retriever (CaR).",
    )
    debug = "on failure, show the traceback instead of one line"
    parser.add_argument("--debug", action="store_true", help=debug)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        command.add_arguments(child)
        child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
        child.set_defaults(func=command.run)
    return parser


def reason(err: BaseException) -> str:
    """One line saying what went wrong (car-fl's own errors already name key and fix)."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, ValueError | OSError | RuntimeError):
        return text
    return f"{type(err).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print(f"car-fl {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        print(f"car-fl {args.command}: {reason(err)}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
