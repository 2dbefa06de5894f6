"""scripts/floor_client_app.py: the empty ClientApp's reply passes the server's checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from flwr.app import Context, Message, RecordDict

from car_fl.protocol.messages import ARRAYS_KEY, METRICS_KEY, to_record
from car_fl.server.strategy import ShardClaims, spec_of, validate_reply
from tests.helpers import load_script, set_task_identity


def test_floor_reply_is_accepted_by_the_server() -> None:
    floor = load_script("floor_client_app")
    set_task_identity()
    arrays = to_record({"head.weight": torch.ones(4, 8), "head.bias": torch.zeros(4)})
    msg = Message(content=RecordDict({ARRAYS_KEY: arrays}), dst_node_id=7, message_type="train")
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    reply = floor.train(msg, context).content
    assert (floor.ARRAYS_KEY, floor.METRICS_KEY) == (ARRAYS_KEY, METRICS_KEY)
    # as GuardedStrategy._check does: the claimed partition first, then the reply itself
    cap, reason = ShardClaims({0: 100, 1: 100}).cap_for(7, reply[METRICS_KEY].get("partition-id"))
    assert (cap, reason) == (100, None)
    assert validate_reply(reply, spec_of(arrays), max_examples=cap) is None


def test_the_floor_clientapp_imports_flower_only() -> None:
    """The empty ClientApp measures Flower's cost alone: no torch, no car-fl module."""
    code = "import sys, floor_client_app; print(sorted(sys.modules))"
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=scripts, capture_output=True, text=True, check=True
    )
    modules = {m.split(".")[0] for m in json.loads(out.stdout.replace("'", '"'))}
    assert "flwr" in modules
    assert not {"torch", "omegaconf", "transformers"} & modules
