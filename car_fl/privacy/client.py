"""One client's local DP: its state across rounds, each release, and the ε it has spent.

The state (clipping bound Cᵢ, the EMA of update norms, the releases made so far) lives in
Flower's persistent per-node ``context.state`` as a ``MetricRecord``, so it survives rounds in
simulation and in deployment. Nothing un-noised leaves the client once DP is active.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import MetricRecord

from car_fl.config import DPConfig, DPMode
from car_fl.privacy.accountant import epsilon, release_multiplier
from car_fl.privacy.mechanism import (
    State,
    bound_noise_std,
    check_finite,
    difference,
    flat_norm,
    next_clip,
    noise_generator,
    privatize,
    smoothed_norm,
    update_noise_multiplier,
)

log = logging.getLogger(__name__)

STATE_KEY = "dp-state"


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


class ClientPrivacy:
    """Clips and noises one client's releases and accounts for them."""

    def __init__(
        self, cfg: DPConfig, *, num_clients: int, seed: int, client: int, state: DPState
    ) -> None:
        self.cfg = cfg
        self.mode = DPMode(cfg.mode)
        self.seed = seed
        self.client = client
        self.state = state
        self.z_delta = (
            update_noise_multiplier(cfg.noise_multiplier, num_clients)
            if self.mode is DPMode.ADAPTIVE
            else None
        )
        self.last_clip = state.clip

    @classmethod
    def initial_state(cls, cfg: DPConfig) -> DPState:
        return DPState(clip=cfg.clip)

    def active(self, server_round: int) -> bool:
        """DP is on, and the warm-up rounds are over."""
        return self.mode is not DPMode.NONE and server_round > self.cfg.warmup_rounds

    def noise_std(self, norm: float) -> float:
        """Standard deviation of this release's noise, with the current bound."""
        if self.mode is DPMode.FIXED:
            return self.cfg.noise_multiplier * self.cfg.clip
        assert self.z_delta is not None
        if self.cfg.noise_rule == "bound":
            return bound_noise_std(
                self.z_delta,
                self.state.clip,
                norm,
                rate=self.cfg.update_rate,
                target=self.cfg.target_quantile,
            )
        return self.z_delta * self.state.clip

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
        multiplier = release_multiplier(std, bound)
        planned = dict(self.state.releases)
        planned[multiplier] = planned.get(multiplier, 0) + 1
        if self.cfg.target_epsilon is not None:
            would = epsilon(planned, self.cfg.delta)
            if would > self.cfg.target_epsilon:
                raise PrivacyBudgetExhausted(
                    f"{who} stops contributing: its next release would bring ε to {would:.4g} "
                    f"> dp.target_epsilon = {self.cfg.target_epsilon:g} (δ = {self.cfg.delta:g})"
                )
        generator = noise_generator(
            seed=self.seed, client=self.client, round=server_round, step=step
        )
        released, _ = privatize(
            before, after, bound=bound, std=std, generator=generator, delta=delta
        )
        self.state.releases = planned
        self.last_clip = bound
        if self.mode is DPMode.ADAPTIVE:
            self.state.ema = smoothed_norm(self.state.ema, norm, self.cfg.ema_decay)
            self.state.clip = next_clip(
                bound, self.state.ema, rate=self.cfg.update_rate, target=self.cfg.target_quantile
            )
        log.debug(
            "%s round %d step %d: norm %.4g, C %.4g -> %.4g, noise std %.4g",
            who,
            server_round,
            step,
            norm,
            bound,
            self.state.clip,
            std,
        )
        return released

    def metrics(self) -> dict[str, float]:
        """What the client reports: ε so far, the bound it used and the one it will use."""
        return {
            "dp-epsilon": self.epsilon(),
            "dp-releases": float(sum(self.state.releases.values())),
            "dp-clip": self.last_clip,
            "dp-next-clip": self.state.clip,
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
