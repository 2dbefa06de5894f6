"""Building Flower messages in tests, outside a run."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity


def set_task_identity() -> None:
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0


def reply(
    node: int, arrays: dict[str, np.ndarray], num_examples: object, **metrics: float
) -> Message:
    """A train reply from ``node`` carrying ``arrays`` and ``num-examples``."""
    set_task_identity()
    instruction = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    content = RecordDict(
        {
            "arrays": ArrayRecord(array_dict={k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": num_examples, **metrics}),  # type: ignore[dict-item]
        }
    )
    return Message(content=content, reply_to=instruction)
