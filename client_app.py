"""car-fl ClientApp: hands the round to this node's worker, or runs it here when there is none.

With a worker (node config ``worker``) this process imports Flower and the standard library
only: the worker, started by the node's owner, keeps the node (``car_fl/client/node.py``) and
trains with the node's own configuration (``car_fl/client/worker.py``). Without one the round
runs here, by the node this process keeps for that node config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from car_fl.client import worker_link
from car_fl.client.failures import data_free

if TYPE_CHECKING:
    from car_fl.client.node import Node

app = ClientApp()
#: The nodes this process answers for (one in a deployment, where each message is a new
#: process; several in a simulation's process), by their node config.
NODES: dict[str, Node] = {}


@app.train()
@data_free  # a refusal or error reaches the server as a fixed code; details stay in this log
def train(msg: Message, context: Context) -> Message:
    folder = worker_link.worker_folder(context.node_config)
    if folder is not None:
        # The node's worker trains E local epochs (with its own node configuration) and replies
        content = worker_link.hand_over(
            folder,
            run_id=context.run_id,
            run_config=context.run_config,
            content=msg.content,
            policy=context.node_config.get(worker_link.POLICY_KEY),  # the worker checks its own
        )
    else:
        # No worker: the same round in this process, its DP state in Flower's context.state
        content = train_here(msg.content, context)
    # Reply with the new parameters, the number of examples and the train metrics
    return Message(content=content, reply_to=msg)


def train_here(content: RecordDict, context: Context) -> RecordDict:
    """The round in this process (imports torch and the model code: only here)."""
    from car_fl.client.node import ContextState, Node
    from car_fl.common.progress import setup_logging

    setup_logging()
    key = repr(sorted((str(k), str(v)) for k, v in context.node_config.items()))
    node = NODES.get(key) or NODES.setdefault(key, Node(dict(context.node_config)))
    return node.answer(  # the run's state: a copy, kept only if the round succeeds
        content,
        run_config=context.run_config,
        run=str(context.run_id),
        store=ContextState(context.state),
    )
