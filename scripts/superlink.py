"""Start a Flower SuperLink (the aggregator) for car-fl on this machine.

Insecure for a trusted lab network, or TLS with --certs (see make_certs.py); with a state
database so that a restart does not lose the run; runtime dependency installation off (every
machine has car-fl installed). SuperNodes connect to --fleet-port (gRPC); `flwr run` connects
to --control-port. Runs in the foreground: stop it with Ctrl-C.
"""

from __future__ import annotations

import argparse
import os

from car_fl.deploy import CONTROL_PORT, FLEET_PORT, TLSFiles, superlink_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--fleet-port", type=int, default=FLEET_PORT)
    parser.add_argument("--control-port", type=int, default=CONTROL_PORT)
    parser.add_argument(
        "--database",
        default="superlink-state.db",
        help="state database (a restart resumes from it)",
    )
    parser.add_argument(
        "--certs",
        default=None,
        help="folder with ca.crt, server.pem, server.key (TLS); default insecure",
    )
    parser.add_argument(
        "--node-auth",
        action="store_true",
        help="only registered SuperNodes may connect (needs --certs)",
    )
    parser.add_argument("--print", action="store_true", help="print the command, do not run it")
    args = parser.parse_args()
    cmd = superlink_command(
        fleet_address=f"{args.bind}:{args.fleet_port}",
        control_host=args.bind,
        control_port=args.control_port,
        database=args.database,
        tls=TLSFiles.in_folder(args.certs) if args.certs else None,
        node_auth=args.node_auth,
    )
    print(" ".join(cmd), flush=True)
    if not args.print:
        os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
