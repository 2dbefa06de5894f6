"""DP-SGD through the frozen encoder from batched passes: per-example clipping by ghost norms.

The adapter is the only trainable module before pooling and acts token by token, so one
batched backward gives each example's ``gₜ = ∂ℓᵢ/∂aₜ``; each adapter kind turns ``x`` and ``g``
into per-example norms and a clipped sum (the full one by ghost clipping, Li et al. 2022:
‖Gᵢ‖² = Σₜ,ₛ (gₜ·gₛ)(xₜ·xₛ)). The result equals the per-example loop's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from car_fl.privacy.mechanism import (
    ADAPTER_PREFIX,
    in_float64,
    per_example_squares,
    record_clip_factors,
    scale_per_example,
)

Tensors = dict[str, torch.Tensor]

#: Examples per batched pass (the LM's activations for this many are held at once).
CHUNK = 32


def supports_ghost(model: nn.Module, params: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``model`` fits: its trainable tensors are the adapter and tensors on pooled
    features only, and its examples cannot interact in a padded batch (DP's sensitivity
    argument), so only models taking position ids and the mask, with no remote code."""
    if not getattr(model, "has_encoder", False) or getattr(model, "per_example_loop", True):
        return False
    adapter = adapter_names(model)
    if not adapter & set(params) or getattr(model.head, "index_uses_adapter", True):
        return False
    encoder: Any = getattr(model, "encoder", None)
    if not getattr(encoder, "_takes_position_ids", False):
        return False
    if getattr(encoder.cfg, "trust_remote_code", True):
        return False
    return all(k in adapter or not k.startswith(("_encoder.", ADAPTER_PREFIX)) for k in params)


def adapter_names(model: Any) -> set[str]:
    """The names of the retriever's adapter tensors, as its trainable state names them."""
    adapter = getattr(model, "adapter", None)
    if adapter is None:
        return set()
    return {ADAPTER_PREFIX + k for k, _ in adapter.named_parameters()}


def ghost_clipped_sum(
    model: Any,
    params: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    input_ids: Sequence[torch.Tensor],
    *,
    clip: float,
    adapter_clip: float | None = None,
    chunk: int = CHUNK,
) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
    """Σᵢ gᵢ · min(1, C/‖gᵢ‖) over the batch, each loss and each argmax, in the input order.
    ``params`` must hold the model's current values. A non-finite example contributes zero."""
    if not clip > 0:
        raise ValueError(f"dp.clip (the per-example bound C) must be > 0, got {clip}")
    device = next(iter(params.values())).device
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    if len(labels) == 0:
        empty = torch.zeros(0, device=device)
        return total, empty, torch.zeros(0, dtype=torch.long, device=device)
    order = sorted(range(len(labels)), key=lambda i: len(input_ids[i]))  # less padding
    losses, predicted = [], []
    for start in range(0, len(order), chunk):
        rows = order[start : start + chunk]
        batch = [input_ids[i].tolist() for i in rows]
        part, loss, pred = _chunk(model, params, labels[rows].to(device), batch, clip, adapter_clip)
        for k, v in part.items():
            total[k] += v
        losses.append(loss)
        predicted.append(pred)
    back = torch.argsort(torch.tensor(order, device=device))  # into the input order
    return total, torch.cat(losses)[back], torch.cat(predicted)[back]


def _chunk(
    model: Any,
    params: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    batch: list[list[int]],
    clip: float,
    adapter_clip: float | None,
) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
    encoder, adapter = model.encoder, model.adapter
    adapted_names = adapter_names(model)
    head = {k: v.detach() for k, v in params.items() if k not in adapted_names}
    dtype = next(adapter.parameters()).dtype
    ids, mask = encoder.pad(batch)
    with torch.no_grad():
        embedded = encoder.embed(ids)  # frozen TKN
        real = mask[..., None].bool()
        x = torch.where(real, embedded.to(dtype), 0.0)  # (b, t, d), pads zero (even NaN)
        affine = adapter.affine(x)
    adapted = affine.requires_grad_(True)  # the adapter's output, a leaf
    # dropout on the soft embeddings (training) after the leaf: g is then the gradient of the
    # example's loss through its own mask, as in the per-example definition
    soft = adapter.dropout(adapted)
    features = encoder.pool(encoder.transform(soft.to(embedded.dtype), mask), mask)

    def one(
        p: Mapping[str, torch.Tensor], f: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        logits, loss = functional_call(model, dict(p), (), {"features": f[None], "labels": y[None]})
        return loss, (loss.detach(), logits.detach().argmax(dim=-1))

    (head_grads, feature_grads), (loss, pred) = vmap(
        grad(one, argnums=(0, 1), has_aux=True), in_dims=(None, 0, 0), randomness="different"
    )(head, features.detach(), labels)
    # every example's ∂ℓᵢ/∂fᵢ back through TRF at once: row i of the result is ∂ℓᵢ/∂aᵢ
    (out_grads,) = torch.autograd.grad(features, adapted, grad_outputs=feature_grads)
    # float64: the Gram products can cancel; g zero at pads (a pad changes no real state)
    g64 = in_float64(out_grads)
    g64 = torch.where(real.to(g64.device), g64, 0.0)
    x64 = in_float64(x)
    adapter_squares = adapter.example_squares(x64, g64)
    head_squares = (
        per_example_squares(head_grads) if head_grads else torch.zeros_like(adapter_squares)
    )
    adapter_factors, head_factors = record_clip_factors(
        adapter_squares, head_squares, clip, adapter_clip
    )
    keep = (adapter_factors > 0).view(-1, 1, 1)
    g64 = torch.where(keep, g64, 0.0)
    x64 = torch.where(keep, x64, 0.0)  # 0 · NaN is NaN: drop the example's inputs too
    # summed in float64: float32 sums over the tokens could carry an example above C_a
    summed: Tensors = {}
    for name, value in adapter.clipped_sum(adapter_factors, x64, g64).items():
        target = params[ADAPTER_PREFIX + name]
        summed[ADAPTER_PREFIX + name] = value.to(target.dtype).to(target.device)  # narrowed first
    for k, g in scale_per_example(head_grads, head_factors).items():
        summed[k] = g.sum(dim=0)
    return summed, loss.flatten(), pred.flatten()
