"""One client's record-level DP (``dp=record``): DP-SGD epochs, its state, the ε spent.

Before any training the client fixes its plan (σ calibrated for the target ε over the planned
steps, see :func:`~car_fl.settings.dp_plan.record_plan`) and refuses a round whose steps would
take its ε past ``dp.target_epsilon``: a function of the configuration and of the rounds
trained only. Nothing about its data decides whether a round succeeds: a node with at least
1/δ examples trains the round on an OS-random subset of ⌈1/δ⌉ − 1 of them (so δ < 1/n holds
for what it trains on, :func:`~car_fl.privacy.record_accounting.trained_cap`), and a node with
none takes the same steps with nothing sampled (noise only). The
steps taken so far live in Flower's persistent node state, so a client's ε composes over every
step of every round it takes part in. The reply carries the DP-SGD parameters, num-examples
and the privacy figures, which are all functions of the public configuration and of how many
rounds the client trained: ε, steps, σ, q (and its partition id). The train loss and
accuracy stay in the client's log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from car_fl.client.failures import RunTargetReached
from car_fl.method.features import LocalData
from car_fl.method.model import CaRRetriever
from car_fl.method.train import EpochResult, train_epoch_dpsgd
from car_fl.privacy.noise import secure_generator
from car_fl.privacy.record_accounting import RecordPlan, trained_cap
from car_fl.settings.dp_plan import record_plan
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import Settings

STATE_KEY = "dp-record-state"


@dataclass
class RecordState:
    """What a client remembers between rounds: the DP-SGD steps it has taken, and σ."""

    steps: int = 0
    noise_multiplier: float = 0.0

    def to_record(self) -> MetricRecord:
        return MetricRecord({"steps": self.steps, "noise-multiplier": self.noise_multiplier})

    @classmethod
    def from_record(cls, record: Any) -> RecordState:
        return cls(steps=int(record["steps"]), noise_multiplier=float(record["noise-multiplier"]))


def load_record_state(node_state: RecordDict) -> RecordState:
    record = node_state.metric_records.get(STATE_KEY)
    return RecordState.from_record(record) if record is not None else RecordState()


def check_budget(plan: RecordPlan, state: RecordState, *, who: str) -> float:
    """ε after this round's steps; raises before training if it would pass the target."""
    if state.steps and state.noise_multiplier != plan.noise_multiplier:
        raise ValueError(
            f"{who} took {state.steps} DP-SGD steps with σ = {state.noise_multiplier:g} and "
            f"is now configured with σ = {plan.noise_multiplier:g}; a client's σ is fixed "
            "for its whole life (same dp.* and fl.rounds as before)"
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
    """A round's DP-SGD epochs, for :func:`~car_fl.client.round.train_round` (``dp=record``).

    The plan (σ, q, C, steps) is fixed from the configuration; :meth:`check` verifies the
    budget before any training. n is the whole shard, examples the server's label map lacks
    included; at most :func:`~car_fl.privacy.record_accounting.trained_cap` of them are trained
    on (a fresh OS-random subset each round), and an empty shard takes noise-only steps. The
    model after DP-SGD is the release as it is.
    """

    private = True

    def __init__(self, settings: Settings, node: NodeInfo, node_state: RecordDict) -> None:
        self.settings = settings
        self.who = f"client {node.partition_id}"
        self.plan = record_plan(settings)
        self.state = load_record_state(node_state)
        self.epsilon_after = 0.0
        self.examples = 0
        self.trained: tuple[LocalData, int] | None = None

    def check(self, examples: int) -> None:
        """This round's steps within the target ε: before any training. ``examples`` (n)
        decides nothing here: it only sizes what :meth:`epoch` trains on."""
        self.examples = examples
        self.epsilon_after = check_budget(self.plan, self.state, who=self.who)

    def round_data(self, data: LocalData) -> tuple[LocalData, int]:
        """What this round trains on, and the n it stands for: all of ``data`` (n =
        :attr:`examples`, left-out examples included), or, when n ≥ 1/δ, the examples among a
        uniformly random ⌈1/δ⌉ − 1 of the n (OS entropy, drawn once per round). An empty shard
        stands for n = 1: its steps sample nothing and release noise only."""
        if self.trained is None:
            cap = trained_cap(self.plan.delta)
            if self.examples > cap:
                chosen = torch.randperm(self.examples, generator=secure_generator("cpu"))[:cap]
                kept = sorted(i for i in chosen.tolist() if i < len(data))
                self.trained = (data.select(kept), cap)
            else:
                self.trained = (data, max(self.examples, 1))
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
        )

    def release(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state  # DP-SGD's parameters are already private

    @property
    def steps(self) -> int:
        """DP-SGD steps taken once this round is done."""
        return self.state.steps + self.plan.steps_per_round

    def save(self, node_state: RecordDict) -> None:
        node_state[STATE_KEY] = RecordState(
            steps=self.steps, noise_multiplier=self.plan.noise_multiplier
        ).to_record()

    def describe(self, result: EpochResult) -> str:
        plan = self.plan
        return (
            f"DP-SGD σ {plan.noise_multiplier:.4g} q {plan.sample_rate:.4g} C {plan.clip:.4g}, "
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
