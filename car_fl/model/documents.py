"""The documents a run retrieves: their texts in label order and their frozen embeddings.

A corpus names its documents file; other datasets have one short text per label. The
embeddings (frozen encoder, no adapter) are cached per text like query features.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from car_fl.data.corpus import Document, documents_digest, read_documents
from car_fl.data.corpus_splits import new_document_indices
from car_fl.heads.retrieval import label_documents
from car_fl.model.encoder import Encoder
from car_fl.model.feature_cache import FeatureCache, space_key
from car_fl.model.features import extract_features
from car_fl.settings.schema import ModelConfig, Reader, Settings

if TYPE_CHECKING:  # datasets: not on a client whose round reads cached features
    from car_fl.data.splits import DataSplits

log = logging.getLogger(__name__)


def corpus_documents(settings: Settings, names: Sequence[str]) -> list[Document]:
    """The corpus's documents in label order; a ``ValueError`` when they are not ``names``."""
    path = settings.dataset.documents_path
    if path is None:
        raise ValueError("a corpus needs dataset.documents_path")
    documents = read_documents(path)
    if tuple(d.id for d in documents) != tuple(names):
        raise ValueError(
            f"the documents of {path} ({len(documents)}) are not the {len(names)} documents "
            "this model was trained on; point dataset.documents_path at the same file"
        )
    return documents


def document_texts(settings: Settings, names: Sequence[str]) -> list[str]:
    """Each label's document text, in label order."""
    if settings.dataset.reader is Reader.CORPUS:
        return [d.text for d in corpus_documents(settings, names)]
    return label_documents(names, settings.dataset.label_texts)


def split_texts(settings: Settings, splits: DataSplits) -> list[str]:
    """The document texts of loaded splits, in label order (a corpus carries its own)."""
    if splits.documents is not None:
        return [d.text for d in splits.documents]
    return label_documents(splits.label_map.names, settings.dataset.label_texts)


def documents_identity(settings: Settings, names: Sequence[str]) -> dict[str, str]:
    """What a checkpoint records of its corpus (a digest of ids and texts), if it has one."""
    if settings.dataset.reader is not Reader.CORPUS:
        return {}
    return {"documents_digest": documents_digest(corpus_documents(settings, names))}


def document_model_config(cfg: ModelConfig) -> ModelConfig:
    """The model settings documents are encoded with (their own token limit)."""
    return dataclasses.replace(cfg, max_length=cfg.document_max_length or cfg.max_length)


def document_features(
    settings: Settings,
    texts: Sequence[str],
    *,
    get_encoder: Callable[[], Encoder],
    cache: FeatureCache | None = None,
) -> torch.Tensor:
    """Frozen embeddings ``(documents, d)`` of ``texts`` (no adapter), through the cache."""
    model_cfg = document_model_config(settings.model)
    cache = cache if cache is not None else FeatureCache(settings.cache_dir)

    def compute(todo: list[str]) -> torch.Tensor:
        return encode_documents(
            get_encoder(),
            todo,
            max_length=model_cfg.max_length,
            batch_size=settings.train.feature_batch_size,
            progress=settings.progress,
        )

    space = functools.partial(space_key, model_cfg, device=settings.device)
    return cache.features(space, texts, compute, desc="documents")


def encode_documents(
    encoder: Encoder,
    texts: Sequence[str],
    *,
    max_length: int,
    batch_size: int,
    progress: bool = False,
) -> torch.Tensor:
    """Pooled embeddings ``(n, d)`` of ``texts`` through the frozen encoder alone."""

    def unadapted(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return encoder.pool(encoder.transform(encoder.embed(ids), mask), mask)

    ids = encoder.tokenize(list(texts), max_length=max_length).input_ids
    return extract_features(
        unadapted, encoder.pad, ids, batch_size=batch_size, progress=progress, desc="documents"
    )


def trained_rows(settings: Settings, num_labels: int) -> torch.Tensor | None:
    """Which documents a head trains on ``(documents,)`` bool: a corpus's new documents arrive
    after training (None: all)."""
    ds = settings.dataset
    if ds.reader is not Reader.CORPUS or not ds.new_fraction:
        return None
    trained = torch.ones(num_labels, dtype=torch.bool)
    new = new_document_indices(num_labels, new_fraction=ds.new_fraction, seed=settings.seed)
    trained[sorted(new)] = False
    return trained
