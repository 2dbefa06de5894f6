"""What the strategy saw in one training round, handed to the round recorder when it ends."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from car_fl.protocol.messages import NUM_EXAMPLES


@dataclass
class RoundStats:
    """What the strategy saw in one training round."""

    round: int
    started: float
    #: The nodes asked to train this round (sampled from ``connected``).
    asked: list[int] = field(default_factory=list)
    connected: int = 0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    #: Each valid reply's metrics, under their wire (kebab-case) keys.
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    #: The metrics of every reply that arrived, also those refused: the server's ε counts
    #: them (client_metrics keeps only the valid ones).
    released: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    #: The error code of each failed node's reply (a lost node, which sent none, has none).
    failure_codes: dict[int, int] = field(default_factory=dict)
    #: ‖θᵢ − θ‖ of every reply that passed validation, and this round's bound (if any).
    update_norms: dict[int, float] = field(default_factory=dict)
    norm_bound: float | None = None
    clipped: list[int] = field(default_factory=list)
    aggregated: bool = False

    def attribute_lost_replies(self) -> None:
        """Name the nodes that never answered: Flower's error reply for a lost node does not
        name it, so pair anonymous errors with silent nodes when unambiguous."""
        answered = {*self.client_metrics, *self.rejected, *self.failed}
        silent = sorted(set(self.bytes_sent) - answered)
        anonymous = [n for n in self.failed if n not in self.bytes_sent]
        if len(silent) == 1 and len(anonymous) == 1:
            self.failed[silent[0]] = self.failed.pop(anonymous[0])
            if anonymous[0] in self.failure_codes:
                self.failure_codes[silent[0]] = self.failure_codes.pop(anonymous[0])
            return
        for node in silent:
            self.failed[node] = "no reply (the node was lost or the round timed out)"

    def weighted(self, key: str) -> float:
        """The example-weighted mean of a client metric (wire key) over the replies that sent
        a finite value with a finite, positive count; NaN if none did (a hostile client's −∞
        or NaN would be the round's figure)."""
        rows = [
            m
            for m in self.client_metrics.values()
            if math.isfinite(m.get(key, math.nan)) and 0 < m.get(NUM_EXAMPLES, 0) < math.inf
        ]
        total = sum(m[NUM_EXAMPLES] for m in rows)
        if not rows or total <= 0:
            return float("nan")
        return sum(m[key] * m[NUM_EXAMPLES] for m in rows) / total
