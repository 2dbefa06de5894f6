"""What crosses the wire: trainable tensors as Flower ``ArrayRecord`` s, and their size.

Only the adapter (when trained) and the head travel; the encoder never leaves a machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from car_fl.settings import schema as config

ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
CONFIG_KEY = "config"
NUM_EXAMPLES = "num-examples"
#: Config key of a mixture of experts' layout (the server's clustering of the documents).
LAYOUT_KEY = "moe-layout"
#: Config key of the commit the server's Hub model resolved to: the nodes load that one.
COMMIT_KEY = "model-commit"


#: ``Array.stype`` of car-fl's tensors: raw little-endian C-order bytes, dtype and shape in the
#: ``Array``'s fields (no ``.npy`` header: the payload is exactly the parameters' bytes).
RAW_STYPE = "car_fl.raw"
#: The torch dtype of each ``comm.dtype`` (:data:`car_fl.settings.schema.WIRE_DTYPES`).
WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in config.WIRE_DTYPES}


def encode(values: np.ndarray[Any, Any], *, stype: str = RAW_STYPE) -> Array:
    """A NumPy array as a Flower ``Array``: raw bytes (``RAW_STYPE``) or ``.npy``."""
    if stype != RAW_STYPE:
        return Array(values)
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return Array(
        dtype=values.dtype.str, shape=tuple(values.shape), stype=RAW_STYPE, data=values.tobytes()
    )


def decode(array: Array) -> np.ndarray[Any, Any]:
    """A Flower ``Array`` (raw or ``.npy``) as a read-only array; ``ValueError`` if malformed."""
    if array.stype != RAW_STYPE:
        return array.numpy()
    try:
        dtype = np.dtype(array.dtype)
    except TypeError as err:
        raise ValueError(f"unknown dtype {array.dtype!r}") from err
    if dtype.kind not in "fiu":
        raise ValueError(f"dtype {array.dtype!r} is not numeric")
    shape = tuple(int(n) for n in array.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(array.data) != expected:
        raise ValueError(
            f"{len(array.data)} bytes for shape {shape} of {dtype} ({expected} expected)"
        )
    return np.frombuffer(array.data, dtype=dtype).reshape(shape)


def to_record(state: dict[str, torch.Tensor], *, dtype: str = "float32") -> ArrayRecord:
    """Trainable state dict → ``ArrayRecord`` of raw arrays in ``dtype`` (key order kept)."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"comm.dtype={dtype!r} is not supported; use {' or '.join(WIRE_DTYPES)}")
    wire = WIRE_DTYPES[dtype]
    return ArrayRecord(
        array_dict={
            k: encode(v.detach().to(device="cpu", dtype=wire).contiguous().numpy())
            for k, v in state.items()
        }
    )


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``ArrayRecord`` → state dict of CPU tensors (in the dtype they travelled in)."""
    return {k: torch.from_numpy(np.array(decode(v), copy=True)) for k, v in record.items()}


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
    #: A mixture of experts' layout as text (:class:`car_fl.heads.clustering.ExpertLayout`).
    layout: str | None = None
    #: The commit of the Hub model the server loaded (:func:`car_fl.model.sources.hub_commit`).
    commit: str | None = None


def read_train_message(content: RecordDict) -> TrainInstruction:
    """Global parameters, round number, configuration fingerprint, the global label map and
    the commit of the server's Hub model."""
    config = content.config_records[CONFIG_KEY]
    fingerprint = config.get("fingerprint")
    labels = config.get("labels")
    layout = config.get(LAYOUT_KEY)
    commit = config.get(COMMIT_KEY)
    return TrainInstruction(
        commit=str(commit) if commit is not None else None,
        layout=str(layout) if layout is not None else None,
        labels=tuple(str(x) for x in cast(list[str], labels)) if labels else None,
        global_state=from_record(content.array_records[ARRAYS_KEY]),
        server_round=int(cast(int, config["server-round"])),
        fingerprint=str(fingerprint) if fingerprint is not None else None,
    )


def train_reply(
    state: dict[str, torch.Tensor], metrics: dict[str, int | float], *, dtype: str = "float32"
) -> RecordDict:
    """The reply's content: the new parameters (in ``dtype``) and the metrics."""
    return RecordDict(
        {ARRAYS_KEY: to_record(state, dtype=dtype), METRICS_KEY: MetricRecord(dict(metrics))}
    )
