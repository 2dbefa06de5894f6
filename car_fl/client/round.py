"""One round on a data owner's machine: policy → shard → ledger → local epochs → DP → reply.

The skeleton is the same for every privacy mode; what differs is a :class:`RoundPrivacy`
(:class:`~car_fl.client.local_dp_round.LocalDPRound` or
:class:`~car_fl.client.record_dp.RecordDPRound`): its checks, its epochs, what is released.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from flwr.app import ConfigRecord, RecordDict

from car_fl.client.experts import tensors_to_send
from car_fl.client.node_privacy import NodePrivacy
from car_fl.client.shard import Shard, client_seed, empty_shard, local_retriever, shard_data
from car_fl.heads.clustering import ExpertLayout
from car_fl.model.features import LocalData
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import public_examples
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import Settings
from car_fl.training.probe import keep_adapter, probe_round, round_settings
from car_fl.training.train import EpochResult, make_optimizer

log = logging.getLogger(__name__)


class RoundPrivacy(Protocol):
    """What a privacy mode adds to a round."""

    #: Whether this round's release is private: then train metrics stay in the client's log.
    private: bool

    def refuse_past_target(self, examples: int) -> None:
        """Refuse the round before any training (raises)."""

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
        """One local epoch."""

    def release(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What leaves the node, from the trained state."""

    def save(self, node_state: RecordDict) -> None:
        """Keep what the next round needs in Flower's per-node state."""

    def describe(self, result: EpochResult) -> str:
        """The round for the client's own log."""

    def reply_metrics(self) -> dict[str, int | float]:
        """What the reply carries besides the parameters and the example count."""


def round_privacy(
    settings: Settings,
    node: NodeInfo,
    node_state: RecordDict,
    *,
    server_round: int,
    global_state: dict[str, torch.Tensor],
    max_clip: float = math.inf,
) -> RoundPrivacy:
    """The privacy of this round, by ``dp.mode``, with its state from earlier rounds (one DP
    mechanism per run: :func:`keep_one_mechanism`). ``max_clip``: the owner's ceiling on C."""
    keep_one_mechanism(settings, node_state, who=f"client {node.partition_id}")
    module, _, name = MODES[settings.dp.mode].node_round.partition(":")
    round_class = getattr(importlib.import_module(module), name)
    round_privacy: RoundPrivacy = round_class(
        settings,
        node,
        node_state,
        server_round=server_round,
        global_state=global_state,
        max_clip=max_clip,
    )
    return round_privacy


def node_shard(
    settings: Settings,
    node: NodeInfo,
    labels: Sequence[str] | None,
    *,
    memory: dict[str, Shard] | None = None,
    noise_only: bool = False,
) -> Shard:
    """The node's shard (:func:`shard_data`). With ``noise_only`` (a round already charged,
    under DP) a failed read gives an empty shard: the round releases noise alone, so whether
    the records parse is no answer a server can read."""
    if not noise_only:
        return shard_data(settings, node, labels, memory=memory)
    try:
        return shard_data(settings, node, labels, memory=memory)
    except Exception as err:  # the node's own log only; the reply is a noise-only release
        log.warning(
            "client %d: its data could not be read for this run (%s: %s); the round releases "
            "noise only, already charged to the ledger",
            node.partition_id,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return empty_shard(settings, node, labels)


#: The key of a run's DP mechanism in its state (a run keeps one for its whole life).
MECHANISM_KEY = "dp-mechanism"


def keep_one_mechanism(settings: Settings, node_state: RecordDict, *, who: str) -> None:
    """Refuse a round whose DP mode differs from this run's earlier rounds': the run's ε
    would leave the other mechanism's releases out."""
    mode = settings.dp.mode.value
    record = node_state.config_records.get(MECHANISM_KEY)
    used = str(record["mode"]) if record is not None and "mode" in record else None
    if used is not None and used != mode:
        raise ValueError(
            f"{who}: this run's earlier rounds used dp={used} and this round asks dp={mode}; "
            "a run keeps one DP mechanism for its whole life (start a new run)"
        )
    node_state[MECHANISM_KEY] = ConfigRecord({"mode": mode})


def refuse_before_the_ledger(
    settings: Settings,
    node: NodeInfo,
    node_state: RecordDict,
    *,
    server_round: int,
    global_state: dict[str, torch.Tensor],
    max_clip: float,
) -> RoundPrivacy:
    """The run's own refusals that read no record (one mechanism, DP-SGD's fixed (σ, q, δ),
    the target ε at n = 0), before the ledger is charged, so they cost the owner nothing.
    Returns the round's privacy for :func:`train_shard`, which checks again with the real n."""
    privacy = round_privacy(
        settings,
        node,
        node_state,
        server_round=server_round,
        global_state=global_state,
        max_clip=max_clip,
    )
    privacy.refuse_past_target(0)
    return privacy


def train_shard(
    settings: Settings,
    node: NodeInfo,
    shard: Shard,
    global_state: dict[str, torch.Tensor],
    server_round: int,
    node_state: RecordDict,
    *,
    node_privacy: NodePrivacy | None = None,
    run: str = "",
    layout: str | None = None,
    spent: bool = False,
    privacy: RoundPrivacy | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int | float]]:
    """:meth:`~car_fl.client.node.Node.train` on a shard already read. ``spent``: the round is
    already in the ledger; ``privacy``: from :func:`refuse_before_the_ledger` (None: built here)."""
    tick = time.perf_counter()
    who = f"client {node.partition_id}"
    if privacy is None:
        privacy = round_privacy(
            settings,
            node,
            node_state,
            server_round=server_round,
            global_state=global_state,
            max_clip=node_privacy.policy.max_clip if node_privacy is not None else math.inf,
        )
    privacy.refuse_past_target(shard.examples)  # before any training
    if node_privacy is not None and not spent:  # recorded before training, let alone the reply
        node_privacy.spend(settings, run=run, server_round=server_round, examples=shard.examples)
    experts = ExpertLayout.from_text(layout) if layout is not None else None
    probing = probe_round(settings, server_round)  # the head alone; the adapter as it came
    trained = round_settings(settings, server_round)
    model = local_retriever(trained, shard.data, shard.label_map, experts)
    model.load_trainable_state_dict(global_state)  # a mixture of experts: those sent
    optimizer = make_optimizer(model, trained.train)
    seed = client_seed(settings.seed, node.partition_id)
    epochs = settings.fl.local_epochs
    for local in range(epochs):
        result = privacy.epoch(
            model,
            shard.data,
            optimizer,
            seed=seed,
            epoch=(server_round - 1) * epochs + local,
            desc=f"{who} round {server_round} epoch {local + 1}",
        )
    state = privacy.release(tensors_to_send(model, settings))
    if probing:  # after the release: the adapter is the server's, no step or noise of ours
        state = keep_adapter(state, global_state)
    privacy.save(node_state)
    seconds = time.perf_counter() - tick
    log.info(
        "%s round %d%s: %s, %.1fs%s",
        who,
        server_round,
        " (probe: the head alone)" if probing else "",
        privacy.describe(result),
        seconds,
        " (local only: not sent under DP)" if privacy.private else "",
    )
    train_metrics = {
        "train-loss": result.loss,
        "train-accuracy": result.accuracy,
        "train-seconds": seconds,
    }
    metrics: dict[str, int | float] = {
        # n: every example of the shard (also those the server's label map lacks), unless DP is
        # active: then a public value (n is data-dependent and nothing noises it)
        "num-examples": public_examples(settings) if privacy.private else shard.examples,
        # Under DP only private values leave: no train metrics (timing is a side channel too)
        **({} if privacy.private else train_metrics),
        "partition-id": node.partition_id,
        **privacy.reply_metrics(),
    }
    return state, metrics
