"""DP-SGD steps on a client: Poisson sampling, per-example gradients, clipping, Gaussian noise.

One step (Abadi et al. 2016, with Poisson sampling as accounted in
:mod:`~car_fl.privacy.record_accounting`):

    B  = {i : uᵢ < q}, uᵢ ~ U(0, 1) from OS entropy              (Poisson sampling)
    gᵢ = ∇θ ℓ(θ; xᵢ, yᵢ)                                          (per-example gradients)
    g  = (Σᵢ∈B gᵢ · min(1, C/‖gᵢ‖) + N(0, σ²C²·I)) / (q·n)        (clip, sum, noise, normalise)

then the optimiser steps with g. ‖gᵢ‖ is over all trainable tensors, or per part with
``dp.adapter_clip`` (still ≤ C). Dividing by q·n, not the data-dependent |B|, keeps the step a
post-processing of the Gaussian mechanism. Per-example gradients: ``vmap(grad(...))`` over
cached features; through the frozen encoder, ghost norms (:mod:`car_fl.privacy.ghost`), else
autograd of one unpadded example at a time (Hugging Face's mask code defeats ``vmap``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from car_fl.privacy.accountant import check_sample_rate
from car_fl.privacy.ghost import ghost_clipped_sum, supports_ghost
from car_fl.privacy.mechanism import clip_per_example, gaussian_like, secure_generator

Tensors = dict[str, torch.Tensor]


def poisson_sample(
    n: int, rate: float, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices ``(k,)`` of one Poisson-sampled batch (maybe empty), from OS entropy unless
    ``generator`` is given: the server must not tell which examples a step used."""
    check_sample_rate(rate)
    gen = generator if generator is not None else secure_generator("cpu")
    draws = torch.rand(n, generator=gen, device=gen.device)
    return torch.nonzero(draws < rate).flatten().cpu()


def per_example_gradients(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    features: torch.Tensor,
) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
    """∇θ ℓ for every example of ``features`` ``(batch, d)``: ``{name: (batch, *shape)}``, plus
    each loss and each argmax. ``model`` returns ``(logits, loss)``."""

    def one_feature(
        p: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        logits, loss = functional_call(model, dict(p), (), {"features": x[None], "labels": y[None]})
        return loss, (loss.detach(), logits.detach().argmax(dim=-1))

    device = next(iter(params.values())).device
    if len(labels) == 0:
        empty = {
            k: torch.zeros((0, *v.shape), dtype=v.dtype, device=device) for k, v in params.items()
        }
        return empty, torch.zeros(0, device=device), torch.zeros(0, dtype=torch.long, device=device)
    grads, (losses, predicted) = vmap(
        grad(one_feature, has_aux=True), in_dims=(None, 0, 0), randomness="different"
    )(dict(params), features, labels)
    return grads, losses, predicted.flatten()


def noisy_gradient(
    summed: Mapping[str, torch.Tensor],
    *,
    noise_std: float,
    expected_batch_size: float,
    generator: torch.Generator | None = None,
) -> Tensors:
    """(Σ clipped gᵢ + N(0, noise_std²·I)) / (q·n); noise from OS entropy unless given."""
    if not expected_batch_size > 0:
        raise ValueError(f"the expected batch size q·n must be > 0, got {expected_batch_size}")
    if noise_std > 0:
        noise = gaussian_like(summed, std=noise_std, generator=generator)
        summed = {k: v + noise[k] for k, v in summed.items()}
    return {k: v / expected_batch_size for k, v in summed.items()}


#: Per-example gradients held at once by :func:`clipped_gradient_sum` (elements, ~256 MB).
CHUNK_ELEMENTS = 1 << 26


def clipped_gradient_sum(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    *,
    clip: float,
    adapter_clip: float | None = None,
    features: torch.Tensor | None = None,
    input_ids: Sequence[torch.Tensor] | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
    """Σᵢ gᵢ · min(1, C/‖gᵢ‖) over the batch, plus each loss and each argmax. Holds at most
    ``chunk_elements`` per-example gradient values: ``vmap`` over chunks, ghost norms for token ids
    where the model fits, else one example at a time."""
    if not clip > 0:
        raise ValueError(f"dp.clip (the per-example bound C) must be > 0, got {clip}")
    device = next(iter(params.values())).device
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    if len(labels) == 0:
        empty = torch.zeros(0, device=device)
        return total, empty, torch.zeros(0, dtype=torch.long, device=device)
    if input_ids is not None and supports_ghost(model, params):
        return ghost_clipped_sum(
            model, params, labels, input_ids, clip=clip, adapter_clip=adapter_clip
        )
    losses, predicted = [], []
    if input_ids is not None or getattr(model, "per_example_loop", False):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        for i in range(len(labels)):
            y = labels[i : i + 1].to(device)
            if input_ids is not None:
                ids = input_ids[i].to(device)[None]  # (1, seq): unpadded
                args: tuple[Any, ...] = (ids, torch.ones_like(ids))
                kwargs: dict[str, Any] = {"labels": y}
            else:
                assert features is not None
                args, kwargs = (), {"features": features[i : i + 1], "labels": y}
            logits, loss = functional_call(model, leaves, args, kwargs)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            used = {k: g[None] for k, g in zip(leaves, grads, strict=True) if g is not None}
            if used:  # no tensor the loss depends on: a zero gradient
                clipped, _ = clip_per_example(used, clip, adapter_clip)  # a batch of one
                for k, g in clipped.items():
                    total[k] += g[0]
            losses.append(loss.detach().reshape(1))
            predicted.append(logits.detach().argmax(dim=-1).reshape(1))
        return total, torch.cat(losses), torch.cat(predicted)
    if features is None:
        raise ValueError("clipped_gradient_sum needs features or input_ids")
    size = sum(v.numel() for v in params.values())
    chunk = max(1, chunk_elements // max(size, 1))
    for start in range(0, len(labels), chunk):
        chunk_grads, loss_part, pred_part = per_example_gradients(
            model, params, labels[start : start + chunk], features[start : start + chunk]
        )
        clipped, _ = clip_per_example(chunk_grads, clip, adapter_clip)
        for k, g in clipped.items():
            total[k] += g.sum(dim=0)
        losses.append(loss_part)
        predicted.append(pred_part)
    return total, torch.cat(losses), torch.cat(predicted)


@dataclass
class StepResult:
    """What one DP-SGD step saw (for the client's own log; never sent)."""

    examples: int
    loss_sum: float
    correct: int


def dpsgd_step(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    optimizer: Any,
    labels: torch.Tensor,
    *,
    clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    adapter_clip: float | None = None,
    features: torch.Tensor | None = None,
    input_ids: Sequence[torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    penalty: Callable[[], torch.Tensor | None] | None = None,
) -> StepResult:
    """One DP-SGD step on a sampled batch: noise std σ·C, set each ``.grad`` and step. ``penalty``
    depends on the parameters alone: its gradient is added unclipped to the noised one
    (post-processing, no ε)."""
    detached = {k: p.detach() for k, p in params.items()}
    summed, losses, predicted = clipped_gradient_sum(
        model,
        detached,
        labels,
        clip=clip,
        adapter_clip=adapter_clip,
        features=features,
        input_ids=input_ids,
    )
    update = noisy_gradient(
        summed,
        noise_std=noise_multiplier * clip if noise_multiplier > 0 else 0.0,
        expected_batch_size=expected_batch_size,
        generator=generator,
    )
    term = penalty() if penalty is not None else None
    if term is not None:
        with_grad = [k for k, p in params.items() if p.requires_grad]
        grads = torch.autograd.grad(term, [params[k] for k in with_grad], allow_unused=True)
        for name, g in zip(with_grad, grads, strict=True):
            if g is not None:
                update[name] = update[name] + g.to(update[name].device, update[name].dtype)
    for name, param in params.items():
        param.grad = update[name].to(param.dtype)
    optimizer.step()
    for param in params.values():
        param.grad = None
    return StepResult(
        examples=len(labels),
        loss_sum=float(losses.sum()),
        correct=int((predicted.cpu() == labels.cpu()).sum()),
    )
