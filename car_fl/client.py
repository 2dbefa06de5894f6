"""Client-side work of one federated round: shard, features, E local epochs, reply.

The encoder is loaded at most once per process and kept (simulation reuses processes across
rounds). In ``classifier`` mode the shard's features come from the memory or disk cache, so a
round that only needs cached features never loads the encoder at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple

import torch
from flwr.app import RecordDict

from car_fl import encoder as encoder_module
from car_fl import node_cache
from car_fl.config import Mode, Settings
from car_fl.data.labels import LabelMap
from car_fl.encoder import Encoder, load_encoder
from car_fl.features import LocalData, prepare_for
from car_fl.flower_bridge import NodeInfo
from car_fl.model import CaRRetriever, build_retriever
from car_fl.privacy.client import STATE_KEY, ClientPrivacy, DPState, StepPrivatizer
from car_fl.privacy.mechanism import check_finite, difference
from car_fl.retrieval import label_documents
from car_fl.train import make_optimizer, train_epoch

log = logging.getLogger(__name__)

#: Encoders by their model settings and device (all hashable values).
_ENCODERS: dict[tuple[object, ...], Encoder] = {}
#: Shards by a digest of the settings, the server's labels and the node's place.
_SHARDS: dict[str, tuple[LocalData, LabelMap]] = {}


def cached_encoder(settings: Settings) -> Encoder:
    """The frozen encoder for these settings, loaded once per process."""
    key = (*astuple(settings.model), settings.device)
    if key not in _ENCODERS:
        _ENCODERS[key] = load_encoder(settings.model, device=settings.device)
    return _ENCODERS[key]


def client_seed(seed: int, partition_id: int) -> int:
    """Client ``i``'s training seed; client 0 uses the run seed, like a centralised run."""
    return seed + 1000 * partition_id


def shard_data(
    settings: Settings, node: NodeInfo, labels: Sequence[str] | None = None
) -> tuple[LocalData, LabelMap]:
    """This node's training shard as features (classifier) or token ids (adapter).

    ``labels`` is the server's global label map; every local label must be in it (a
    ``ValueError`` names the ones that are not). A node whose file is its own shard
    (``data-is-shard``) trains on all of it; otherwise it takes its partition of the training
    split of the full dataset.
    """
    key = node_cache.digest([asdict(settings), list(labels or []), astuple(node)])
    if key in _SHARDS:
        return _SHARDS[key]
    # The node's disk cache spares a new process reading, splitting and partitioning the data
    disk_key = node_cache.shard_key(
        settings,
        partition_id=node.partition_id,
        num_partitions=node.num_partitions,
        data_is_shard=node.data_is_shard,
        labels=labels,
    )
    stored = node_cache.load_shard(settings, disk_key) if disk_key else None
    if stored is None:
        stored = read_shard(settings, node, labels)
        if disk_key:
            node_cache.save_shard(settings, disk_key, *stored)
    texts, ids, label_map = stored
    mode = Mode(settings.train.mode)
    num_labels = len(label_map)

    def get_model() -> CaRRetriever:
        return CaRRetriever(cached_encoder(settings), num_labels, head=settings.head, mode=mode)

    data = prepare_for(
        settings,
        texts,
        ids,
        get_model=get_model,
        desc=f"client {node.partition_id} features",
    )
    _SHARDS[key] = (data, label_map)
    return data, label_map


def read_shard(
    settings: Settings, node: NodeInfo, labels: Sequence[str] | None = None
) -> tuple[list[str], list[int], LabelMap]:
    """This node's training texts, label ids and label map, read from its data file."""
    from car_fl.data import load_splits, partition  # datasets: only when the shard is not cached
    from car_fl.data.splits import load_examples, read_local

    label_map = LabelMap(tuple(labels)) if labels else None
    if node.data_is_shard:
        label_map = label_map or LabelMap.from_labels(
            e.label for e in read_local(settings.dataset, settings.dataset.path or "")
        )
        shard = load_examples(settings.dataset, label_map)
    else:
        splits = load_splits(settings.dataset, seed=settings.seed, label_map=label_map)
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


def local_retriever(settings: Settings, data: LocalData, label_map: LabelMap) -> CaRRetriever:
    """A retriever to train locally; without the encoder when features are all cached."""
    if data.features is not None:
        return build_retriever(settings, len(label_map), hidden_size=int(data.features.shape[1]))
    documents = label_documents(label_map.names, settings.dataset.label_texts)
    return build_retriever(
        settings, len(label_map), encoder=cached_encoder(settings), documents=documents
    )


def train_round(
    settings: Settings,
    node: NodeInfo,
    global_state: dict[str, torch.Tensor],
    server_round: int,
    node_state: RecordDict,
    labels: Sequence[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int | float]]:
    """E local epochs from the global state, then local DP if configured.

    Returns what the client sends (never an un-noised update once DP is active) and the reply
    metrics: once DP is active they hold nothing data-dependent besides ``num-examples`` and
    ε; the train loss, accuracy and seconds go to the client's own log only. ``node_state``
    is Flower's persistent per-node state; the DP state lives there. ``labels`` is the
    server's global label map.
    """
    if settings.dp.mode == "record":  # record-level DP-SGD: its own round
        from car_fl.privacy.record_client import train_round_record

        return train_round_record(settings, node, global_state, server_round, node_state, labels)
    tick = time.perf_counter()
    data, label_map = shard_data(settings, node, labels)
    model = local_retriever(settings, data, label_map)
    model.load_trainable_state_dict(global_state)
    optimizer = make_optimizer(model, settings.train)
    seed = client_seed(settings.seed, node.partition_id)
    privacy = load_privacy(settings, node, node_state)
    private = privacy.active(server_round)
    per_step = private and settings.dp.granularity == "step"
    hook = StepPrivatizer(privacy, model.trainable_parameters(), server_round) if per_step else None
    epochs = settings.fl.local_epochs
    for local in range(epochs):
        result = train_epoch(
            model,
            data,
            optimizer,
            batch_size=settings.train.batch_size,
            seed=seed,
            epoch=(server_round - 1) * epochs + local,
            progress=settings.progress,
            desc=f"client {node.partition_id} round {server_round} epoch {local + 1}",
            after_step=hook,
            prox_mu=settings.strategy.prox_mu,  # FedProx: μ/2·‖θ − θ_global‖²
            anchor=global_state,
        )
    state = model.trainable_state_dict()
    check_finite(difference(state, global_state), who=f"client {node.partition_id}")
    if private and not per_step:
        state = privacy.release(global_state, state, server_round=server_round)
    node_state[STATE_KEY] = privacy.state.to_record()
    train_metrics = {
        "train-loss": result.loss,
        "train-accuracy": result.accuracy,
        "train-seconds": time.perf_counter() - tick,
    }
    log.info(
        "client %d round %d: train loss %.4f acc %.4f, %.1fs%s",
        node.partition_id,
        server_round,
        result.loss,
        result.accuracy,
        train_metrics["train-seconds"],
        " (local only: not sent under DP)" if private else "",
    )
    metrics: dict[str, int | float] = {
        "num-examples": len(data),
        # Under DP only private values leave: no train metrics (timing is a side channel too)
        **({} if private else train_metrics),
        "partition-id": node.partition_id,
        "encoder-loads": encoder_module.LOAD_COUNT,
        "torch-threads": torch.get_num_threads(),
        "dp-active": int(private),
        **privacy.metrics(),
    }
    return state, metrics


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
