"""Start a Flower SuperLink (the aggregator) for car-fl on this machine.

Listens on 127.0.0.1 (this machine only) unless given --bind; on any other address it needs
TLS (--certs, see make_certs.py), or --insecure for a trusted lab network; with a state
database so that a restart does not lose the run; runtime dependency installation off (every
machine has car-fl installed). SuperNodes connect to --fleet-port (gRPC); `flwr run` connects
to --control-port. With --restartable the ServerApp runs under a separate SuperExec, so that a
run survives a restart of the SuperLink (start this script again with the same --database).
Runs in the foreground: stop it with Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from car_fl.deploy.certs import TLSFiles
from car_fl.deploy.commands import (
    CONTROL_PORT,
    FLEET_PORT,
    LOOPBACK,
    FlowerNotFound,
    exposure_warning,
    flower_env,
    superexec_command,
    superlink_command,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--bind",
        default=LOOPBACK,
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every "
        "interface, which needs --certs or --insecure)",
    )
    parser.add_argument("--fleet-port", type=int, default=FLEET_PORT)
    parser.add_argument("--control-port", type=int, default=CONTROL_PORT)
    parser.add_argument(
        "--database",
        default=str(default_database()),
        help="state database (a restart resumes from it; default: car-fl's state folder, "
        "$CAR_FL_STATE or ~/.local/state/car-fl, never the folder this is run from)",
    )
    parser.add_argument(
        "--certs",
        default=None,
        help="folder with ca.crt, server.pem, server.key (TLS); default insecure",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --bind other than loopback without TLS (a trusted lab network only)",
    )
    parser.add_argument(
        "--node-auth",
        action="store_true",
        help="only registered SuperNodes may connect (needs --certs)",
    )
    parser.add_argument(
        "--restartable",
        action="store_true",
        help="run the ServerApp under a separate SuperExec (survives restarts)",
    )
    parser.add_argument("--print", action="store_true", help="print the commands, do not run")
    args = parser.parse_args()
    tls = TLSFiles.in_folder(args.certs) if args.certs else None
    try:
        warning = exposure_warning(args.bind, tls=tls is not None, insecure=args.insecure)
    except ValueError as err:
        sys.exit(f"superlink.py: {err}")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        cmd, exec_cmd = commands(args, tls)
    except FlowerNotFound as err:
        sys.exit(f"superlink.py: {err}")
    env = flower_env()  # the SuperLink starts flower-superexec by name from PATH
    if not args.print:
        busy = busy_flag(args)
        if busy:
            sys.exit(f"superlink.py: {busy}")
    print(" ".join(cmd), flush=True)
    if not args.restartable:
        if not args.print:
            os.execvpe(cmd[0], cmd, env)
        return
    assert exec_cmd is not None
    print(" ".join(exec_cmd), flush=True)
    if args.print:
        return
    superlink = subprocess.Popen(cmd, env=env)
    superexec = subprocess.Popen(exec_cmd, env=env)
    try:
        sys.exit(superlink.wait())
    except KeyboardInterrupt:
        pass
    finally:
        for proc in (superexec, superlink):
            proc.terminate()
        for proc in (superexec, superlink):
            proc.wait()


def default_database() -> Path:
    """The state database unless --database says otherwise: in car-fl's state folder."""
    from car_fl.common.io import state_dir

    return state_dir() / "superlink-state.db"


def busy_flag(args: argparse.Namespace) -> str | None:
    """One line naming the flag to change when a port the SuperLink needs is taken."""
    from car_fl.deploy.ports import port_in_use

    for flag, port in (("--fleet-port", args.fleet_port), ("--control-port", args.control_port)):
        if port_in_use(args.bind, port):
            return (
                f"port {port} on {args.bind} is already in use (another SuperLink?); choose a "
                f"free one with {flag}, e.g. {flag} {port + 100}"
            )
    return None


def commands(args: argparse.Namespace, tls: TLSFiles | None) -> tuple[list[str], list[str] | None]:
    """The SuperLink's command, and the SuperExec's with ``--restartable`` (else None)."""
    cmd = superlink_command(
        fleet_address=f"{args.bind}:{args.fleet_port}",
        control_host=args.bind,
        control_port=args.control_port,
        database=args.database,
        tls=tls,
        node_auth=args.node_auth,
        isolation="process" if args.restartable else "subprocess",
    )
    if not args.restartable:
        return cmd, None
    host = "127.0.0.1" if args.bind in ("0.0.0.0", "::") else args.bind
    exec_cmd = superexec_command(
        runtime_address=f"{host}:{args.control_port}", root_cert=Path(tls.ca_cert) if tls else None
    )
    return cmd, exec_cmd


if __name__ == "__main__":
    main()
