"""A train message in, its reply out: the node's whole part of a round, wherever it runs.

The node's worker (:mod:`car_fl.client.worker`) calls :func:`answer_train` with its own node
configuration; ``client_app.py`` calls it in its own process when the node has no worker
(simulation). Everything node-level (paths, device, cache, the node's privacy) comes from
``node_config``, which must be the node's own, never a value the server sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import RecordDict

from car_fl.client.failures import Refusal
from car_fl.client.node_privacy import NodePrivacy
from car_fl.client.node_settings import node_settings
from car_fl.client.round import train_round
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import read_train_message, train_reply
from car_fl.settings.flower import NodeInfo


def answer_train(
    content: RecordDict,
    *,
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
    node_state: RecordDict,
    run: str,
) -> RecordDict:
    """The reply's content to a train message's ``content``.

    ``run_config`` is the run's configuration (the server's), ``node_config`` the node's own,
    ``node_state`` the node's state of this run (the DP state is kept there; updated in place),
    ``run`` Flower's run id (the node's privacy ledger keys its releases by it).
    """
    instruction = read_train_message(content)
    # Without the server's label map the node's own would size the head: whether the round
    # succeeds would then tell the label count. Refused the same way whatever the node holds
    if not instruction.labels:
        raise Refusal(
            Failure.CONFIG_MISMATCH,
            "the train message carries no label map; the node trains only with the server's",
        )
    # Configuration: the run's with this node's paths, checked against the server's (composed
    # in the node's first round, then read from memory or from its disk cache)
    settings = node_settings(run_config, node_config, instruction.fingerprint)
    node = NodeInfo.from_node_config(node_config, settings)
    # The node owner's privacy policy and lifetime ledger, from its own node config only
    guard = NodePrivacy.from_node_config(node_config)
    # Policy check, ledger, E local epochs from the global parameters, then the round's privacy
    state, metrics = train_round(
        settings,
        node,
        instruction.global_state,
        instruction.server_round,
        node_state,
        instruction.labels,
        guard=guard,
        run=run,
        layout=instruction.layout,
    )
    # The new parameters, the number of examples and the metrics a reply may carry
    return train_reply(state, metrics, dtype=settings.comm.dtype)
