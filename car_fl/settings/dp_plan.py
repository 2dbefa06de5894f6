"""What a configuration's DP implies: each release's noise, its DP-SGD plan, the ε of k rounds.

The schema (:mod:`car_fl.settings.schema`) checks what it can without the accountant; this
module asks :mod:`car_fl.privacy` for the figures a configuration implies. Both parties use
it: a client to noise and account for its releases, the server to compute each client's ε
itself from the settings it sent and the releases it received (it never has to trust a
client's claim). For ``dp=record`` σ is calibrated for ``dp.target_epsilon`` over
``fl.rounds`` × ``fl.local_epochs`` × ⌈1/q⌉ steps, so that :func:`check` fails before any work
for a target that cannot be reached.
"""

from __future__ import annotations

import math

from car_fl.privacy.accountant import (
    Release,
    ReleaseKind,
    combined_multiplier,
    indicator_multiplier,
)
from car_fl.privacy.adaptive import paper_sigma_b, update_noise_multiplier
from car_fl.privacy.record_accounting import RecordPlan
from car_fl.privacy.record_accounting import record_plan as _plan
from car_fl.settings.schema import (
    AdaptiveRule,
    DPConfig,
    DPMode,
    Granularity,
    NoiseRule,
    Settings,
)


def record_plan(settings: Settings) -> RecordPlan:
    """The DP-SGD plan of ``dp=record`` settings (σ calibrated for a target ε, cached)."""
    dp, fl = settings.dp, settings.fl
    return _plan(
        sample_rate=dp.sample_rate,
        noise_multiplier=dp.noise_multiplier,
        clip=dp.clip,
        delta=dp.delta,
        target_epsilon=dp.target_epsilon,
        rounds=fl.rounds,
        local_epochs=fl.local_epochs,
    )


def check_record_plan(settings: Settings) -> None:
    """Raise ``ValueError`` (naming the key) when the record-level DP plan cannot be made."""
    if settings.dp.mode is DPMode.RECORD:
        record_plan(settings)


def sigma_b(cfg: DPConfig, num_clients: int) -> float:
    """σ_b: ``dp.count_noise``, or the paper's m/20 when it is null."""
    return cfg.count_noise if cfg.count_noise is not None else paper_sigma_b(num_clients)


def non_private_reason(cfg: DPConfig) -> str | None:
    """Why this configuration's local-DP releases are not differentially private, or None."""
    if not cfg.enabled:
        return "dp=none adds no noise"
    if cfg.mode is DPMode.RECORD:
        return None
    if cfg.noise_multiplier == 0:
        return f"dp={cfg.mode.value} with dp.noise_multiplier=0 adds no noise"
    if cfg.mode is not DPMode.ADAPTIVE:
        return None
    if cfg.adaptive_rule is AdaptiveRule.LINEAR:
        return "dp.adaptive_rule=linear moves the clipping bound with the raw update norm"
    if cfg.noise_rule is NoiseRule.BOUND:
        return "dp.noise_rule=bound sets the noise from the raw update norm"
    return None


def local_multiplier(cfg: DPConfig, num_clients: int) -> float:
    """μ of one local-DP release (``dp=fixed|adaptive``); 0 (ε = ∞) when it is not private.

    fixed: σ₀/2 (noise σ₀·C, sensitivity 2C); adaptive (geometric): the update (z_Δ/2) and
    the clipped-indicator (σ_b) composed into one Gaussian, z/2 up to rounding.
    """
    if non_private_reason(cfg) is not None:
        return 0.0
    if cfg.mode is not DPMode.FIXED and cfg.mode is not DPMode.ADAPTIVE:
        raise ValueError(f"dp={cfg.mode.value} makes no local-DP release")
    update = update_multiplier(cfg, num_clients) / 2.0
    if cfg.mode is DPMode.FIXED:
        return update
    return combined_multiplier(update, indicator_multiplier(sigma_b(cfg, num_clients)))


def update_multiplier(cfg: DPConfig, num_clients: int) -> float:
    """The noise multiplier of a local-DP update (noise std over the clipping bound): σ₀
    (``dp=fixed``), z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (``dp=adaptive``, whose clipped-indicator
    takes the rest of z's budget)."""
    if cfg.mode is DPMode.ADAPTIVE:
        return update_noise_multiplier(cfg.noise_multiplier, sigma_b(cfg, num_clients))
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
    """The σ a node's policy floor compares: DP-SGD's calibrated σ (``dp=record``), else the
    run's ``dp.noise_multiplier`` (σ₀, or z)."""
    if settings.dp.mode is DPMode.RECORD:
        return record_plan(settings).noise_multiplier
    return settings.dp.noise_multiplier


def local_steps(settings: Settings, examples: int) -> int:
    """Optimizer steps of one round of ``fl.local_epochs`` epochs over ``examples`` examples."""
    return settings.fl.local_epochs * math.ceil(examples / settings.train.batch_size)


def public_examples(settings: Settings) -> int:
    """The example count a reply carries once DP is active: public, the same for every node.

    ``fl.max_examples_per_client`` when the run sets it, else 1 (every DP reply weighs the
    same in FedAvg). The node's true n never leaves it under DP: it is data-dependent (with
    ``fl.partitioning=dirichlet`` one record's label moves it), and nothing noises it.
    """
    return settings.fl.max_examples_per_client or 1


def per_step(settings: Settings) -> bool:
    """Whether each optimizer step is a release (local DP with ``dp.granularity=step``)."""
    dp = settings.dp
    return dp.mode not in (DPMode.NONE, DPMode.RECORD) and dp.granularity is Granularity.STEP


def accounted_examples(settings: Settings, examples: int) -> int:
    """The n a per-step round is trained and accounted for: ``fl.max_examples_per_client``
    when set (a node trains on at most that many and accounts for exactly that many, so the
    number of releases is public), else the node's own n."""
    return settings.fl.max_examples_per_client or examples


def round_release(settings: Settings, *, server_round: int, examples: int) -> Release:
    """What one client's reply in ``server_round`` releases, for accounting.

    ``examples`` is the n the round is accounted for (the node's own n on the node; the public
    cap on the server, which never uses a claimed count): under ``dp.granularity=step`` each
    of the round's optimizer steps is a release, as many as :func:`accounted_examples` gives
    (the public ``fl.max_examples_per_client`` when set, whatever the shard holds). Under
    ``dp=none``, a warm-up round or a non-private rule the release is ``non-private``.
    """
    dp = settings.dp
    if dp.mode is DPMode.RECORD:
        plan = record_plan(settings)
        return Release(
            ReleaseKind.DPSGD,
            plan.steps_per_round,
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
        )
    stepwise = dp.enabled and dp.granularity is Granularity.STEP
    count = local_steps(settings, accounted_examples(settings, examples)) if stepwise else 1
    active = dp_active(settings, server_round)
    return local_release(dp, settings.fl.clients, count, active=active)


def local_release(
    dp: DPConfig, num_clients: int, count: int = 1, *, active: bool = True
) -> Release:
    """``count`` local-DP releases (``dp=fixed|adaptive``) as every party accounts them: one
    Gaussian of multiplier μ each (:func:`local_multiplier`), or non-private (``dp=none``, a
    warm-up round, a non-private rule). The client steps its accountant with it, the server
    with :func:`round_release`, which calls it."""
    mu = local_multiplier(dp, num_clients) if active and dp.enabled else 0.0
    if mu == 0:
        return Release(ReleaseKind.NON_PRIVATE, count)
    return Release(ReleaseKind.GAUSSIAN, count, noise_multiplier=mu)
