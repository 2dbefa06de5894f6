"""One client's record-level DP (``dp=record``): DP-SGD epochs, its state, the ε spent.

The plan is fixed from the configuration before any training, and a round past the target ε is
refused then; nothing about the data decides whether a round succeeds (see
:meth:`RecordDPRound.round_data`). The steps taken persist in the run's state; the reply
carries only functions of the configuration and the rounds trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from car_fl.client.failures import RunTargetReached
from car_fl.model.features import LocalData
from car_fl.model.retriever import CaRRetriever
from car_fl.privacy.mechanism import secure_generator
from car_fl.privacy.record_accounting import RecordPlan, trained_cap
from car_fl.settings.compose import NodeInfo
from car_fl.settings.dp_plan import record_plan
from car_fl.settings.schema import Mode, Settings
from car_fl.training.train import EpochResult, train_epoch_dpsgd

STATE_KEY = "dp-record-state"


@dataclass
class RecordState:
    """What a client remembers between rounds: the DP-SGD steps it has taken, with σ, q and δ
    (a run's steps compose into one ε only if all three stay the same)."""

    steps: int = 0
    noise_multiplier: float = 0.0
    sample_rate: float | None = None
    delta: float | None = None

    def to_record(self) -> MetricRecord:
        values: dict[str, int | float | list[int] | list[float]] = {
            "steps": self.steps,
            "noise-multiplier": self.noise_multiplier,
        }
        if self.sample_rate is not None and self.delta is not None:
            values |= {"sample-rate": self.sample_rate, "delta": self.delta}
        return MetricRecord(values)

    @classmethod
    def from_record(cls, record: Any) -> RecordState:
        return cls(
            steps=int(record["steps"]),
            noise_multiplier=float(record["noise-multiplier"]),
            sample_rate=float(record["sample-rate"]) if "sample-rate" in record else None,
            delta=float(record["delta"]) if "delta" in record else None,
        )


def load_record_state(node_state: RecordDict) -> RecordState:
    record = node_state.metric_records.get(STATE_KEY)
    return RecordState.from_record(record) if record is not None else RecordState()


def check_budget(plan: RecordPlan, state: RecordState, *, who: str) -> float:
    """ε after this round's steps; raises before training if it would pass the target."""
    before = (state.noise_multiplier, state.sample_rate, state.delta)
    now = (plan.noise_multiplier, plan.sample_rate, plan.delta)
    changed = [old is not None and old != new for old, new in zip(before, now, strict=True)]
    if state.steps and any(changed):
        raise ValueError(
            f"{who} took {state.steps} DP-SGD steps with (σ, q, δ) = {before} and is now "
            f"configured with {now}; they are fixed for a run's whole life (same dp.* and "
            "fl.rounds as before), or its steps would not compose into the ε it reports"
        )
    after = state.steps + plan.steps_per_round
    would = plan.epsilon(after)
    if plan.target_epsilon is not None and would > plan.target_epsilon:
        raise RunTargetReached(
            f"{who} stops contributing: this round's {plan.steps_per_round} DP-SGD steps would "
            f"bring its ε to {would:.4g} > dp.target_epsilon = {plan.target_epsilon:g} "
            f"(δ = {plan.delta:g}, {state.steps} steps taken)"
        )
    return would


class RecordDPRound:
    """A round's DP-SGD epochs (``dp=record``); the model after DP-SGD is the release."""

    private = True

    def __init__(
        self, settings: Settings, node: NodeInfo, node_state: RecordDict, **_: object
    ) -> None:
        """The other modes' round context (``server_round``, ...) is unused here."""
        self.settings = settings
        self.who = f"client {node.partition_id}"
        self.plan = record_plan(settings)
        self.state = load_record_state(node_state)
        self.epsilon_after = 0.0
        self.examples = 0
        self.trained: tuple[LocalData, int] | None = None

    def refuse_past_target(self, examples: int) -> None:
        """This round's steps within the target ε: before any training. ``examples`` (n)
        decides nothing here: it only sizes what :meth:`epoch` trains on."""
        self.examples = examples
        self.epsilon_after = check_budget(self.plan, self.state, who=self.who)

    def round_data(self, data: LocalData) -> tuple[LocalData, int]:
        """What this round trains on, and the n its steps divide by (q·n is the expected batch).
        Above a public cap (:func:`trained_cap`, and ``fl.max_examples_per_client``) an OS-random
        subset of the cap; it divides by ``fl.max_examples_per_client`` when set (so the update's
        scale says nothing about n), else by the n trained on (at least 1)."""
        if self.trained is None:
            bound = self.settings.fl.max_examples_per_client
            cap = trained_cap(self.plan.delta)
            cap = cap if bound is None else min(cap, bound)
            if self.examples > cap:
                chosen = torch.randperm(self.examples, generator=secure_generator("cpu"))[:cap]
                kept = sorted(i for i in chosen.tolist() if i < len(data))
                trained, used = data.select(kept), cap
            else:
                trained, used = data, self.examples
            self.trained = (trained, bound if bound is not None else max(used, 1))
        return self.trained

    def epoch(
        self,
        model: CaRRetriever,
        data: LocalData,
        optimizer: torch.optim.Optimizer,
        *,
        seed: int,
        epoch: int,
        desc: str,
    ) -> EpochResult:
        plan = self.plan
        trained, population = self.round_data(data)
        return train_epoch_dpsgd(
            model,
            trained,
            optimizer,
            sample_rate=plan.sample_rate,
            clip=plan.clip,
            noise_multiplier=plan.noise_multiplier,
            steps=plan.steps_per_round // self.settings.fl.local_epochs,
            seed=seed,
            epoch=epoch,
            progress=self.settings.progress,
            desc=f"DP-SGD {desc}",
            population=population,  # n, also counting examples left out (see shard)
            adapter_clip=self.adapter_clip,
        )

    def release(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state  # DP-SGD's parameters are already private

    @property
    def steps(self) -> int:
        """DP-SGD steps taken once this round is done."""
        return self.state.steps + self.plan.steps_per_round

    def save(self, node_state: RecordDict) -> None:
        plan = self.plan
        node_state[STATE_KEY] = RecordState(
            steps=self.steps,
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            delta=plan.delta,
        ).to_record()

    @property
    def adapter_clip(self) -> float | None:
        """The adapter's own per-example bound: ``dp.adapter_clip`` when an adapter trains."""
        if self.settings.train.mode is not Mode.ADAPTER_CLASSIFIER:
            return None
        return self.settings.dp.adapter_clip

    def describe(self, result: EpochResult) -> str:
        plan = self.plan
        adapter_clip = self.adapter_clip
        bounds = f"C {plan.clip:.4g}" + (
            f" (adapter {adapter_clip:.4g})" if adapter_clip is not None else ""
        )
        return (
            f"DP-SGD σ {plan.noise_multiplier:.4g} q {plan.sample_rate:.4g} {bounds}, "
            f"{plan.steps_per_round} steps ({self.steps} in all), ε {self.epsilon_after:.4f} "
            f"(δ {plan.delta:g}) | last epoch: sampled loss {result.loss:.4f} "
            f"acc {result.accuracy:.4f}"
        )

    def reply_metrics(self) -> dict[str, int | float]:
        """ε, steps, σ and q: functions of the configuration and the rounds trained."""
        return {
            "dp-active": 1,
            "dp-epsilon": self.epsilon_after,
            "dp-steps": self.steps,
            "dp-noise-multiplier": self.plan.noise_multiplier,
            "dp-sample-rate": self.plan.sample_rate,
        }
