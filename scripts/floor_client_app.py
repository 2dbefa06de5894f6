"""Flower's own per-round floor: a ClientApp that replies at once with what it was sent.

``scripts/bench_deploy.py`` runs it on the same SuperLink, SuperNodes and ServerApp as car-fl,
so that a round's cost with no client work at all is measured beside car-fl's. It imports
Flower and nothing else (not torch, not car-fl's modules), like the smallest ClientApp one could
write; its reply has the shape car-fl's server accepts (the global arrays, one example, and
the node's partition, which the server checks each reply's example count against).
"""

from __future__ import annotations

import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

#: The record names of :mod:`car_fl.protocol.messages` (not imported: it would import torch).
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    tick = time.perf_counter()
    arrays = msg.content.array_records[ARRAYS_KEY]
    partition = int(context.node_config["partition-id"])
    metrics = MetricRecord(
        {"num-examples": 1, "partition-id": partition, "train-seconds": time.perf_counter() - tick}
    )
    return Message(content=RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: metrics}), reply_to=msg)
