"""Hostile clients: what a poisoning node may send instead of its honest reply.

Each attack rewrites the honest reply of one partition in a ClientApp handler.

- ``huge``: every value 3e30 (finite, so only shape/dtype/finite checks cannot catch it);
- ``scale50``: the update scaled ×50, θ + 50·(θᵢ − θ);
- ``signflip10``: the update sign-flipped ×10, θ − 10·(θᵢ − θ);
- ``broadcast``: the largest tensor in NumPy's ``.npy`` format whose metadata gives the right
  shape but whose payload has shape (1,), a value that would broadcast into every cell;
- ``overclaim``: the honest parameters claiming 1000× its examples.
"""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO
from typing import Any, cast

import numpy as np
from flwr.app import Array, Context, Message

from car_fl.protocol.messages import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES, decode, encode
from car_fl.settings.compose import PARTITION_ID

Arrays = dict[str, np.ndarray[Any, Any]]


def _huge(reply: Arrays, _global: Arrays) -> Arrays:
    return {k: np.full_like(v, 3e30) for k, v in reply.items()}


def _scaled(factor: float) -> Callable[[Arrays, Arrays], Arrays]:
    def attack(reply: Arrays, global_: Arrays) -> Arrays:
        return {
            k: (global_[k].astype(np.float64) + factor * (v.astype(np.float64) - global_[k]))
            .astype(v.dtype)
            .copy()
            for k, v in reply.items()
        }

    return attack


#: Attacks on the parameters: (honest reply, global model) → what is sent.
PARAMETER_ATTACKS: dict[str, Callable[[Arrays, Arrays], Arrays]] = {
    "huge": _huge,
    "scale50": _scaled(50.0),
    "signflip10": _scaled(-10.0),
}
ATTACKS = ("none", *PARAMETER_ATTACKS, "broadcast", "overclaim")


def npy_with_lying_shape(value: float, *, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """A ``.npy`` Array whose metadata says ``shape`` but whose payload has shape (1,)."""
    buffer = BytesIO()
    np.save(buffer, np.array([value], dtype=dtype), allow_pickle=False)
    return Array(dtype=str(dtype), shape=shape, stype="numpy.ndarray", data=buffer.getvalue())


def poison(reply: Message, instruction: Message, attack: str) -> Message:
    """``reply`` (this client's honest reply to ``instruction``) rewritten by ``attack``."""
    if attack not in ATTACKS:
        raise ValueError(f"attack={attack!r} is not known; choose one of {', '.join(ATTACKS)}")
    if attack == "none" or reply.has_error():
        return reply
    record = reply.content.array_records[ARRAYS_KEY]
    honest = {k: decode(v) for k, v in record.items()}
    if attack in PARAMETER_ATTACKS:
        global_ = {k: decode(v) for k, v in instruction.content.array_records[ARRAYS_KEY].items()}
        for name, values in PARAMETER_ATTACKS[attack](honest, global_).items():
            record[name] = encode(values)
    elif attack == "broadcast":
        name = max(honest, key=lambda k: honest[k].size)
        values = honest[name]
        record[name] = npy_with_lying_shape(1e3, shape=values.shape, dtype=values.dtype)
    else:  # overclaim
        metrics = reply.content.metric_records[METRICS_KEY]
        metrics[NUM_EXAMPLES] = 1000 * int(cast(int, metrics[NUM_EXAMPLES]))
    return reply


def hostile_client(
    honest: Callable[[Message, Context], Message], *, attack: str, partition: int = 1
) -> Callable[[Message, Context], Message]:
    """A ClientApp train handler that runs ``honest`` and poisons ``partition``'s reply."""

    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if int(context.node_config[PARTITION_ID]) == partition:
            return poison(reply, msg, attack)
        return reply

    return train
