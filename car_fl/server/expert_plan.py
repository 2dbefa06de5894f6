"""Which experts of a mixture of experts each client is sent, and which it may send back.

Decided from public values only (the round, the client's place, the layout): ``all`` (every
tensor both ways), ``schedule`` (the shared tensors and the ``(round + place) mod
moe.schedule_blocks``-th block of experts, interleaved), ``routed`` (every tensor down; any
experts back; refused under DP).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from car_fl.heads.experts import EXPERT_PREFIX
from car_fl.settings.schema import ExpertSending, Settings


def is_expert(name: str) -> bool:
    return name.startswith(EXPERT_PREFIX)


def expert_id(name: str) -> int:
    return int(name[len(EXPERT_PREFIX) :])


@dataclass(frozen=True)
class ExpertPlan:
    """The experts each client gets and returns (see the module)."""

    send: ExpertSending
    blocks: int
    names: tuple[str, ...]
    #: The expert layout (:meth:`~car_fl.heads.clustering.ExpertLayout.to_text`) sent to clients.
    layout: str

    @classmethod
    def from_settings(cls, settings: Settings, names: Iterable[str], layout: str) -> ExpertPlan:
        return cls(
            send=settings.moe.send,
            blocks=settings.moe.schedule_blocks,
            names=tuple(names),
            layout=layout,
        )

    def block(self, server_round: int, place: int) -> int:
        """The block of experts the client at ``place`` (0-based, by node id) trains."""
        return (server_round + place) % self.blocks

    def sent(self, server_round: int, place: int) -> list[str]:
        """The tensors the client at ``place`` is sent in ``server_round``."""
        if self.send is not ExpertSending.SCHEDULE:
            return list(self.names)
        block = self.block(server_round, place)
        return [n for n in self.names if not is_expert(n) or expert_id(n) % self.blocks == block]

    def optional(self, sent: Iterable[str]) -> set[str]:
        """Of the tensors sent, those a valid reply may leave out (routed: the experts)."""
        if self.send is not ExpertSending.ROUTED:
            return set()
        return {n for n in sent if is_expert(n)}
