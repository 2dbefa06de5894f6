"""One round on a data owner's machine: policy → shard → ledger → local epochs → DP → reply.

The skeleton is the same for every privacy mode; what differs is a :class:`RoundPrivacy`
(:class:`~car_fl.client.local_dp.LocalDPRound` or
:class:`~car_fl.client.record_dp.RecordDPRound`): its checks, its epochs, what is released.

The training shard (:class:`Shard`): the node splits its data with its own label map, then
encodes the labels with the server's; examples whose label that map lacks are left out and
counted, but n (:attr:`Shard.examples`) counts them, so nothing a reply carries depends on
which labels the node holds.

What a node sends of a mixture of experts (:func:`tensors_to_send`): under DP, never a choice
that depends on its data. Every tensor it was sent goes back, trained or not; only
``moe.send=routed`` without DP leaves out the experts its queries never reached (checked again
here, whatever the server ships).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass
from typing import Protocol

import torch
from flwr.app import ConfigRecord, RecordDict

from car_fl.client import node_cache
from car_fl.client.node_privacy import NodePrivacy
from car_fl.data.labels import LabelMap
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.experts import EXPERT_PREFIX, MixtureHead
from car_fl.model.encoder import Encoder, shared_encoder
from car_fl.model.features import LocalData, document_features, document_texts, prepare_for
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.settings.compose import NodeInfo
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import public_examples
from car_fl.settings.schema import ExpertSending, HeadKind, Settings, Standardize
from car_fl.training.train import (
    EpochResult,
    keep_adapter,
    make_optimizer,
    probe_round,
    round_settings,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """A node's training shard, encoded with the server's label map."""

    #: The examples to train on: those whose label the server's map has.
    data: LocalData
    #: The server's global label map (the node's own when the server sent none).
    label_map: LabelMap
    #: n: every example of the shard, also those left out (what a reply reports).
    examples: int


def cached_encoder(settings: Settings) -> Encoder:
    """The frozen encoder for these settings, loaded once per process."""
    return shared_encoder(settings.model, device=settings.device)


def query_encoder(settings: Settings, num_labels: int) -> CaRRetriever:
    """A retriever on the shared encoder that encodes a shard's queries (any head will do)."""
    head = dataclasses.replace(settings.head, kind=HeadKind.CLASSIFIER)
    return CaRRetriever(
        cached_encoder(settings),
        num_labels,
        head=head,
        mode=settings.train.mode,
        adapter=settings.adapter,
        seed=settings.seed,
    )


def client_seed(seed: int, partition_id: int) -> int:
    """Client ``i``'s training seed; client 0 uses the run seed, like a centralised run."""
    return seed + 1000 * partition_id


def shard_data(
    settings: Settings,
    node: NodeInfo,
    labels: Sequence[str] | None = None,
    *,
    memory: dict[str, Shard] | None = None,
) -> Shard:
    """This node's training shard as features (classifier) or token ids (adapter), with the
    server's label map ``labels``: all of a ``data-is-shard`` file, else its partition of the
    training split. ``memory``: the shards already read, by a digest of what decides one."""
    memory = {} if memory is None else memory
    # the data files' identity is in the key: a worker sees an edited file as another shard
    disk_key = node_cache.shard_key(
        settings,
        partition_id=node.partition_id,
        num_partitions=node.num_partitions,
        data_is_shard=node.data_is_shard,
    )
    key = node_cache.digest([asdict(settings), list(labels or []), astuple(node), disk_key])
    if key in memory:
        return memory[key]
    # The node's disk cache spares a new process reading, splitting and partitioning the data
    stored = node_cache.load_shard(settings, disk_key) if disk_key else None
    if stored is None:
        stored = read_shard(settings, node)
        if disk_key:
            node_cache.save_shard(settings, disk_key, *stored)
    texts, own_ids, own_map = stored
    label_map = LabelMap(tuple(labels)) if labels else own_map
    kept, ids = encode_for(label_map, own_map, own_ids, who=f"client {node.partition_id}")
    num_labels = len(label_map)

    data = prepare_for(
        settings,
        [texts[i] for i in kept],
        ids,
        get_model=lambda: query_encoder(settings, num_labels),
        desc=f"client {node.partition_id} features",
    )
    memory[key] = Shard(data=data, label_map=label_map, examples=len(texts))
    return memory[key]


def empty_shard(settings: Settings, node: NodeInfo, labels: Sequence[str] | None) -> Shard:
    """A shard of no example, with the server's label map: a round releasing noise alone."""
    label_map = LabelMap(tuple(labels or ()))
    data = prepare_for(
        settings,
        [],
        [],
        get_model=lambda: query_encoder(settings, max(len(label_map), 1)),
        desc=f"client {node.partition_id}",
    )
    return Shard(data=data, label_map=label_map, examples=0)


def encode_for(
    label_map: LabelMap, own_map: LabelMap, own_ids: Sequence[int], *, who: str
) -> tuple[list[int], list[int]]:
    """The examples ``label_map`` can encode (their positions) and their ids in it; the others
    are counted in the node's log, never raised (an error would reach the server)."""
    kept, ids = [], []
    missing: Counter[str] = Counter()
    known = set(label_map.names)
    for position, own in enumerate(own_ids):
        name = own_map.names[own]
        if name in known:
            kept.append(position)
            ids.append(label_map.index(name))
        else:
            missing[name] += 1
    if missing:
        log.warning(
            "%s: left out %d of %d examples whose labels the server's label map lacks (%s); "
            "they still count in n",
            who,
            sum(missing.values()),
            len(own_ids),
            ", ".join(f"{name}: {count}" for name, count in sorted(missing.items())),
        )
    return kept, ids


def read_shard(settings: Settings, node: NodeInfo) -> tuple[list[str], list[int], LabelMap]:
    """This node's training texts, label ids and its own label map, read from its data file."""
    # datasets and flwr-datasets: only when the shard is not cached
    from car_fl.data.partition import partition
    from car_fl.data.splits import load_examples, load_splits, read_local

    if node.data_is_shard:
        label_map = LabelMap.from_labels(
            e.label for e in read_local(settings.dataset, settings.dataset.path or "")
        )
        shard = load_examples(settings.dataset, label_map)
    else:
        splits = load_splits(settings.dataset, seed=settings.seed)
        label_map = splits.label_map
        shard = partition(
            splits.train,
            partition_id=node.partition_id,
            num_partitions=node.num_partitions,
            scheme=settings.fl.partitioning,
            alpha=settings.fl.alpha,
            seed=settings.seed,
        )
    return [str(t) for t in shard["text"]], [int(i) for i in shard["label"]], label_map


def local_retriever(
    settings: Settings,
    data: LocalData,
    label_map: LabelMap,
    layout: ExpertLayout | None = None,
) -> CaRRetriever:
    """A retriever to train locally; without the encoder when features are all cached."""
    documents = document_texts(settings, label_map.names)
    features = None
    standardize = settings.model.standardize is Standardize.DOCUMENTS
    if settings.head.kind.traits.from_documents or standardize:
        features = document_features(
            settings, documents, get_encoder=lambda: cached_encoder(settings)
        )
    # every feature cached: the head alone, sized by them; else on the shared encoder
    cached = data.features is not None
    return build_retriever(
        settings,
        len(label_map),
        hidden_size=int(data.features.shape[1]) if data.features is not None else None,
        encoder=None if cached else cached_encoder(settings),
        documents=documents,
        document_features=features,
        layout=layout,
    )


def tensors_to_send(model: CaRRetriever, settings: Settings) -> dict[str, torch.Tensor]:
    """The trainable tensors this node sends (before any DP release)."""
    state = model.trainable_state_dict()
    head = model.head
    routed = settings.moe.send is ExpertSending.ROUTED and not settings.dp.enabled
    if not isinstance(head, MixtureHead) or not routed:
        return state
    return {
        name: value
        for name, value in state.items()
        if not name.startswith(EXPERT_PREFIX) or int(name[len(EXPERT_PREFIX) :]) in head.touched
    }


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
