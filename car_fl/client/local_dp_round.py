"""A round under local DP (``dp=fixed|adaptive``, or none): its epochs and its one release.

The round side of :mod:`car_fl.client.local_dp` (the mechanism, its state and its ε).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import RecordDict

from car_fl.client.local_dp import STATE_KEY, StepPrivatizer, load_privacy
from car_fl.model import encoder as encoder_module
from car_fl.model.retriever import CaRRetriever
from car_fl.privacy.mechanism import check_finite, difference
from car_fl.privacy.noise import secure_generator
from car_fl.settings.dp_plan import accounted_examples, local_steps
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import Granularity, Settings
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
