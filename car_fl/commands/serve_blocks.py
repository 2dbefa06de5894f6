"""``car-fl serve-blocks``: the frozen blocks of one model as a service many nodes share.

    car-fl serve-blocks model=smollm2 device=cpu --port 8200 --replicas 1

The model comes from Hydra overrides, how it runs from the flags; it runs until Ctrl-C or
SIGTERM. Nodes name it in their own config (docs/blocks.md).
"""

from __future__ import annotations

import argparse

from car_fl.serving.ray_app import add_serve_arguments, serve_config_values, serve_until_stopped

NAME = "serve-blocks"
HELP = "serve a model's frozen transformer blocks to many nodes (Ray Serve)"
#: Where the token may come from besides --token-file (never a flag: argv is visible to all).
TOKEN_ENV = "CAR_FL_BLOCKS_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=..., device=...")
    add_serve_arguments(parser, port=8200, token_env=TOKEN_ENV)
    parser.add_argument("--max-tokens", type=int, default=16_384, help="tokens per request/batch")
    parser.add_argument("--max-rows", type=int, default=64, help="sequences per request")


def run(args: argparse.Namespace) -> int:
    """Check the settings, start the service, wait for it to answer, serve until stopped."""
    from car_fl.blocks.wire import Limits
    from car_fl.serving.blocks_service import ServiceConfig, start
    from car_fl.settings.compose import load_settings

    settings = load_settings(args.overrides)  # bad overrides fail here, before Ray starts
    service = ServiceConfig(
        **serve_config_values(args, token_env=TOKEN_ENV),
        limits=Limits(max_rows=args.max_rows, max_tokens=args.max_tokens),
    )
    return serve_until_stopped(
        NAME,
        lambda: start(settings.model, service, device=settings.device),
        what=settings.model.name_or_path,
        ready_file=args.ready_file,
    )
