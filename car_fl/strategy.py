"""Server-side aggregation: FedAvg over the trainable tensors, with reply validation.

:class:`CaRFedAvg` extends Flower's Message-API ``FedAvg``:

- every train reply is validated (tensor names, shapes and dtypes of the global model, finite
  values, a positive integer example count) before it can touch the global model; a rejected
  reply is logged with its node and reason and counted;
- the global model is θ = Σ nᵢ/n · θᵢ over the valid replies, computed in float64;
- a round without a valid reply keeps the previous global model and is marked as skipped;
- per round it records client train metrics (weighted by examples), bytes sent to and received
  from each client, and the wall time, for the round recorder to log and save.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from car_fl.records import ARRAYS_KEY, CONFIG_KEY, NUM_EXAMPLES, decode, encode, payload_bytes

log = logging.getLogger(__name__)


@dataclass
class RoundStats:
    """What the strategy saw in one training round."""

    round: int
    started: float
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    aggregated: bool = False

    def attribute_lost_replies(self) -> None:
        """Name the nodes that never answered.

        Flower's error reply for a lost node does not name it (its source is not the node the
        message went to): pair such anonymous errors with the silent nodes when that is
        unambiguous, and mark any other silent node as lost.
        """
        answered = {*self.client_metrics, *self.rejected, *self.failed}
        silent = sorted(set(self.bytes_sent) - answered)
        anonymous = [n for n in self.failed if n not in self.bytes_sent]
        if len(silent) == 1 and len(anonymous) == 1:
            self.failed[silent[0]] = self.failed.pop(anonymous[0])
            return
        for node in silent:
            self.failed[node] = "no reply (the node was lost or the round timed out)"

    def weighted(self, key: str) -> float:
        rows = [m for m in self.client_metrics.values() if key in m]
        total = sum(m[NUM_EXAMPLES] for m in rows)
        if not rows or total <= 0:
            return float("nan")
        return sum(m[key] * m[NUM_EXAMPLES] for m in rows) / total


def validate_reply(
    content: Any,
    spec: dict[str, tuple[tuple[int, ...], np.dtype[Any]]],
    *,
    max_examples: int | None = None,
) -> str | None:
    """``None`` if a train reply may be aggregated, else the reason it may not."""
    arrays = content.array_records
    metrics = content.metric_records
    if len(arrays) != 1 or len(metrics) != 1:
        return (
            f"expected one ArrayRecord and one MetricRecord, got {len(arrays)} and {len(metrics)}"
        )
    record = next(iter(arrays.values()))
    missing, extra = sorted(set(spec) - set(record)), sorted(set(record) - set(spec))
    if missing or extra:
        return f"tensor names differ from the global model: missing {missing}, extra {extra}"
    for name, (shape, dtype) in spec.items():
        array = record[name]
        if tuple(array.shape) != shape:
            return f"tensor {name!r} has shape {tuple(array.shape)}, expected {shape}"
        try:
            values = decode(array)
        except ValueError as err:
            return f"tensor {name!r} cannot be read: {err}"
        if values.dtype != dtype:
            return f"tensor {name!r} has dtype {values.dtype}, expected {dtype}"
        if not np.isfinite(values).all():
            return f"tensor {name!r} has non-finite values"
    count = next(iter(metrics.values())).get(NUM_EXAMPLES)
    if not isinstance(count, int) or isinstance(count, bool):
        return f"'{NUM_EXAMPLES}' must be an integer, got {count!r}"
    if count <= 0:
        return f"'{NUM_EXAMPLES}' must be positive, got {count}"
    if max_examples is not None and count > max_examples:
        return f"'{NUM_EXAMPLES}' = {count} exceeds the cap of {max_examples}"
    return None


def weighted_average(records: list[ArrayRecord], weights: list[int]) -> ArrayRecord:
    """θ = Σ nᵢ/n · θᵢ, accumulated in float64, returned in each tensor's own dtype."""
    total = float(sum(weights))
    out: dict[str, Array] = {}
    for name in records[0]:
        first = records[0][name]
        acc = np.zeros(first.shape, dtype=np.float64)
        for record, weight in zip(records, weights, strict=True):
            acc += decode(record[name]).astype(np.float64) * (weight / total)
        out[name] = encode(acc.astype(decode(first).dtype), stype=first.stype)
    return ArrayRecord(array_dict=out)


class CaRFedAvg(FedAvg):
    """FedAvg over adapter + head tensors, weighted by examples, with validated replies.

    Every connected node trains each round; a round goes ahead with at least ``min_clients``
    (the server waits for all ``fl.clients`` before the first round, so a node that dies later
    does not stall the run).
    """

    def __init__(
        self,
        *,
        min_clients: int,
        spec: dict[str, tuple[tuple[int, ...], np.dtype[Any]]],
        max_examples: int | None = None,
        shard_sizes: Mapping[int, int] | None = None,
        min_valid: int = 1,
        min_valid_fraction: float = 0.0,
    ) -> None:
        """``shard_sizes`` (partition id → examples) caps each client's example count;
        ``max_examples`` caps everybody instead. A round needs at least
        max(``min_valid``, ⌈``min_valid_fraction`` · clients asked⌉) valid replies, else the
        global model stays exactly as it was."""
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=min_clients,
            min_evaluate_nodes=0,
            min_available_nodes=min_clients,
            arrayrecord_key=ARRAYS_KEY,
            configrecord_key=CONFIG_KEY,
        )
        self.spec = spec
        self.max_examples = max_examples
        self.shard_sizes = dict(shard_sizes or {})
        self.min_valid = min_valid
        self.min_valid_fraction = min_valid_fraction
        self.current: RoundStats | None = None
        self.history: list[RoundStats] = []
        #: Rounds already done before this ``start`` (a resumed run): Flower counts from 1,
        #: clients and results see the run's true round numbers.
        self.round_offset = 0

    def cap_for(self, message: Message) -> int | None:
        """The largest example count this reply may claim."""
        if self.max_examples is not None or not self.shard_sizes:
            return self.max_examples
        metrics = next(iter(message.content.metric_records.values()), None)
        partition = metrics.get("partition-id") if metrics is not None else None
        if not isinstance(partition, int | float) or int(partition) not in self.shard_sizes:
            return max(self.shard_sizes.values())
        return self.shard_sizes[int(partition)]

    @classmethod
    def spec_of(cls, record: ArrayRecord) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Expected name → (shape, dtype) of every reply, from the global model."""
        return {k: (tuple(v.shape), decode(v).dtype) for k, v in record.items()}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.round_offset
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.current = RoundStats(round=server_round, started=time.perf_counter())
        size = payload_bytes(arrays)
        for message in messages:
            self.current.bytes_sent[message.metadata.dst_node_id] = size
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.round_offset
        stats = self.current or RoundStats(round=server_round, started=time.perf_counter())
        valid: list[tuple[int, ArrayRecord, int]] = []
        for message in replies:
            node = message.metadata.src_node_id
            if message.has_error():
                stats.failed[node] = str(message.error.reason)
                log.error("round %d: node %d failed: %s", server_round, node, message.error.reason)
                continue
            reason = validate_reply(message.content, self.spec, max_examples=self.cap_for(message))
            if reason is not None:
                stats.rejected[node] = reason
                log.error("round %d: rejected the reply of node %d: %s", server_round, node, reason)
                continue
            record = next(iter(message.content.array_records.values()))
            reported = {
                k: float(v)
                for k, v in next(iter(message.content.metric_records.values())).items()
                if isinstance(v, int | float)
            }
            stats.bytes_received[node] = payload_bytes(record)
            stats.client_metrics[node] = reported
            valid.append((node, record, int(reported[NUM_EXAMPLES])))
        stats.attribute_lost_replies()
        self.history.append(stats)
        asked = max(len(stats.bytes_sent), len(valid) + len(stats.rejected) + len(stats.failed))
        needed = max(self.min_valid, math.ceil(self.min_valid_fraction * asked))
        if len(valid) < needed:
            log.error(
                "round %d: %d valid replies (%d failed, %d rejected) but %d are needed "
                "(fl.min_valid_replies / fl.min_valid_fraction); the global model is kept "
                "unchanged",
                server_round,
                len(valid),
                len(stats.failed),
                len(stats.rejected),
                needed,
            )
            return None, None
        valid.sort(key=lambda item: item[0])  # arrival order must not matter
        arrays = weighted_average([r for _, r, _ in valid], [n for _, _, n in valid])
        stats.aggregated = True
        summary = MetricRecord(
            {
                NUM_EXAMPLES: sum(n for _, _, n in valid),
                "train-loss": _finite(stats.weighted("train-loss")),
                "train-accuracy": _finite(stats.weighted("train-accuracy")),
            }
        )
        return arrays, summary


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
