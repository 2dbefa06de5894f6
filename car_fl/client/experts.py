"""What a node sends of a mixture of experts: under DP, never a choice that depends on its data.

The node trains the experts it was sent (:meth:`~car_fl.heads.experts.MixtureHead.set_available`).
Under any DP mode, and with ``moe.send=all`` or ``schedule``, it sends back every tensor it was
sent, trained or not (under DP each one noised by the release), so the set of tensors is a
function of the server's message alone. Only ``moe.send=routed`` without DP leaves out the
experts its queries never reached. The settings refuse ``routed`` under DP; this module checks
again on the node, whatever configuration the server ships.
"""

from __future__ import annotations

import torch

from car_fl.heads.experts import EXPERT_PREFIX, MixtureHead
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.schema import ExpertSending, Settings


def tensors_to_send(model: CaRRetriever, settings: Settings) -> dict[str, torch.Tensor]:
    """The trainable tensors this node sends (before any DP release)."""
    state = model.trainable_state_dict()
    head = model.head
    routed = settings.moe.send is ExpertSending.ROUTED and not settings.dp.enabled
    if not isinstance(head, MixtureHead) or not routed:
        return state
    return {
        name: value
        for name, value in state.items()
        if not name.startswith(EXPERT_PREFIX) or int(name[len(EXPERT_PREFIX) :]) in head.touched
    }
