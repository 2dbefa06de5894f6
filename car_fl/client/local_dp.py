"""One client's local DP (``dp=fixed|adaptive``, or none): its state, each release, its ε, and
a round under it (:class:`LocalDPRound`: its epochs and its one release).

The state (Cᵢ, the EMA, the releases) survives rounds in the run's state. Once DP is active
nothing un-noised leaves; whether a round fails must not depend on the data, so an update with
NaN or inf is released as a zero update (noise only).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from car_fl.client.failures import RunTargetReached
from car_fl.model import encoder as encoder_module
from car_fl.model.retriever import CaRRetriever
from car_fl.privacy.accountant import Accountant, Release, ReleaseKind
from car_fl.privacy.mechanism import (
    Part,
    State,
    check_finite,
    difference,
    flat_norm,
    gaussian_like,
    privatize,
    privatize_parts,
    secure_generator,
    split_adapter,
)
from car_fl.settings.compose import NodeInfo
from car_fl.settings.dp_modes.adaptive import (
    bound_noise_std,
    clipped_indicator,
    geometric_clip,
    linear_clip,
    smoothed_norm,
)
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_modes.spec import ClientLevel
from car_fl.settings.dp_plan import (
    accounted_examples,
    active,
    fixed_noise_std,
    local_release,
    local_steps,
    non_private_reason,
    sigma_b,
    update_multiplier,
)
from car_fl.settings.schema import AdaptiveRule, DPConfig, Granularity, NoiseRule, Settings
from car_fl.training.train import EpochResult, train_epoch

log = logging.getLogger(__name__)


class LocalDPRound:
    """A round's epochs and release under local DP (or none). Per step (``dp.granularity=step``)
    each optimizer step is privatised in place, else the update is noised once at the end. Under
    DP a diverging round releases what it has. Per step, every accounted release is made (steps
    not taken as zero updates with their noise), so the update carries nothing about how many
    steps ran."""

    def __init__(
        self,
        settings: Settings,
        node: NodeInfo,
        node_state: RecordDict,
        *,
        server_round: int,
        global_state: Mapping[str, torch.Tensor],
        max_clip: float = math.inf,
    ) -> None:
        self.settings, self.server_round, self.global_state = settings, server_round, global_state
        self.who = f"client {node.partition_id}"
        self.privacy = load_privacy(settings, node, node_state, max_clip=max_clip)
        self.private = self.privacy.active(server_round)
        self.per_step = self.private and settings.dp.granularity is Granularity.STEP
        self._hook: StepPrivatizer | None = None
        self.examples = 0
        self.diverged = False

    def refuse_past_target(self, examples: int) -> None:
        """The run's target ε for this round's releases, before any training."""
        self.examples = accounted_examples(self.settings, examples) if self.per_step else examples
        if self.private:
            self.privacy.check_target(self.planned_releases)

    @property
    def planned_releases(self) -> int:
        return local_steps(self.settings, self.examples) if self.per_step else 1

    def epoch(
        self,
        model: CaRRetriever,
        data: Any,
        optimizer: torch.optim.Optimizer,
        *,
        seed: int,
        epoch: int,
        desc: str,
    ) -> EpochResult:
        if self.per_step and self._hook is None:
            self._hook = StepPrivatizer(
                self.privacy, model.trainable_parameters(), self.server_round
            )
        if self.diverged or len(data) == 0:  # nothing (more) to learn from
            return EpochResult(loss=math.nan, accuracy=math.nan, examples=0, steps=0)
        if self.per_step and len(data) > self.examples:  # at most the accounted n, at random
            chosen = torch.randperm(len(data), generator=secure_generator())[: self.examples]
            data = data.select(sorted(chosen.tolist()))
        try:
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
        except FloatingPointError as err:
            if not self.private:
                raise
            log.warning("%s: %s; the round releases what it had, clipped and noised", self.who, err)
            self.diverged = True
            return EpochResult(loss=math.nan, accuracy=math.nan, examples=0, steps=0)

    def release(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What leaves: the round's update clipped and noised once (unless per step or off)."""
        if self.per_step:  # every accounted step is a noised release, made or not
            made = self._hook.step if self._hook is not None else 0
            current = {k: v.detach().clone() for k, v in state.items()}
            for step in range(made, self.planned_releases):
                current = self.privacy.release(
                    current, current, server_round=self.server_round, step=step
                )
            return current
        # the server's tensors this release covers (a probe round's adapter is not released)
        before = {k: v for k, v in self.global_state.items() if k in state}
        if self.private:
            return self.privacy.release(before, state, server_round=self.server_round)
        check_finite(difference(state, before), who=self.who)
        return state

    def save(self, node_state: RecordDict) -> None:
        node_state[STATE_KEY] = self.privacy.state.to_record()

    def describe(self, result: EpochResult) -> str:
        return f"train loss {result.loss:.4f} acc {result.accuracy:.4f}"

    def reply_metrics(self) -> dict[str, int | float]:
        """The process's facts and the privacy figures: nothing data-dependent (under DP no
        ``encoder-loads``: it would tell whether the records were in the feature cache)."""
        loads = {} if self.private else {"encoder-loads": encoder_module.LOAD_COUNT}
        return {
            **loads,
            "torch-threads": torch.get_num_threads(),
            "dp-active": int(self.private),
            **self.privacy.metrics(),
        }


STATE_KEY = "dp-state"


@dataclass
class DPState:
    """What a client must remember between rounds: its bound, its EMA, and its accountant."""

    clip: float
    ema: float | None = None
    accountant: Accountant = field(default_factory=Accountant)

    @property
    def releases(self) -> dict[float, int]:
        """The accountant's history as multiplier μ → count (0: a non-private release)."""
        table: dict[float, int] = {}
        for r in self.accountant.history:
            table[r.noise_multiplier] = table.get(r.noise_multiplier, 0) + r.count
        return table

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
        history = [
            Release(ReleaseKind.GAUSSIAN, count, noise_multiplier=mu)
            if mu > 0
            else Release(ReleaseKind.NON_PRIVATE, count)
            for mu, count in zip(multipliers, counts, strict=True)
            if count > 0
        ]
        return cls(
            clip=float(record["clip"]), ema=None if ema < 0 else ema, accountant=Accountant(history)
        )


class ClientPrivacy:
    """Clips and noises one client's releases, adapts its bound, and accounts for them.
    ``generator`` is for tests only; ``max_clip`` is the owner's ceiling on the bound."""

    def __init__(
        self,
        cfg: DPConfig,
        *,
        num_clients: int,
        client: int,
        state: DPState,
        generator: torch.Generator | None = None,
        max_clip: float = math.inf,
    ) -> None:
        self.cfg = cfg
        self.num_clients = num_clients
        self.mode = cfg.mode
        self.client = client
        # a stored bound is re-validated against this run and the policy before any use
        if not state.clip > 0:  # NaN, zero or negative: start from the run's bound
            state.clip = cfg.clip
        state.clip = min(state.clip, max_clip)
        self.state = state
        self.generator = generator
        self.max_clip = max_clip
        self.rule = cfg.adaptive_rule
        self.sigma_b = sigma_b(cfg, num_clients)
        spec = MODES[cfg.mode]
        #: The bound moves with the private rule (dp=adaptive), or is this run's dp.clip.
        self.moves_clip = isinstance(spec, ClientLevel) and spec.moves_clip
        self.fixed_clip = isinstance(spec, ClientLevel) and not spec.moves_clip
        self.z_delta = update_multiplier(cfg, num_clients) if self.moves_clip else None
        #: One release as every party accounts it.
        self.unit = local_release(cfg, num_clients)
        #: μ of every release (0: not private, ε = ∞).
        self.release_multiplier = self.unit.noise_multiplier
        self.not_private = non_private_reason(cfg) if cfg.enabled else None
        if self.not_private:
            log.warning("%s: not differentially private, ε is reported as inf", self.not_private)

    @classmethod
    def initial_state(cls, cfg: DPConfig) -> DPState:
        return DPState(clip=cfg.clip)

    def active(self, server_round: int) -> bool:
        """DP is on, and the warm-up rounds are over."""
        return active(self.cfg, server_round)

    def noise_std(self, norm: float) -> float:
        """Standard deviation of this release's noise, with the current bound."""
        if self.fixed_clip:
            return fixed_noise_std(self.cfg)
        if not self.z_delta:  # z = 0 gives z_Δ = 0; also with C = ∞, where 0·C would be NaN
            return 0.0
        if self.cfg.noise_rule is NoiseRule.BOUND:
            return bound_noise_std(
                self.z_delta,
                self.state.clip,
                norm,
                rate=self.cfg.update_rate,
                target=self.cfg.target_quantile,
            )
        return self.z_delta * self.state.clip

    def epsilon(self) -> float:
        """ε at ``dp.delta`` of every release this run made, from the run's accountant."""
        return self.state.accountant.get_epsilon(self.cfg.delta)

    def check_target(self, count: int = 1) -> None:
        """Raise before ``count`` more releases would take ε past ``dp.target_epsilon``."""
        if self.cfg.target_epsilon is None:
            return
        more = dataclasses.replace(self.unit, count=count)
        would = self.state.accountant.would_spend(self.cfg.delta, more)
        if would > self.cfg.target_epsilon:
            raise RunTargetReached(
                f"client {self.client} stops contributing: its next release would bring ε to "
                f"{would:.4g} > dp.target_epsilon = {self.cfg.target_epsilon:g} "
                f"(δ = {self.cfg.delta:g})"
            )

    def count(self, releases: int = 1) -> None:
        """Account for ``releases`` more releases (also ones accounted but never made)."""
        self.state.accountant.add(dataclasses.replace(self.unit, count=releases))

    def release(
        self, before: State, after: State, *, server_round: int, step: int = 0
    ) -> dict[str, torch.Tensor]:
        """Clip θᵢ − θ to the current bound (per part with ``dp.adapter_clip``), add noise,
        account, then adapt the bound. A non-finite update is released as a zero update."""
        who = f"client {self.client}"
        delta = difference(after, before)
        try:
            check_finite(delta, who=who)
        except FloatingPointError as err:  # the node's own log only
            log.warning("%s; releasing a zero update (noise only) instead", err)
            after = before
            delta = {k: torch.zeros_like(v) for k, v in before.items()}
        # fixed: this run's dp.clip (the noise is σ·dp.clip); adaptive: the rule's bound
        bound = self.cfg.clip if self.fixed_clip else self.state.clip
        parts = self.parts(delta, bound)
        head = parts[-1].names if parts else tuple(delta)
        norm = flat_norm({k: delta[k] for k in head})  # what the adaptive bound follows
        std = self.noise_std(norm)
        self.check_target()
        if parts:
            released = privatize_parts(
                before, after, self.scaled(parts, std), generator=self.generator, delta=delta
            )
        else:
            released, _ = privatize(
                before, after, bound=bound, std=std, generator=self.generator, delta=delta
            )
        self.count()
        if self.moves_clip:
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

    def parts(self, delta: State, bound: float) -> list[Part]:
        """With ``dp.adapter_clip``, the adapter (and the rest, the head, last) as parts
        clipped on their own; none (one joint release at dp.clip) otherwise."""
        adapter, rest = split_adapter(delta)
        if self.cfg.adapter_clip is None or not adapter:
            return []
        head = [Part(rest, bound, 0.0)] if rest else []
        return [Part(adapter, self.cfg.adapter_clip, 0.0), *head]

    def scaled(self, parts: list[Part], head_std: float) -> list[Part]:
        """Each part's noise: z / √share times its bound (the head's std from
        :meth:`noise_std`), so that Σ z_g⁻² = z⁻², the ε of one joint release."""
        z = update_multiplier(self.cfg, self.num_clients)
        adapter, *head = parts
        if not head:
            return [Part(adapter.names, adapter.bound, z * adapter.bound)]
        share = self.cfg.adapter_share
        return [
            Part(adapter.names, adapter.bound, z * adapter.bound / math.sqrt(share)),
            Part(head[0].names, head[0].bound, head_std / math.sqrt(1.0 - share)),
        ]

    def noised_indicator(self, norm: float, bound: float) -> float:
        """b̃ᵢ = 1[‖Δ‖ ≤ Cᵢ] + N(0, σ_b²), the noise from OS entropy."""
        draw = gaussian_like(
            {"b": torch.zeros(1, dtype=torch.float64)}, std=self.sigma_b, generator=self.generator
        )
        return clipped_indicator(norm, bound) + float(draw["b"])

    def next_clip(self, bound: float, norm: float) -> float:
        """The bound for the next release, by ``dp.adaptive_rule``."""
        if self.rule is AdaptiveRule.GEOMETRIC:
            moved = geometric_clip(
                bound,
                self.noised_indicator(norm, bound),
                lr=self.cfg.clip_lr,
                target=self.cfg.target_quantile,
            )
        else:
            self.state.ema = smoothed_norm(self.state.ema, norm, self.cfg.ema_decay)
            moved = linear_clip(
                bound, self.state.ema, rate=self.cfg.update_rate, target=self.cfg.target_quantile
            )
        return min(moved, self.max_clip)  # the node owner's ceiling (post-processing)

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


def load_privacy(
    settings: Settings, node: NodeInfo, node_state: RecordDict, *, max_clip: float = math.inf
) -> ClientPrivacy:
    """This client's DP mechanism, with its state from earlier rounds (if any)."""
    record = node_state.metric_records.get(STATE_KEY)
    state = (
        DPState.from_record(record)
        if record is not None
        else ClientPrivacy.initial_state(settings.dp)
    )
    return ClientPrivacy(
        settings.dp,
        num_clients=settings.fl.clients,
        client=node.partition_id,
        state=state,
        max_clip=max_clip,
    )
