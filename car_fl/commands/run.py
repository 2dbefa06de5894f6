"""``car-fl run``: ``flwr run`` this project, follow its log, and exit with its outcome.

``flwr run`` exits 0 for a run whose ServerApp failed; this command checks the configuration
here first (in seconds), starts the run, streams its log and exits 0 for
``finished:completed``, else 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from car_fl.settings.schema import Settings

NAME = "run"
SUPERLINKS = ("own", "flower")
HELP = "flwr run this project (a simulation: connection local) and exit non-zero if it fails"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "connection",
        nargs="?",
        default="local",
        help="the flwr SuperLink connection (default: local, Flower's simulation)",
    )
    parser.add_argument(
        "--app", default=".", help="the Flower app folder (default: the current folder)"
    )
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help='as for flwr run: \'fl.rounds=2 dp="record" overrides="train.lr=0.01"\'',
    )
    parser.add_argument(
        "--federation-config",
        action="append",
        default=[],
        help="as for flwr run, e.g. 'num-supernodes=3' (simulation; default: fl.clients)",
    )
    parser.add_argument(
        "--timeout", type=float, default=24 * 3600.0, help="seconds before the run is stopped"
    )
    parser.add_argument(
        "--superlink",
        choices=SUPERLINKS,
        default="own",
        help="for the local simulation: own (default) starts a SuperLink for this run, in this "
        "environment and folder, and ends it with the run; flower uses Flower's local "
        "SuperLink (flwr ls local), refused if it runs another environment or folder",
    )


def is_local_simulation(connection: str) -> bool:
    """Whether ``connection`` is Flower's managed local SuperLink (``address = ":local:"``)."""
    from flwr.cli.constant import (
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY,
    )
    from flwr.cli.flower_config import read_superlink_connection

    try:
        address = read_superlink_connection(connection).address
    except Exception:  # no such connection: flwr run will say so
        return False
    return address in (
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY,
    )


def simulation_config(items: list[str], clients: int) -> list[str]:
    """``--federation-config`` strings for a simulation of ``clients`` SuperNodes (by default
    ``fl.clients``), each an equal share of this machine's CPUs unless given."""
    from flwr.common.config import parse_config_args

    given = parse_config_args(items)
    nodes = given.get("num-supernodes")
    extra = []
    if nodes is None:
        extra.append(f"num-supernodes={clients}")
    elif nodes != clients:
        raise ValueError(
            f"--federation-config num-supernodes={nodes} but fl.clients={clients}: the "
            f"simulation's fix is --federation-config 'num-supernodes={clients}' (or "
            f"--run-config 'fl.clients={nodes}')"
        )
    if "client-resources-num-cpus" not in given:
        extra.append(f"client-resources-num-cpus={max(1, (os.cpu_count() or 1) // clients)}")
    return [*items, " ".join(extra)] if extra else items


def run(args: argparse.Namespace) -> int:
    """Check, submit, follow; 0 only for a run that finished ``completed``."""
    from car_fl.deploy.runs import COMPLETED, NO_INSTALL, follow_run, submit
    from car_fl.model.sources import check_sources
    from car_fl.settings.compose import run_config_from_args, settings_from_run_config
    from car_fl.settings.schema import federation_refusal

    app = Path(args.app).resolve()
    settings = settings_from_run_config(run_config_from_args(app, args.run_config))
    reason = federation_refusal(settings)
    if reason:
        raise ValueError(reason)
    check_dataset_path(settings)
    federation = args.federation_config
    local = is_local_simulation(args.connection)
    if federation or local:
        federation = simulation_config(federation, settings.fl.clients)
        # This machine is the server: its files and the Hub are what the run will use.
        check_sources(settings)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in NO_INSTALL.items()}}
    own = local and args.superlink == "own"
    with stop_signals(), superlink(app, args.connection, env, own=own, local=local) as link:
        connection, env = link
        run_id = submit(app, connection, args.run_config, federation, env=env, cwd=app)
        print(
            f"car-fl run: run {run_id} started on {args.connection}; following its log "
            f"(Ctrl-C stops the run)",
            file=sys.stderr,
            flush=True,
        )
        try:
            status = follow_run(connection, run_id, timeout=args.timeout, env=env)
        except (KeyboardInterrupt, Stopped) as err:
            from car_fl.deploy.runs import stop_run

            stop_run(connection, run_id, env=env)
            why = f" ({err.name})" if isinstance(err, Stopped) else ""
            print(f"car-fl run: run {run_id} stopped{why}", file=sys.stderr, flush=True)
            return err.code if isinstance(err, Stopped) else 130
    if status["status"] == COMPLETED:
        print(f"car-fl run: run {run_id} {COMPLETED}", file=sys.stderr)
        return 0
    details = " ".join(status["status-details"].split())
    print(f"car-fl run: run {run_id} {status['status']}: {details}", file=sys.stderr)
    return 1


@contextlib.contextmanager
def superlink(
    app: Path, connection: str, env: dict[str, str], *, own: bool, local: bool
) -> Iterator[tuple[str, dict[str, str]]]:
    """The connection to submit to and the environment of ``flwr``'s commands: this run's own
    SuperLink (``own``, ended with the block), Flower's local one once
    :func:`check_local_superlink` found it fit, else the connection as given."""
    if own:
        from car_fl.deploy.own_superlink import own_superlink

        print(
            "car-fl run: starting this run's own SuperLink (this environment and folder; "
            "it ends with the run)",
            file=sys.stderr,
            flush=True,
        )
        with own_superlink(app, env=env) as link:
            yield link.connection, link.env
        return
    if local:
        from car_fl.deploy.commands import python_bin
        from car_fl.deploy.local_superlink import check_local_superlink

        check_local_superlink(app, python_bin())
    yield connection, env


class Stopped(Exception):
    """SIGTERM or SIGHUP reached ``car-fl run``: stop the run as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name
        self.code = 128 + signum  # the shell's convention: 143 for SIGTERM, 129 for SIGHUP


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` while the run is followed, so that the run and
    its log stream are stopped instead of living on."""

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_dataset_path(settings: Settings) -> None:
    """A relative ``dataset.path`` would be read from the folder of Flower's processes, not
    from where the command was typed: refused in one line before any work."""
    path = settings.dataset.path
    if path and not Path(path).expanduser().is_absolute():
        raise ValueError(
            f"dataset.path={path!r} is relative, and the run's processes read it from their "
            f'own folder; give the absolute path: dataset.path="{Path(path).resolve()}"'
        )
