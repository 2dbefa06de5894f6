"""This node's training shard, ready to train on: its examples, features and retriever.

The encoder is loaded at most once per process and kept (simulation reuses processes across
rounds). In ``classifier`` mode the shard's features come from the memory or disk cache, so a
round that only needs cached features never loads the encoder at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, astuple

from car_fl.client import node_cache
from car_fl.data.labels import LabelMap
from car_fl.method.documents import document_features, document_texts
from car_fl.method.encoder import Encoder, load_encoder
from car_fl.method.experts import ExpertLayout
from car_fl.method.features import LocalData, prepare_for
from car_fl.method.model import CaRRetriever, build_retriever
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import HeadKind, Settings

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
    num_labels = len(label_map)

    def get_model() -> CaRRetriever:  # to encode queries: any head will do, a classifier's
        head = dataclasses.replace(settings.head, kind=HeadKind.CLASSIFIER)
        return CaRRetriever(
            cached_encoder(settings), num_labels, head=head, mode=settings.train.mode
        )

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
    # datasets and flwr-datasets: only when the shard is not cached
    from car_fl.data.partition import partition
    from car_fl.data.splits import load_examples, load_splits, read_local

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


def local_retriever(
    settings: Settings,
    data: LocalData,
    label_map: LabelMap,
    layout: ExpertLayout | None = None,
) -> CaRRetriever:
    """A retriever to train locally; without the encoder when features are all cached.

    A document head's rows come from the corpus's documents (their embeddings cached like the
    queries'); a mixture of experts uses the server's ``layout``.
    """
    documents = document_texts(settings, label_map.names)
    features = None
    if settings.head.kind in (HeadKind.DOCUMENT, HeadKind.MOE):
        features = document_features(
            settings, documents, get_encoder=lambda: cached_encoder(settings)
        )
    if data.features is not None:
        return build_retriever(
            settings,
            len(label_map),
            hidden_size=int(data.features.shape[1]),
            documents=documents,
            document_features=features,
            layout=layout,
        )
    return build_retriever(
        settings,
        len(label_map),
        encoder=cached_encoder(settings),
        documents=documents,
        document_features=features,
        layout=layout,
    )
