"""car-fl ClientApp: E local epochs of CaR training on this node's shard."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from car_fl.client.node_settings import node_settings
from car_fl.client.round import train_round
from car_fl.common.logs import setup_logging
from car_fl.protocol.messages import read_train_message, train_reply
from car_fl.settings.flower import NodeInfo

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    setup_logging()
    instruction = read_train_message(msg.content)
    # Configuration: the run's with this node's data/model paths, checked against the server's
    # (composed in the node's first round, then read from its disk cache)
    settings = node_settings(context.run_config, context.node_config, instruction.fingerprint)
    node = NodeInfo.from_node_config(context.node_config, settings)
    # E local epochs from the global parameters, then local DP (its state in context.state)
    state, metrics = train_round(
        settings,
        node,
        instruction.global_state,
        instruction.server_round,
        context.state,
        instruction.labels,
        layout=instruction.layout,
    )
    # Reply with the new parameters, the number of examples and the train metrics
    return Message(content=train_reply(state, metrics, dtype=settings.comm.dtype), reply_to=msg)
