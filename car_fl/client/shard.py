"""This node's training shard, ready to train on: its examples, features and retriever.

The node splits its data with its own label map, then encodes the labels with the server's;
examples whose label that map lacks are left out and counted, but n (:attr:`Shard.examples`)
counts them, so nothing a reply carries depends on which labels the node holds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass

from car_fl.client import node_cache
from car_fl.data.labels import LabelMap
from car_fl.heads.clustering import ExpertLayout
from car_fl.model.build import build_retriever
from car_fl.model.documents import document_features, document_texts
from car_fl.model.encoder import Encoder, shared_encoder
from car_fl.model.features import LocalData, prepare_for
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.flower import NodeInfo
from car_fl.settings.schema import HeadKind, Settings, Standardize

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
