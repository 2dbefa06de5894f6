"""What a node sends of a mixture of experts: under DP, never a choice that depends on its data.

Every tensor it was sent goes back, trained or not; only ``moe.send=routed`` without DP leaves
out the experts its queries never reached (checked again here, whatever the server ships).
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
