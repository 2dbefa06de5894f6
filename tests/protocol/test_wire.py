"""car_fl.protocol.wire: a whole message's bytes, and no torch to read them."""

from __future__ import annotations

import subprocess
import sys

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from car_fl.protocol.wire import decode_content, encode_content


def test_a_message_round_trips_through_its_bytes() -> None:
    content = RecordDict(
        {"config": ConfigRecord({"run": "7", "labels": ["a", "b"]}), "m": MetricRecord({"n": 3})}
    )
    back = decode_content(encode_content(content))
    assert back.config_records["config"]["labels"] == ["a", "b"]
    assert back.metric_records["m"]["n"] == 3


def test_reading_a_message_imports_no_torch() -> None:
    code = "import sys, car_fl.protocol.wire; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
