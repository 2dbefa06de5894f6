"""Reference implementations the tests check car-fl against (not used by car-fl itself)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.func import functional_call

from car_fl.privacy.mechanism import State, clip_factor, flat_norm
from car_fl.protocol.messages import decode, encode
from car_fl.server.strategy import GuardedStrategy, Spec


def clip(delta: State, bound: float) -> tuple[dict[str, torch.Tensor], float]:
    """Δ scaled to norm at most ``bound``; also returns ‖Δ‖ before clipping."""
    norm = flat_norm(delta)
    factor = clip_factor(norm, bound)
    if factor == 1.0:
        return {k: v.clone() for k, v in delta.items()}, norm
    return {k: v * factor for k, v in delta.items()}, norm


def weighted_average(records: list[ArrayRecord], weights: list[int]) -> ArrayRecord:
    """θ = Σ nᵢ/n · θᵢ, accumulated in float64, returned in each tensor's own dtype."""
    total = float(sum(weights))
    out: dict[str, Array] = {}
    for name in records[0]:
        first = records[0][name]
        acc = np.zeros(first.shape, dtype=np.float64)
        for record, weight in zip(records, weights, strict=True):
            acc += decode(record[name]).astype(np.float64) * (weight / total)
        out[name] = encode(acc.astype(decode(first).dtype))
    return ArrayRecord(array_dict=out)


class CaRFedAvg(GuardedStrategy):
    """Flower's FedAvg behind car-fl's guards: what ``strategy=fedavg`` builds."""

    def __init__(self, *, min_clients: int = 1, spec: Spec, **guards: Any) -> None:
        super().__init__(FedAvg(), spec=spec, min_clients=min_clients, **guards)


def token_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    input_ids: Sequence[torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """∇θ ℓ of each unpadded token-id example by its own backward (the definition DP-SGD's
    batched paths are checked against): ``{name: (batch, *shape)}``, each loss, each argmax."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    rows, losses, predicted = [], [], []
    device = next(iter(params.values())).device
    for ids, y in zip(input_ids, labels, strict=True):
        one, y = ids.to(device)[None], y.to(device)
        args = (one, torch.ones_like(one))
        logits, loss = functional_call(model, leaves, args, {"labels": y[None]})
        grads = torch.autograd.grad(loss, list(leaves.values()))
        rows.append(dict(zip(leaves, grads, strict=True)))
        losses.append(loss.detach())
        predicted.append(logits.detach().argmax(dim=-1).flatten())
    stacked = {k: torch.stack([r[k] for r in rows]) for k in params}
    return stacked, torch.stack(losses), torch.cat(predicted)
