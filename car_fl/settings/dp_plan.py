"""What a configuration's DP implies: each release's noise, its DP-SGD plan, the ε of k rounds.

The run's DP mode (:mod:`car_fl.settings.dp_modes`) gives the figures; both parties use them,
so the server computes each client's ε from its own settings, never from a client's claim.
"""

from __future__ import annotations

from car_fl.privacy.accountant import Release, ReleaseKind
from car_fl.settings.dp_modes.adaptive import sigma_b
from car_fl.settings.dp_modes.record import record_plan
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_modes.spec import ClientLevel, accounted_examples, local_steps
from car_fl.settings.schema import DPConfig, NormBoundMode, Settings

__all__ = ["accounted_examples", "local_steps", "record_plan", "sigma_b"]


def check_mode(settings: Settings) -> None:
    """The rules of ``dp.mode`` on composed ``settings`` (``ValueError`` naming the key and
    the fix), its noise plan included (a target ε that cannot be reached), before any work."""
    mode = MODES[settings.dp.mode]
    mode.check(settings.dp)
    mode.check_settings(settings)
    dp, rounds = settings.dp, settings.fl.rounds
    if dp.enabled and dp.warmup_rounds >= rounds:
        raise ValueError(
            f"dp.warmup_rounds={dp.warmup_rounds} covers all fl.rounds={rounds}: no round would "
            f"be private under dp={dp.mode}; set dp.warmup_rounds below fl.rounds (or dp=none)"
        )
    if settings.fl.norm_bound is NormBoundMode.DP and not mode.bounds_replies(settings.dp):
        raise ValueError(
            "fl.norm_bound=dp derives the bound from fixed DP clipped once per round; it "
            f"needs dp=fixed and dp.granularity=round (got dp.mode={settings.dp.mode}, "
            f"dp.granularity={settings.dp.granularity}); use fl.norm_bound=adaptive or fixed"
        )
    mode.check_plan(settings)


def non_private_reason(cfg: DPConfig) -> str | None:
    """Why this configuration's releases are not differentially private, or None."""
    return MODES[cfg.mode].non_private_reason(cfg)


def update_multiplier(cfg: DPConfig, num_clients: int) -> float:
    """The noise std over the clipping bound of a client-level update (σ₀, or z_Δ)."""
    spec = MODES[cfg.mode]
    if isinstance(spec, ClientLevel):
        return spec.update_multiplier(cfg, num_clients)
    return cfg.noise_multiplier


def fixed_noise_std(cfg: DPConfig) -> float:
    """The noise std of a ``dp=fixed`` release, σ₀·C (0 without noise, also with C = ∞)."""
    return 0.0 if cfg.noise_multiplier == 0 else cfg.noise_multiplier * cfg.clip


def active(cfg: DPConfig, server_round: int) -> bool:
    """Whether a release in ``server_round`` is made under DP (a mode, and not a warm-up)."""
    return cfg.enabled and server_round > cfg.warmup_rounds


def dp_active(settings: Settings, server_round: int) -> bool:
    """Whether a client's release in ``server_round`` is made under DP (not a warm-up)."""
    return active(settings.dp, server_round)


def noise_floor_multiplier(settings: Settings) -> float:
    """The σ a node's policy floor compares (DP-SGD's calibrated σ, else σ₀ or z)."""
    return MODES[settings.dp.mode].noise_floor(settings)


def public_examples(settings: Settings) -> int:
    """The example count a reply carries once DP is active: ``fl.max_examples_per_client``, or
    1; public, so a node's true n (data-dependent, never noised) never leaves it."""
    return settings.fl.max_examples_per_client or 1


def per_step(settings: Settings) -> bool:
    """Whether each optimizer step is a release (client-level DP, ``dp.granularity=step``)."""
    return MODES[settings.dp.mode].per_step(settings.dp)


def round_release(settings: Settings, *, server_round: int, examples: int) -> Release:
    """What one client's reply in ``server_round`` releases, for accounting, with ``examples``
    the n the round is accounted for (the node's own; on the server, the public cap)."""
    return MODES[settings.dp.mode].release(settings, server_round=server_round, examples=examples)


def local_release(
    dp: DPConfig, num_clients: int, count: int = 1, *, active: bool = True
) -> Release:
    """``count`` client-level releases as every party accounts them: one Gaussian of
    multiplier μ each, or non-private (``dp=none``, a warm-up round, a non-private rule)."""
    spec = MODES[dp.mode]
    if isinstance(spec, ClientLevel):
        return spec.releases(dp, num_clients, count, active=active)
    return Release(ReleaseKind.NON_PRIVATE, count)
