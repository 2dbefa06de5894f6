"""One client's round under record-level DP (``dp=record``): DP-SGD epochs and the ε spent.

Before any training the client fixes its plan (σ calibrated for the target ε over the planned
steps, see :func:`~car_fl.privacy.record_accounting.record_plan`), checks δ < 1/n for its n
examples, and refuses a round whose steps would take its ε past ``dp.target_epsilon``. The
steps taken so far live in Flower's persistent node state, so a client's ε composes over every
step of every round it takes part in. The reply carries the DP-SGD parameters, num-examples
and the privacy figures, which are all functions of the public configuration and of how many
rounds the client trained: ε, steps, σ, q (and its partition id). The train loss and
accuracy stay in the client's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from car_fl.client import client_seed, local_retriever, shard_data
from car_fl.config import Settings
from car_fl.flower_bridge import NodeInfo
from car_fl.privacy.record_accounting import RecordPlan, check_delta, record_plan
from car_fl.train import make_optimizer, train_epoch_dpsgd

log = logging.getLogger(__name__)

STATE_KEY = "dp-record-state"


class RecordBudgetExhausted(RuntimeError):
    """The next round's DP-SGD steps would spend more than ``dp.target_epsilon``."""


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
        raise RecordBudgetExhausted(
            f"{who} stops contributing: this round's {plan.steps_per_round} DP-SGD steps would "
            f"bring its ε to {would:.4g} > dp.target_epsilon = {plan.target_epsilon:g} "
            f"(δ = {plan.delta:g}, {state.steps} steps taken)"
        )
    return would


def train_round_record(
    settings: Settings,
    node: NodeInfo,
    global_state: dict[str, torch.Tensor],
    server_round: int,
    node_state: RecordDict,
    labels: Sequence[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int | float]]:
    """``fl.local_epochs`` epochs of DP-SGD from the global state; the reply and its metrics."""
    tick = time.perf_counter()
    who = f"client {node.partition_id}"
    data, label_map = shard_data(settings, node, labels)
    # The plan, δ < 1/n and the budget: all checked before any training
    plan = record_plan(settings.dp, settings.fl)
    check_delta(plan.delta, len(data))
    state = load_record_state(node_state)
    epsilon_after = check_budget(plan, state, who=who)

    model = local_retriever(settings, data, label_map)
    model.load_trainable_state_dict(global_state)
    optimizer = make_optimizer(model, settings.train)
    seed = client_seed(settings.seed, node.partition_id)
    epochs = settings.fl.local_epochs
    per_epoch = plan.steps_per_round // epochs
    for local in range(epochs):
        result = train_epoch_dpsgd(
            model,
            data,
            optimizer,
            sample_rate=plan.sample_rate,
            clip=plan.clip,
            noise_multiplier=plan.noise_multiplier,
            steps=per_epoch,
            seed=seed,
            epoch=(server_round - 1) * epochs + local,
            progress=settings.progress,
            desc=f"{who} round {server_round} DP-SGD epoch {local + 1}",
        )
    released = model.trainable_state_dict()
    node_state[STATE_KEY] = RecordState(
        steps=state.steps + plan.steps_per_round, noise_multiplier=plan.noise_multiplier
    ).to_record()
    log.info(
        "%s round %d: DP-SGD σ %.4g q %.4g C %.4g, %d steps (%d in all), ε %.4f (δ %g) | "
        "last epoch: sampled loss %.4f acc %.4f (not sent) | %.1fs",
        who,
        server_round,
        plan.noise_multiplier,
        plan.sample_rate,
        plan.clip,
        plan.steps_per_round,
        state.steps + plan.steps_per_round,
        epsilon_after,
        plan.delta,
        result.loss,
        result.accuracy,
        time.perf_counter() - tick,
    )
    metrics: dict[str, int | float] = {
        "num-examples": len(data),
        "partition-id": node.partition_id,
        "dp-active": 1,
        "dp-epsilon": epsilon_after,
        "dp-steps": state.steps + plan.steps_per_round,
        "dp-noise-multiplier": plan.noise_multiplier,
        "dp-sample-rate": plan.sample_rate,
    }
    return released, metrics
