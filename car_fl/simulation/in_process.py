"""A federation in one process, without Ray: every node's ClientApp handler called in turn.

The real server and ClientApp handler, deterministically and in seconds less than Flower's
Ray-based simulation, for tests and attack experiments.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from car_fl.results.rows import METRICS_JSON
from car_fl.server.federation import run_federation
from car_fl.settings.compose import (
    NUM_PARTITIONS,
    PARTITION_ID,
    TRUST_REMOTE_CODE,
    settings_to_yaml,
)
from car_fl.settings.schema import Settings
from car_fl.simulation.apps import import_app

ClientTrain = Callable[[Message, Context], Message]


class LocalGrid(Grid):
    """Nodes ``first_node_id + i`` holding partition ``i``; messages handled synchronously.
    Every node gets ``node_config``, plus ``node_configs[i]`` if given."""

    def __init__(
        self,
        client_train: ClientTrain,
        *,
        num_nodes: int,
        run_config: dict[str, Any],
        node_config: dict[str, Any] | None = None,
        node_configs: Sequence[Mapping[str, Any]] = (),
        first_node_id: int = 1001,
    ) -> None:
        if len(node_configs) > num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        own = [*node_configs, *([{}] * (num_nodes - len(node_configs)))]
        self.client_train = client_train
        self.run_config = run_config
        self.contexts = {
            first_node_id + i: Context(
                run_id=1,
                node_id=first_node_id + i,
                node_config={
                    PARTITION_ID: i,
                    NUM_PARTITIONS: num_nodes,
                    **(node_config or {}),
                    **own[i],
                },
                state=RecordDict(),
                run_config=run_config,
            )
            for i in range(num_nodes)
        }
        #: node ids asked in each call of :meth:`send_and_receive`, in order.
        self.asked: list[list[int]] = []

    @property
    def run(self) -> Any:
        raise NotImplementedError("LocalGrid has no Flower run")

    def set_run(self, run: Any) -> None:
        raise NotImplementedError("LocalGrid has no Flower run")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError("build messages with flwr.app.Message")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("LocalGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("LocalGrid only supports send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Each message's reply from its node's handler (an error reply if the handler raises)."""
        from flwr.app import Error

        replies, asked = [], []
        for message in messages:
            node = message.metadata.dst_node_id
            asked.append(node)
            context = self.contexts[node]
            try:
                replies.append(self.client_train(message, context))
            except Exception as err:  # a failing client must not end the run, as in Flower
                replies.append(Message(Error(code=0, reason=repr(err)), reply_to=message))
        if asked:
            self.asked.append(asked)
        return replies


def run_local(
    settings: Settings,
    *,
    num_nodes: int | None = None,
    client_train: ClientTrain | None = None,
    node_config: dict[str, Any] | None = None,
    node_configs: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Run a whole federation in this process and return its ``metrics.json`` content.
    ``client_train`` replaces the ClientApp handler; ``settings.output_dir`` must be set."""
    if settings.output_dir is None:
        raise ValueError("run_local needs settings.output_dir (where the run's results go)")
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    if settings.model.trust_remote_code:  # every node is this machine's owner's, who asked
        node_config = {TRUST_REMOTE_CODE: True, **(node_config or {})}
    grid = LocalGrid(
        client_train or import_app("client_app").train,
        num_nodes=num_nodes or settings.fl.clients,
        run_config={"overrides": "", "settings": settings_to_yaml(settings)},
        node_config=node_config,
        node_configs=node_configs,
    )
    started = time.perf_counter()
    run_federation(grid, settings)
    metrics: dict[str, Any] = json.loads(
        (Path(settings.output_dir) / METRICS_JSON).read_text(encoding="utf-8")
    )
    metrics["asked"] = grid.asked
    metrics["output_dir"] = settings.output_dir
    metrics["wall_seconds"] = time.perf_counter() - started
    return metrics
