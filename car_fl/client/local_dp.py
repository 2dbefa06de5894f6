"""One client's local DP (``dp=fixed|adaptive``, or none): its state, each release, its ε.

The state (clipping bound Cᵢ, the EMA of update norms for the linear rule, the releases made
so far) lives in Flower's persistent per-node ``context.state`` as a ``MetricRecord``, so it
survives rounds in simulation and in deployment. Nothing un-noised leaves the client once DP
is active: :meth:`ClientPrivacy.metrics` holds only ε and the public count of releases, and
all noise comes from OS entropy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from car_fl.method import encoder as encoder_module
from car_fl.method.model import CaRRetriever
from car_fl.method.optim import Optimizer
from car_fl.method.train import EpochResult, train_epoch
from car_fl.privacy.accountant import (
    combined_multiplier,
    epsilon,
    indicator_multiplier,
    release_multiplier,
)
from car_fl.privacy.adaptive import (
    bound_noise_std,
    clipped_indicator,
    geometric_clip,
    linear_clip,
    paper_sigma_b,
    smoothed_norm,
    update_noise_multiplier,
)
from car_fl.privacy.mechanism import State, check_finite, difference, flat_norm, privatize
from car_fl.privacy.noise import gaussian_like
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import AdaptiveRule, DPConfig, DPMode, Granularity, NoiseRule, Settings

log = logging.getLogger(__name__)

STATE_KEY = "dp-state"

_WARNED: set[str] = set()


class PrivacyBudgetExhausted(RuntimeError):
    """The next release would spend more than ``dp.target_epsilon``."""


@dataclass
class DPState:
    """What a client must remember between rounds."""

    clip: float
    ema: float | None = None
    releases: dict[float, int] = field(default_factory=dict)

    def to_record(self) -> MetricRecord:
        multipliers = sorted(self.releases)
        return MetricRecord(
            {
                "clip": self.clip,
                "ema": -1.0 if self.ema is None else self.ema,
                "multipliers": [float(m) for m in multipliers],
                "counts": [int(self.releases[m]) for m in multipliers],
            }
        )

    @classmethod
    def from_record(cls, record: Any) -> DPState:
        ema = float(record["ema"])
        multipliers = [float(m) for m in record.get("multipliers", [])]
        counts = [int(c) for c in record.get("counts", [])]
        return cls(
            clip=float(record["clip"]),
            ema=None if ema < 0 else ema,
            releases=dict(zip(multipliers, counts, strict=True)),
        )


def sigma_b(cfg: DPConfig, num_clients: int) -> float:
    """σ_b: ``dp.count_noise``, or the paper's m/20 when it is null."""
    return cfg.count_noise if cfg.count_noise is not None else paper_sigma_b(num_clients)


def non_private_reason(cfg: DPConfig) -> str | None:
    """Why this configuration's releases are not differentially private, or None."""
    if cfg.mode is not DPMode.ADAPTIVE:
        return None
    if cfg.adaptive_rule is AdaptiveRule.LINEAR:
        return "dp.adaptive_rule=linear moves the clipping bound with the raw update norm"
    if cfg.noise_rule is NoiseRule.BOUND:
        return "dp.noise_rule=bound sets the noise from the raw update norm"
    return None


class ClientPrivacy:
    """Clips and noises one client's releases, adapts its bound, and accounts for them.

    ``generator`` is test-only: a ``torch.Generator`` that replaces the OS-entropy noise so a
    test can know exact values. Runs never pass one, and nothing in the run configuration
    can set it.
    """

    def __init__(
        self,
        cfg: DPConfig,
        *,
        num_clients: int,
        client: int,
        state: DPState,
        generator: torch.Generator | None = None,
    ) -> None:
        self.cfg = cfg
        self.mode = cfg.mode
        self.client = client
        self.state = state
        self.generator = generator
        self.rule = cfg.adaptive_rule
        self.sigma_b = sigma_b(cfg, num_clients)
        self.z_delta = (
            update_noise_multiplier(cfg.noise_multiplier, self.sigma_b)
            if self.mode is DPMode.ADAPTIVE
            else None
        )
        self.not_private = non_private_reason(cfg)
        if self.not_private and self.not_private not in _WARNED:
            _WARNED.add(self.not_private)
            log.warning("%s: not differentially private, ε is reported as inf", self.not_private)

    @classmethod
    def initial_state(cls, cfg: DPConfig) -> DPState:
        return DPState(clip=cfg.clip)

    def active(self, server_round: int) -> bool:
        """DP is on, and the warm-up rounds are over."""
        return self.mode is not DPMode.NONE and server_round > self.cfg.warmup_rounds

    def noise_std(self, norm: float) -> float:
        """Standard deviation of this release's noise, with the current bound."""
        if self.cfg.noise_multiplier == 0:  # also with C = ∞, where 0·C would be NaN
            return 0.0
        if self.mode is DPMode.FIXED:
            return self.cfg.noise_multiplier * self.cfg.clip
        assert self.z_delta is not None
        if self.cfg.noise_rule is NoiseRule.BOUND:
            return bound_noise_std(
                self.z_delta,
                self.state.clip,
                norm,
                rate=self.cfg.update_rate,
                target=self.cfg.target_quantile,
            )
        return self.z_delta * self.state.clip

    def multiplier(self, std: float, bound: float) -> float:
        """The noise multiplier this release is accounted as; 0 (ε = ∞) when not private."""
        if self.not_private:
            return 0.0
        update = release_multiplier(std, bound)
        if self.mode is DPMode.ADAPTIVE:  # the geometric rule also releases b̃ᵢ
            if std > 0 and self.z_delta is not None:
                # z_Δ·Cᵢ / (2Cᵢ) is z_Δ/2: computed directly, no rounding that varies with Cᵢ
                # (ε must not differ in its last digits between clients with other data)
                update = self.z_delta / 2.0
            return combined_multiplier(update, indicator_multiplier(self.sigma_b))
        return update

    def epsilon(self) -> float:
        return epsilon(self.state.releases, self.cfg.delta)

    def release(
        self, before: State, after: State, *, server_round: int, step: int = 0
    ) -> dict[str, torch.Tensor]:
        """Clip θᵢ − θ to the current bound, add noise, account, then adapt the bound."""
        who = f"client {self.client}"
        delta = difference(after, before)
        check_finite(delta, who=who)
        bound = self.state.clip
        norm = flat_norm(delta)
        std = self.noise_std(norm)
        planned = dict(self.state.releases)
        multiplier = self.multiplier(std, bound)
        planned[multiplier] = planned.get(multiplier, 0) + 1
        if self.cfg.target_epsilon is not None:
            would = epsilon(planned, self.cfg.delta)
            if would > self.cfg.target_epsilon:
                raise PrivacyBudgetExhausted(
                    f"{who} stops contributing: its next release would bring ε to {would:.4g} "
                    f"> dp.target_epsilon = {self.cfg.target_epsilon:g} (δ = {self.cfg.delta:g})"
                )
        released, _ = privatize(
            before, after, bound=bound, std=std, generator=self.generator, delta=delta
        )
        self.state.releases = planned
        if self.mode is DPMode.ADAPTIVE:
            self.state.clip = self.next_clip(bound, norm)
        # Stays on this machine: the client's own log, never the reply.
        log.debug(
            "%s round %d step %d: C %.4g -> %.4g, noise std %.4g",
            who,
            server_round,
            step,
            bound,
            self.state.clip,
            std,
        )
        return released

    def noised_indicator(self, norm: float, bound: float) -> float:
        """b̃ᵢ = 1[‖Δ‖ ≤ Cᵢ] + N(0, σ_b²), the noise from OS entropy."""
        draw = gaussian_like(
            {"b": torch.zeros(1, dtype=torch.float64)}, std=self.sigma_b, generator=self.generator
        )
        return clipped_indicator(norm, bound) + float(draw["b"])

    def next_clip(self, bound: float, norm: float) -> float:
        """The bound for the next release, by ``dp.adaptive_rule``."""
        if self.rule is AdaptiveRule.GEOMETRIC:
            return geometric_clip(
                bound,
                self.noised_indicator(norm, bound),
                lr=self.cfg.clip_lr,
                target=self.cfg.target_quantile,
            )
        self.state.ema = smoothed_norm(self.state.ema, norm, self.cfg.ema_decay)
        return linear_clip(
            bound, self.state.ema, rate=self.cfg.update_rate, target=self.cfg.target_quantile
        )

    def metrics(self) -> dict[str, float]:
        """What the client may report: ε so far and the (public) number of releases."""
        return {
            "dp-epsilon": self.epsilon(),
            "dp-releases": float(sum(self.state.releases.values())),
        }


class StepPrivatizer:
    """Per-step granularity (Algorithm 1): privatize each optimizer step's change in place."""

    def __init__(
        self, privacy: ClientPrivacy, params: dict[str, torch.nn.Parameter], server_round: int
    ) -> None:
        self.privacy = privacy
        self.params = params
        self.server_round = server_round
        self.step = 0
        self.previous = {k: p.detach().clone() for k, p in params.items()}

    def __call__(self, _model: object) -> None:
        current = {k: p.detach() for k, p in self.params.items()}
        released = self.privacy.release(
            self.previous, current, server_round=self.server_round, step=self.step
        )
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(released[name])
        self.previous = {k: v.clone() for k, v in released.items()}
        self.step += 1


def load_privacy(settings: Settings, node: NodeInfo, node_state: RecordDict) -> ClientPrivacy:
    """This client's DP mechanism, with its state from earlier rounds (if any)."""
    record = node_state.metric_records.get(STATE_KEY)
    state = (
        DPState.from_record(record)
        if record is not None
        else ClientPrivacy.initial_state(settings.dp)
    )
    return ClientPrivacy(
        settings.dp, num_clients=settings.fl.clients, client=node.partition_id, state=state
    )


class LocalDPRound:
    """A round's epochs and release under local DP (or none).

    Plain epochs (FedProx's term included); under ``dp.granularity=step`` each optimizer step is
    privatised in place, else the round's update is clipped and noised once at the end. Before
    ``dp.warmup_rounds`` have passed, or with ``dp=none``, nothing is privatised.
    """

    def __init__(
        self,
        settings: Settings,
        node: NodeInfo,
        node_state: RecordDict,
        *,
        server_round: int,
        global_state: Mapping[str, torch.Tensor],
    ) -> None:
        self.settings, self.server_round, self.global_state = settings, server_round, global_state
        self.who = f"client {node.partition_id}"
        self.privacy = load_privacy(settings, node, node_state)
        self.private = self.privacy.active(server_round)
        self.per_step = self.private and settings.dp.granularity is Granularity.STEP
        self._hook: StepPrivatizer | None = None

    def check(self, examples: int) -> None:
        """Nothing to check before training: a target ε is checked at the release."""

    def epoch(
        self,
        model: CaRRetriever,
        data: Any,
        optimizer: Optimizer,
        *,
        seed: int,
        epoch: int,
        desc: str,
    ) -> EpochResult:
        if self.per_step and self._hook is None:
            self._hook = StepPrivatizer(
                self.privacy, model.trainable_parameters(), self.server_round
            )
        return train_epoch(
            model,
            data,
            optimizer,
            batch_size=self.settings.train.batch_size,
            seed=seed,
            epoch=epoch,
            progress=self.settings.progress,
            desc=desc,
            after_step=self._hook,
            prox_mu=self.settings.strategy.prox_mu,  # FedProx: μ/2·‖θ − θ_global‖²
            anchor=self.global_state,
        )

    def release(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What leaves: the round's update clipped and noised once (unless per step or off)."""
        check_finite(difference(state, self.global_state), who=self.who)
        if self.private and not self.per_step:
            return self.privacy.release(self.global_state, state, server_round=self.server_round)
        return state

    def save(self, node_state: RecordDict) -> None:
        node_state[STATE_KEY] = self.privacy.state.to_record()

    def describe(self, result: EpochResult) -> str:
        return f"train loss {result.loss:.4f} acc {result.accuracy:.4f}"

    def reply_metrics(self) -> dict[str, int | float]:
        """The process's facts and the privacy figures: nothing data-dependent."""
        return {
            "encoder-loads": encoder_module.LOAD_COUNT,
            "torch-threads": torch.get_num_threads(),
            "dp-active": int(self.private),
            **self.privacy.metrics(),
        }
