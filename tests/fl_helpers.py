"""Building Flower messages in tests, outside a run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from car_fl.protocol.messages import encode


def set_task_identity() -> None:
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0


def reply(
    node: int,
    arrays: Mapping[str, np.ndarray[Any, Any] | Array],
    num_examples: object,
    **metrics: float,
) -> Message:
    """A train reply from ``node`` carrying ``arrays`` (car-fl's wire format unless already
    ``Array`` s) and ``num-examples``."""
    set_task_identity()
    instruction = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    wire = {k: v if isinstance(v, Array) else encode(v) for k, v in arrays.items()}
    content = RecordDict(
        {
            "arrays": ArrayRecord(array_dict=wire),
            "metrics": MetricRecord({"num-examples": num_examples, **metrics}),  # type: ignore[dict-item]
        }
    )
    return Message(content=content, reply_to=instruction)
