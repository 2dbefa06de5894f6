"""What a valid train reply is, and the conversions the guarded strategy makes of replies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from car_fl.protocol.messages import NUM_EXAMPLES, RAW_STYPE, decode

Spec = Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]


def validate_reply(
    content: Any,
    spec: Spec,
    *,
    max_examples: int | None = None,
    optional: frozenset[str] | set[str] = frozenset(),
) -> str | None:
    """``None`` if a train reply may be aggregated, else the reason it may not. Exactly the tensors
    of ``spec`` (those in ``optional`` may be left out), checked on the decoded values, in car-fl's
    wire format only (a ``.npy`` payload can disagree with its metadata)."""
    arrays = content.array_records
    metrics = content.metric_records
    if len(arrays) != 1 or len(metrics) != 1:
        return (
            f"expected one ArrayRecord and one MetricRecord, got {len(arrays)} and {len(metrics)}"
        )
    record = next(iter(arrays.values()))
    missing = sorted(set(spec) - set(record) - set(optional))
    extra = sorted(set(record) - set(spec))
    if missing or extra:
        return f"tensor names differ from the global model: missing {missing}, extra {extra}"
    for name, (shape, dtype) in spec.items():
        if name not in record:  # an optional tensor left out
            continue
        array = record[name]
        if array.stype != RAW_STYPE:
            return f"tensor {name!r} is in format {array.stype!r}; only {RAW_STYPE!r} is accepted"
        try:
            values = decode(array)
        except ValueError as err:
            return f"tensor {name!r} cannot be read: {err}"
        if values.shape != shape:
            return f"tensor {name!r} has shape {values.shape}, expected {shape}"
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


def spec_of(record: ArrayRecord) -> Spec:
    """Expected name → (shape, dtype) of every reply, from the global model."""
    return {k: (tuple(v.shape), decode(v).dtype) for k, v in record.items()}


def as_float64(arrays: Mapping[str, np.ndarray[Any, Any]]) -> ArrayRecord:
    """Arrays as Flower's own NumPy arrays in float64: what Flower's strategies compute on."""
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float64)) for k, v in arrays.items()})
