"""The server's bound on a reply's update norm ‖θᵢ − θ‖: replies above it are rejected or clipped.

Modes (``fl.norm_bound``): ``fixed`` (``fl.max_update_norm``), ``adaptive``
(``fl.norm_bound_factor`` × the round's lower median update norm: of two replies the smaller,
so a scaled update cannot raise its own bound), ``dp`` (under fixed DP per round: the clipped
update's bound plus a high quantile of the noise norm, each part's with ``dp.adapter_clip``; no
user input), ``off``; ``auto`` picks ``dp`` under fixed DP per round, else ``fixed`` when
``fl.max_update_norm`` is set, else ``off``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import fixed_noise_std
from car_fl.settings.schema import (
    DPConfig,
    NormBoundAction,
    NormBoundMode,
    Settings,
)

Arrays = Mapping[str, np.ndarray[Any, Any]]


def update_norm(reply: Arrays, reference: Arrays) -> float:
    """‖θᵢ − θ‖ over all tensors together, in float64; ``inf`` when it is not finite."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for name, values in reference.items():
            diff = np.asarray(reply[name], dtype=np.float64) - values.astype(np.float64)
            total += float(np.square(diff).sum())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clip_update(reply: Arrays, reference: Arrays, *, bound: float, norm: float) -> dict[str, Any]:
    """θ + (θᵢ − θ) · bound/‖θᵢ − θ‖ in float64 (the reply itself when it is within the bound)."""
    if norm <= bound:
        return {k: np.asarray(v, dtype=np.float64) for k, v in reply.items()}
    factor = bound / norm
    return {
        k: reference[k].astype(np.float64) + (reply[k].astype(np.float64) - reference[k]) * factor
        for k in reference
    }


def gaussian_norm_quantile(*, parts: Sequence[tuple[float, int]], tail: float) -> float:
    """An upper bound on the 1 − ``tail`` quantile of ‖X‖, X Gaussian with independent parts of
    ``(std, dim)`` each. The norm is max(std)-Lipschitz in standard noise and
    E‖X‖ ≤ √(Σ dim·std²), so by Gaussian concentration P(‖X‖ ≥ √(Σ dim·std²) + max(std)·t)
    ≤ exp(−t²/2); t = √(2 ln(1/tail))."""
    if not parts or any(std < 0 or dim < 1 for std, dim in parts) or not 0 < tail < 1:
        raise ValueError(f"need parts of std >= 0, dim >= 1, and 0 < tail < 1; got {parts}, {tail}")
    mean = math.sqrt(sum(dim * std**2 for std, dim in parts))
    return mean + max(std for std, _ in parts) * math.sqrt(2.0 * math.log(1.0 / tail))


def released_parts(dp: DPConfig, *, dim: int, adapter_dim: int) -> list[tuple[float, float, int]]:
    """``(clip, noise std, dim)`` of each part a ``dp=fixed`` reply is released in, as the
    client clips and noises them (:meth:`car_fl.client.local_dp.ClientPrivacy.scaled`): one,
    or with ``dp.adapter_clip`` the adapter at its bound and the head at ``dp.clip``, each
    with its share of the noise."""
    std, clip_a = fixed_noise_std(dp), dp.adapter_clip
    if clip_a is None or adapter_dim == 0:
        return [(dp.clip, std, dim)]
    if adapter_dim == dim:  # the adapter alone (MIPS): its own bound, all of the noise
        return [(clip_a, dp.noise_multiplier * clip_a, dim)]
    share = dp.adapter_share
    return [
        (clip_a, dp.noise_multiplier * clip_a / math.sqrt(share), adapter_dim),
        (dp.clip, std / math.sqrt(1.0 - share), dim - adapter_dim),
    ]


def resolve_mode(settings: Settings) -> NormBoundMode:
    """``fl.norm_bound`` with ``auto`` resolved (see the module docstring)."""
    mode = settings.fl.norm_bound
    if mode is not NormBoundMode.AUTO:
        return mode
    if MODES[settings.dp.mode].bounds_replies(settings.dp):
        return NormBoundMode.DP
    return NormBoundMode.FIXED if settings.fl.max_update_norm is not None else NormBoundMode.OFF


@dataclass(frozen=True)
class NormBound:
    """How the server bounds ‖θᵢ − θ‖ in each round."""

    mode: NormBoundMode = NormBoundMode.OFF
    #: The bound itself (``fixed``, ``dp``); unused by ``adaptive``.
    value: float | None = None
    factor: float = 3.0
    action: NormBoundAction = NormBoundAction.REJECT
    #: Rounds without the bound (``dp``: the DP warm-up, when clients do not clip).
    from_round: int = 1
    #: Relative rounding of the wire dtype (``dp``: the bound allows for it).
    wire_eps: float = 0.0

    @classmethod
    def from_settings(cls, settings: Settings, *, dim: int, adapter_dim: int = 0) -> NormBound:
        """The bound for a run whose replies have ``dim`` parameters in all, ``adapter_dim``
        of them the adapter's."""
        fl, dp = settings.fl, settings.dp
        mode = resolve_mode(settings)
        value, from_round = fl.max_update_norm, 1
        if mode is NormBoundMode.DP:  # the clipped update, plus the noise's quantile
            parts = released_parts(dp, dim=dim, adapter_dim=adapter_dim)
            noise = gaussian_norm_quantile(parts=[p[1:] for p in parts], tail=fl.norm_bound_tail)
            value = math.sqrt(sum(clip**2 for clip, _, _ in parts)) + noise
            from_round = dp.warmup_rounds + 1
        return cls(
            mode=mode,
            value=value,
            factor=fl.norm_bound_factor,
            action=fl.norm_bound_action,
            from_round=from_round,
            wire_eps=float(np.finfo(np.dtype(settings.comm.dtype)).eps),
        )

    def bound(
        self, server_round: int, norms: Sequence[float], *, reference_norm: float = 0.0
    ) -> float | None:
        """This round's bound given the update norms of its (otherwise valid) replies."""
        if self.mode is NormBoundMode.OFF or server_round < self.from_round:
            return None
        if self.mode is NormBoundMode.ADAPTIVE:
            finite = [n for n in norms if math.isfinite(n)]  # the lower median: of two
            return self.factor * statistics.median_low(finite) if finite else None  # the less
        assert self.value is not None
        if (
            self.mode is NormBoundMode.DP
        ):  # the reply's rounding to the wire dtype may add up to ε·‖θᵢ‖
            return self.value + self.wire_eps * (reference_norm + self.value)
        return self.value
