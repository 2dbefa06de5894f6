"""``car-fl serve-blocks``: the frozen blocks of one model as a service many nodes share.

    car-fl serve-blocks model=smollm2 device=cpu --port 8200 --replicas 1

The model comes from Hydra overrides like every entry point (``model=...``, ``model.dtype``,
``device``); how the service runs from the flags. It runs until Ctrl-C or SIGTERM, then deletes
its app and ends the Ray instance it started (an existing cluster, ``--ray-address``, is left
running). Nodes name it in their own config (docs/blocks.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

NAME = "serve-blocks"
HELP = "serve a model's frozen transformer blocks to many nodes (Ray Serve)"
#: Where the token may come from besides --token-file (never a flag: argv is visible to all).
TOKEN_ENV = "CAR_FL_BLOCKS_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=..., device=...")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8200, help="HTTP port (default 8200)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of the blocks")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    parser.add_argument(
        "--ray-address",
        default="local",
        help="local (default: a Ray instance of its own), auto or host:port (an existing cluster)",
    )
    parser.add_argument("--max-tokens", type=int, default=16_384, help="tokens per request/batch")
    parser.add_argument("--max-rows", type=int, default=64, help="sequences per request")
    parser.add_argument(
        "--token-file", default=None, help=f"a file holding the shared token (or ${TOKEN_ENV})"
    )
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    parser.add_argument(
        "--ready-file", default=None, help="write the service's URL here once it answers"
    )


def read_token(path: str | None) -> str | None:
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as err:
        raise FileNotFoundError(f"--token-file {path}: cannot be read ({err.strerror})") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def run(args: argparse.Namespace) -> int:
    """Check the settings, start the service, wait for it to answer, serve until stopped."""
    from car_fl.blocks.wire import Limits
    from car_fl.serving.blocks_service import ServiceConfig, start, stop
    from car_fl.settings.compose import load_settings

    settings = load_settings(args.overrides)  # bad overrides fail here, before Ray starts
    service = ServiceConfig(
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        ray_address=args.ray_address,
        limits=Limits(max_rows=args.max_rows, max_tokens=args.max_tokens),
        token=read_token(args.token_file),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    stopped = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        url = start(settings.model, service, device=settings.device)
        signal.signal(
            signal.SIGTERM, lambda *_: stopped.set()
        )  # after ray.init, which sets its own
        print(f"car-fl serve-blocks: {settings.model.name_or_path} at {url}", flush=True)
        if args.ready_file:
            Path(args.ready_file).write_text(url + "\n", encoding="utf-8")
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop()
    print("car-fl serve-blocks: stopped", file=sys.stderr)
    return 0
