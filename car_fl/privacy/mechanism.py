"""The local DP mechanism as pure functions of tensors: norms, clipping, the noised release.

Send θ + min(1, C/‖Δ‖)·Δ + N(0, s²·I), Δ = θᵢ − θ over all sent tensors together or part by
part (:func:`privatize_parts`); also DP-SGD's per-example clipping (joint or per part).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from car_fl.privacy.noise import gaussian_like

State = Mapping[str, torch.Tensor]

#: A clipped tensor is scaled to C·(1 − 2⁻²²), not to C: the rounding of a float32 product
#: (2⁻²⁴ per element, as much again in the factor) then cannot carry its norm above C.
SHRINK = 1.0 - 2.0**-22

#: The adapter's tensors: ``dp.adapter_clip`` clips them apart from the head's.
ADAPTER_PREFIX = "adapter."
#: The full adapter's one tensor (adapter.kind=full), as the retriever names it.
ADAPTER_WEIGHT = f"{ADAPTER_PREFIX}weight"


def split_adapter(names: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of the adapter's tensors and of the rest (the head's), each in order."""
    names = tuple(names)
    adapter = tuple(k for k in names if k.startswith(ADAPTER_PREFIX))
    return adapter, tuple(k for k in names if not k.startswith(ADAPTER_PREFIX))


#: Device types without float64 (Apple's MPS). The sums that clipping rests on are made on the
#: CPU there, in float64: a float32 sum's rounding could carry a clipped norm above its bound,
#: by more than :data:`SHRINK` leaves room for.
NO_FLOAT64 = frozenset({"mps"})


def float64_device(device: torch.device) -> torch.device:
    """Where a tensor on ``device`` is summed in float64: ``device``, or the CPU."""
    return torch.device("cpu") if device.type in NO_FLOAT64 else device


def in_float64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64, on :func:`float64_device` of its device (moved, then widened)."""
    return tensor.to(float64_device(tensor.device)).double()


def flat_norm(tensors: State) -> float:
    """L2 norm of all tensors together, summed in float64 (on the CPU for MPS tensors)."""
    total = sum(float(in_float64(t.detach()).pow(2).sum()) for t in tensors.values())
    return math.sqrt(total)


def check_finite(tensors: State, *, who: str) -> None:
    """Raise ``FloatingPointError`` naming the first tensor with NaN or inf."""
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise FloatingPointError(
                f"{who}: the update of tensor {name!r} contains NaN or inf; it is neither "
                "clipped nor sent (lower train.lr or check the data)"
            )


def difference(after: State, before: State) -> dict[str, torch.Tensor]:
    return {k: after[k] - before[k] for k in before}


def clip_factor(norm: float, bound: float) -> float:
    """min(1, C/‖Δ‖) (times :data:`SHRINK` when it clips); 1 for a zero update or C = ∞."""
    if bound <= 0:
        raise ValueError(f"clipping bound must be > 0, got {bound}")
    return 1.0 if norm <= bound else bound * SHRINK / norm


def clip_factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """Per example, min(1, C/‖gᵢ‖) (times :data:`SHRINK` where it clips), and 0 where ‖gᵢ‖
    is not finite: such an example adds nothing, so it can neither poison the step nor fail
    the round (either would tell the server about it)."""
    factors = torch.where(norms > bound, bound * SHRINK / norms, torch.ones_like(norms))
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def record_part_bounds(clip: float, adapter_clip: float) -> tuple[float, float]:
    """DP-SGD's bounds per part: the adapter's to C_a = ``dp.adapter_clip``, the head's to
    √(C² − C_a²), so the whole gradient's norm, the sensitivity, is still at most C."""
    if not 0 < adapter_clip < clip:  # the settings check it first, naming the keys
        raise ValueError(f"the adapter's bound {adapter_clip:g} is not in (0, C={clip:g})")
    return adapter_clip, clip * math.sqrt(1.0 - (adapter_clip / clip) ** 2)  # no C² overflow


def record_clip_factors(
    adapter_squares: torch.Tensor,
    rest_squares: torch.Tensor,
    clip: float,
    adapter_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, the factors for its adapter's and its head's gradient: joint, or (with
    ``adapter_clip``) each part to its bound. Both 0 where either norm is not finite."""
    if adapter_clip is None:
        joint = clip_factors((adapter_squares + rest_squares).clamp(min=0).sqrt(), clip)
        return joint, joint
    adapter_bound, rest_bound = record_part_bounds(clip, adapter_clip)
    finite = torch.isfinite(adapter_squares) & torch.isfinite(rest_squares)
    zero = torch.zeros_like(adapter_squares)
    adapter = clip_factors(adapter_squares.clamp(min=0).sqrt(), adapter_bound)
    rest = clip_factors(rest_squares.clamp(min=0).sqrt(), rest_bound)
    return torch.where(finite, adapter, zero), torch.where(finite, rest, zero)


def scale_per_example(grads: State, factors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's row of every tensor times its factor, in float32 at least (bf16's
    rounding could carry a clipped row above its bound); exactly 0 where the factor is."""
    scaled = {}
    for k, g in grads.items():
        wide = g.to(torch.promote_types(g.dtype, torch.float32))
        shape = (-1, *([1] * (g.dim() - 1)))
        f = factors.to(wide.dtype).to(wide.device).view(shape)  # narrowed where float64 is
        scaled[k] = torch.where(f > 0, wide * f, torch.zeros_like(wide))
    return scaled


def per_example_squares(
    grads: Mapping[str, torch.Tensor], names: Sequence[str] | None = None
) -> torch.Tensor:
    """Σ ‖gᵢ‖² over the tensors ``names`` (default: all): ``(batch,)``, in float64."""
    names = list(grads) if names is None else list(names)
    first = next(iter(grads.values()))
    device = float64_device(first.device)
    total = torch.zeros(len(first), dtype=torch.float64, device=device)
    for k in names:
        total = total + in_float64(grads[k].flatten(1)).pow(2).sum(dim=1)
    return total


def per_example_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """‖gᵢ‖ over all tensors together: ``(batch,)``, in float64."""
    return per_example_squares(grads).sqrt()


def clip_per_example(
    grads: Mapping[str, torch.Tensor], bound: float, adapter_bound: float | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """gᵢ · min(1, C/‖gᵢ‖) for every example (parts apart with ``adapter_bound``), and the
    norms before clipping. A non-finite gradient becomes zero (:func:`clip_factors`)."""
    if not bound > 0:
        raise ValueError(f"dp.clip (the per-example bound C) must be > 0, got {bound}")
    adapter, rest = split_adapter(grads)
    adapter_squares = per_example_squares(grads, adapter)
    rest_squares = per_example_squares(grads, rest)
    factors = record_clip_factors(
        adapter_squares, rest_squares, bound, adapter_bound if adapter else None
    )
    scaled = scale_per_example({k: grads[k] for k in adapter}, factors[0])
    scaled.update(scale_per_example({k: grads[k] for k in rest}, factors[1]))
    return {k: scaled[k] for k in grads}, (adapter_squares + rest_squares).sqrt()


def privatize(
    before: State,
    after: State,
    *,
    bound: float,
    std: float,
    generator: torch.Generator | None = None,
    delta: State | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """θ + clip(θᵢ − θ, C) + N(0, std²·I); returns the release and ‖Δ‖ before clipping.
    ``generator`` is for tests only. Without clipping or noise θᵢ comes back exactly."""
    if not std >= 0:
        raise ValueError(f"noise standard deviation must be >= 0, got {std}")
    delta = delta if delta is not None else difference(after, before)
    norm = flat_norm(delta)
    factor = clip_factor(norm, bound)
    if std == 0 and factor == 1.0:
        return {k: v.detach().clone() for k, v in after.items()}, norm
    if std == 0:
        return {k: before[k] + delta[k] * factor for k in before}, norm
    # the noise joins the clipped Δ before θ is added: θ + (…) rounds only a noised value, so
    # no rounding of θ + clipped Δ reaches the server un-noised
    noise = gaussian_like(dict(delta), std=std, generator=generator)
    return {k: before[k] + (delta[k] * factor + noise[k]) for k in before}, norm


@dataclass(frozen=True)
class Part:
    """Tensors clipped together to ``bound`` and noised with ``std`` per coordinate."""

    names: tuple[str, ...]
    bound: float
    std: float


def privatize_parts(
    before: State,
    after: State,
    parts: Sequence[Part],
    *,
    generator: torch.Generator | None = None,
    delta: State | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`privatize` of each part on its own (the parts cover every tensor once); together
    one Gaussian release of z⁻² = Σ z_g⁻² (:func:`~car_fl.privacy.accountant.combined_multiplier`).
    """
    delta = delta if delta is not None else difference(after, before)
    named = [name for part in parts for name in part.names]
    if sorted(named) != sorted(before):
        raise ValueError(f"parts {named} do not cover the tensors {sorted(before)} once each")
    released: dict[str, torch.Tensor] = {}
    for part in parts:
        out, _ = privatize(
            {k: before[k] for k in part.names},
            {k: after[k] for k in part.names},
            bound=part.bound,
            std=part.std,
            generator=generator,
            delta={k: delta[k] for k in part.names},
        )
        released.update(out)
    return {k: released[k] for k in before}
