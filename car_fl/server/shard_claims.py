"""The server's own record of which node holds which partition, and the example cap it implies.

A node is pinned to the first partition it claims; any other claim is refused, and its count
is capped by that partition's size (or by ``fl.max_examples_per_client``, without pinning).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class ShardClaims:
    """Partition ids pinned to node ids, and each node's cap on ``num-examples``."""

    def __init__(
        self, shard_sizes: Mapping[int, int] | None = None, *, max_examples: int | None = None
    ) -> None:
        self.shard_sizes = dict(shard_sizes or {})
        self.max_examples = max_examples
        self.held: dict[int, int] = {}  # node id → partition id

    def cap_for(self, node: int, claimed: Any) -> tuple[int | None, str | None]:
        """(cap, None) if ``node`` may claim partition ``claimed``, else (None, reason)."""
        if self.max_examples is not None or not self.shard_sizes:
            return self.max_examples, None
        if (
            isinstance(claimed, bool)
            or not isinstance(claimed, int | float)
            or not math.isfinite(claimed)
        ):
            return None, f"'partition-id' must be an integer, got {claimed!r}"
        if claimed != int(claimed) or int(claimed) not in self.shard_sizes:
            valid = f"0..{max(self.shard_sizes)}"
            return None, f"'partition-id' = {claimed!r} is not a partition of this run ({valid})"
        pid = int(claimed)
        pinned = self.held.get(node)
        if pinned is not None and pinned != pid:
            return None, f"node {node} holds partition {pinned}, now claims partition {pid}"
        owner = next((n for n, p in self.held.items() if p == pid and n != node), None)
        if owner is not None:
            return None, (
                f"partition {pid} is held by node {owner}; a node started with data-is-shard "
                "needs fl.max_examples_per_client"
            )
        return self.shard_sizes[pid], None

    def pin(self, node: int, claimed: Any) -> None:
        """Record ``node`` as the holder of partition ``claimed`` (after a valid reply)."""
        if self.max_examples is None and self.shard_sizes:
            self.held.setdefault(node, int(claimed))
