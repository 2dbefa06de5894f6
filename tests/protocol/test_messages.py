"""What crosses the wire: raw tensors (no per-tensor header), comm.dtype, a cached client round."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from car_fl.protocol.messages import (
    ARRAYS_KEY,
    METRICS_KEY,
    RAW_STYPE,
    decode,
    encode,
    from_record,
    payload_bytes,
    to_record,
)
from car_fl.server.strategy import validate_reply
from car_fl.settings.compose import load_settings
from tests.reference import CaRFedAvg, weighted_average

STATE = {"head.classifier.weight": torch.randn(3, 8), "head.classifier.bias": torch.randn(3)}


def test_raw_arrays_carry_exactly_the_parameters_bytes() -> None:
    record = to_record(STATE)
    assert all(a.stype == RAW_STYPE for a in record.values())
    assert payload_bytes(record) == (24 + 3) * 4  # no .npy header per tensor
    npy = ArrayRecord(array_dict={k: Array(v.numpy()) for k, v in STATE.items()})
    assert payload_bytes(npy) > payload_bytes(record)
    back = from_record(record)
    assert list(back) == list(STATE)
    for name, value in STATE.items():
        assert torch.equal(back[name], value)
    assert np.array_equal(decode(npy["head.classifier.bias"]), STATE["head.classifier.bias"])


def test_float16_on_the_wire_halves_the_bytes_and_stays_close() -> None:
    half = to_record(STATE, dtype="float16")
    assert payload_bytes(half) * 2 == payload_bytes(to_record(STATE))
    back = from_record(half)
    assert back["head.classifier.weight"].dtype == torch.float16
    torch.testing.assert_close(
        back["head.classifier.weight"].float(),
        STATE["head.classifier.weight"],
        atol=2e-3,
        rtol=1e-3,
    )
    # aggregation is in float64 and returns the wire dtype and format
    avg = weighted_average([half, half], [1, 3])
    assert avg["head.classifier.bias"].stype == RAW_STYPE
    assert decode(avg["head.classifier.bias"]).dtype == np.float16


def test_comm_dtype_bfloat16_and_unknown_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"bfloat16 is not supported.*float16"):
        load_settings(["comm.dtype=bfloat16"])
    with pytest.raises(ValueError, match=r"comm\.dtype=.int8. is not valid"):
        load_settings(["comm.dtype=int8"])


def _reply(record: ArrayRecord) -> RecordDict:
    return RecordDict({ARRAYS_KEY: record, METRICS_KEY: MetricRecord({"num-examples": 5})})


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda a: Array(dtype=a.dtype, shape=a.shape, stype=RAW_STYPE, data=a.data[:-4]), "bytes"),
        (lambda a: Array(dtype="|O", shape=a.shape, stype=RAW_STYPE, data=a.data), "numeric"),
        (lambda a: Array(dtype="nonsense", shape=a.shape, stype=RAW_STYPE, data=a.data), "dtype"),
    ],
)
def test_malformed_raw_tensors_are_rejected_with_the_reason(tamper, reason: str) -> None:
    good = to_record(STATE)
    spec = CaRFedAvg.spec_of(good)
    assert validate_reply(_reply(good), spec) is None
    bad = ArrayRecord(
        array_dict={k: tamper(v) if k == "head.classifier.weight" else v for k, v in good.items()}
    )
    message = validate_reply(_reply(bad), spec)
    assert message is not None and "cannot be read" in message and reason in message


def test_raw_encoding_is_little_endian_whatever_the_input() -> None:
    big = np.arange(4, dtype=">f4")
    array = encode(big)
    assert array.dtype == "<f4" and array.data == np.arange(4, dtype="<f4").tobytes()
    assert np.array_equal(decode(array), big)
