"""The grid as a wrapped Flower strategy sees it: only this round's sampled nodes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid


class SampledGrid(Grid):
    """The grid as the wrapped strategy sees it: only this round's sampled nodes."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self.grid, self.nodes = grid, nodes

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    @property
    def run(self) -> Any:
        return self.grid.run

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Any:
        return self.grid.send_and_receive(messages, timeout=timeout)
