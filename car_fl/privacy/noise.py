"""Noise for DP releases, drawn from OS entropy, on the parameters' device and dtype.

A curious server knows the run's seed, every round number, node id and partition id, so
noise derived from them could be regenerated and subtracted. Every generator here is seeded
from the operating system's CSPRNG (:mod:`secrets`), fresh for each release; nothing in the
configuration influences it. Tests that need exact values pass a generator of their own.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import torch


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with 63 bits of OS entropy."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(secrets.randbits(63))
    return generator


def seed_from_entropy() -> None:
    """Seed torch's global RNG (dropout's) with 63 bits of OS entropy: under DP-SGD a mask
    drawn from a seed the server knows, in a batch whose shape depends on the other records,
    would let one record change another's gradient beyond the clipping bound."""
    torch.manual_seed(secrets.randbits(63))


def gaussian_like(
    like: Mapping[str, torch.Tensor],
    *,
    std: float,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """N(0, std²·I) like ``like``: drawn in float32 (float64 for float64 tensors) on each
    tensor's device, then cast; a fresh :func:`secure_generator` per device unless given."""
    if not std >= 0:
        raise ValueError(f"noise standard deviation must be >= 0, got {std}")
    generators: dict[torch.device, torch.Generator] = {}
    out = {}
    for name, tensor in like.items():
        device = tensor.device
        if generator is not None:
            gen = generator
        elif device in generators:
            gen = generators[device]
        else:
            gen = generators[device] = secure_generator(device)
        draw_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        noise = torch.randn(tensor.shape, generator=gen, dtype=draw_dtype, device=device)
        out[name] = (noise * std).to(tensor.dtype)
    return out
