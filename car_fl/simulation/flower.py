"""Run one complete Flower simulation in this process, for a given set of Hydra overrides.

Flower's ``run_simulation`` hands the apps an empty run config, so the project's handlers are
wrapped to get one carrying the overrides; the result is read from ``metrics.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from car_fl.results.rows import METRICS_JSON
from car_fl.settings.compose import load_settings, parse_overrides, settings_to_yaml
from car_fl.settings.schema import Settings
from car_fl.simulation.apps import import_app


def _with_overrides(context: Context, overrides: str, settings_yaml: str = "") -> Context:
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=context.node_config,
        state=context.state,
        run_config={**context.run_config, "overrides": overrides, "settings": settings_yaml},
    )


def wrapped_apps(
    overrides: str,
    *,
    settings_yaml: str = "",
    server_main: Callable[[Grid, Context], None] | None = None,
    client_train: Callable[[Message, Context], Message] | None = None,
) -> tuple[ServerApp, ClientApp]:
    """A ServerApp and a ClientApp that run the project's handlers with these overrides (or a
    non-empty ``settings_yaml``, which takes precedence)."""
    server_main = server_main or import_app("server_app").main
    client_train = client_train or import_app("client_app").train
    server, client = ServerApp(), ClientApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        assert server_main is not None
        server_main(grid, _with_overrides(context, overrides, settings_yaml))

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        assert client_train is not None
        return client_train(msg, _with_overrides(context, overrides, settings_yaml))

    return server, client


def run_simulation(
    overrides: str | list[str] | None = None,
    *,
    settings: Settings | None = None,
    num_supernodes: int | None = None,
    cpus_per_client: float | None = None,
    server_main: Callable[[Grid, Context], None] | None = None,
    client_train: Callable[[Message, Context], Message] | None = None,
) -> dict[str, Any]:
    """Run a whole federated simulation and return its ``metrics.json`` content. ``conf/`` with
    ``overrides``, or ``settings`` (then no overrides). ``RuntimeError`` when the run did not
    complete (the ServerApp's error is in the log)."""
    from flwr.simulation import run_simulation as flower_run_simulation

    items = parse_overrides(overrides)
    if settings is not None and items:
        raise ValueError("give run_simulation either overrides or settings, not both")
    settings = settings or load_settings(items)
    if settings.output_dir is None and settings.resume is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        settings.output_dir = str(Path("runs", f"sim-{stamp}-{os.getpid()}").resolve())
    run_dir = settings.resume or settings.output_dir  # a resumed run writes where it was
    assert run_dir is not None
    output_dir = Path(run_dir)
    nodes = num_supernodes or settings.fl.clients
    cpus = cpus_per_client or max(1.0, (os.cpu_count() or 1) / nodes)
    server, client = wrapped_apps(
        "",
        settings_yaml=settings_to_yaml(settings),
        server_main=server_main,
        client_train=client_train,
    )
    flower_run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": cpus, "num_gpus": 0.0}},
    )
    metrics_path = output_dir / METRICS_JSON
    if not metrics_path.is_file():
        raise RuntimeError(f"the simulation wrote no {metrics_path}; see the ServerApp's log")
    metrics: dict[str, Any] = json.loads(metrics_path.read_text(encoding="utf-8"))
    if not metrics["summary"].get("complete"):
        raise RuntimeError(f"the simulation did not complete; partial results in {output_dir}")
    metrics["output_dir"] = str(output_dir)
    return metrics
