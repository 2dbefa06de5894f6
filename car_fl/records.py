"""What crosses the wire: trainable tensors as Flower ``ArrayRecord`` s, and their size.

Only the adapter (when trained) and the head travel; the encoder never leaves a machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
CONFIG_KEY = "config"
NUM_EXAMPLES = "num-examples"


def to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """Trainable state dict → ``ArrayRecord`` (numpy copies, key order kept)."""
    return ArrayRecord(
        array_dict={k: Array(v.detach().cpu().contiguous().numpy()) for k, v in state.items()}
    )


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``ArrayRecord`` → state dict of CPU tensors."""
    return {k: torch.from_numpy(np.array(v.numpy(), copy=True)) for k, v in record.items()}


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of tensor data in the record (what the parameters cost on the wire)."""
    return int(sum(len(array.data) for array in record.values()))


@dataclass(frozen=True)
class TrainInstruction:
    """What a train message from the server carries."""

    global_state: dict[str, torch.Tensor]
    server_round: int
    fingerprint: str | None
    labels: tuple[str, ...] | None = None


def read_train_message(content: RecordDict) -> TrainInstruction:
    """Global parameters, round number, configuration fingerprint and the global label map."""
    config = content.config_records[CONFIG_KEY]
    fingerprint = config.get("fingerprint")
    labels = config.get("labels")
    return TrainInstruction(
        labels=tuple(str(x) for x in cast(list[str], labels)) if labels else None,
        global_state=from_record(content.array_records[ARRAYS_KEY]),
        server_round=int(cast(int, config["server-round"])),
        fingerprint=str(fingerprint) if fingerprint is not None else None,
    )


def train_reply(state: dict[str, torch.Tensor], metrics: dict[str, int | float]) -> RecordDict:
    """The reply's content: the new parameters and the metrics (with ``num-examples``)."""
    return RecordDict({ARRAYS_KEY: to_record(state), METRICS_KEY: MetricRecord(dict(metrics))})
