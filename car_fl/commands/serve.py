"""``car-fl serve``: a trained checkpoint as a retrieval endpoint many RAG applications share.

    car-fl serve --checkpoint runs/<run>/checkpoints/best --port 8300

``POST /retrieve``, ``GET /health``, the schema at ``/docs`` (docs/retrieval.md); it runs until
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse

from car_fl.serving.ray_app import add_serve_arguments, serve_config_values, serve_until_stopped
from car_fl.settings.choices import DEVICES

NAME = "serve"
HELP = "serve a checkpoint's retriever as an HTTP endpoint (Ray Serve): top-k documents"
#: Where the token may come from besides --token-file (never a flag: argv is visible to all).
TOKEN_ENV = "CAR_FL_SERVE_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint folder, e.g. runs/<run>/checkpoints/best",
    )
    parser.add_argument("--device", default="auto", choices=DEVICES)
    add_serve_arguments(parser, port=8300, token_env=TOKEN_ENV)
    parser.add_argument(
        "--max-batch-queries", type=int, default=256, help="queries per batch (many clients')"
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=50.0, help="how long a batch waits to fill"
    )
    parser.add_argument(
        "--encode-batch",
        type=int,
        default=8,
        help="queries encoded at once, sorted by length (a batch is cut into such chunks)",
    )


def run(args: argparse.Namespace) -> int:
    """Check the flags and the checkpoint, start the endpoint, serve until stopped."""
    from car_fl.common.hub import offline_unless_reachable
    from car_fl.serving.retrieval_service import RetrievalConfig, start

    service = RetrievalConfig(
        **serve_config_values(args, token_env=TOKEN_ENV),
        max_batch_queries=args.max_batch_queries,
        batch_wait_s=args.batch_wait_ms / 1000,
        encode_batch=args.encode_batch,
    )
    offline_unless_reachable()  # no Hub: the loaders read the local cache, and fail in seconds
    return serve_until_stopped(
        NAME,
        lambda: start(args.checkpoint, service, device=args.device),
        what=args.checkpoint,
        ready_file=args.ready_file,
    )
