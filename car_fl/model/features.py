"""Pooled hidden states of the frozen encoder: extraction batched by length, and caches.

In ``classifier`` mode the encoder runs once per text, ever (:mod:`car_fl.model.feature_cache`),
in batches of similar length; :func:`prepare_data` / :func:`prepare_for` turn texts and labels
into :class:`LocalData`: features (classifier mode) or token ids (adapter mode).

The documents a run retrieves (:func:`document_texts`): their texts in label order and their
frozen embeddings. A corpus names its documents file; other datasets have one short text per
label. The embeddings (frozen encoder, no adapter) are cached per text like query features.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from car_fl.common.progress import bar
from car_fl.data.corpus import Document, documents_digest, read_documents
from car_fl.data.corpus_splits import new_document_indices
from car_fl.model.encoder import Encoder
from car_fl.model.feature_cache import FeatureCache, space_key
from car_fl.settings.schema import Mode, ModelConfig, Reader, Settings

if TYPE_CHECKING:
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


def label_documents(label_names: Sequence[str], label_texts: Mapping[str, str]) -> list[str]:
    """The document text of each label, in label order: its ``label_texts`` entry or its name."""
    return [label_texts.get(name) or name for name in label_names]


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


class QueryEncoder(Protocol):
    """What feature extraction needs of a retriever (:class:`~car_fl.model.retriever.CaRRetriever`):
    its frozen encoder (tokenizer, padding) and its pooled encoding through the adapter."""

    @property
    def encoder(self) -> Encoder: ...

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first); covers each index once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def arrival_batches(count: int, batch_size: int) -> list[list[int]]:
    """Indices in their original order, ``batch_size`` at a time (no length sorting)."""
    return [list(range(i, min(i + batch_size, count))) for i in range(0, count, batch_size)]


def extract_features(
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pad: Callable[[list[list[int]]], tuple[torch.Tensor, torch.Tensor]],
    input_ids: Sequence[list[int]],
    *,
    batch_size: int,
    bucket: bool = True,
    progress: bool = True,
    desc: str = "features",
) -> torch.Tensor:
    """Pooled vectors ``(n, d)`` for token id lists, in the order given (batched by similar
    length with ``bucket``)."""
    if not input_ids:
        raise ValueError("no texts to extract features from")
    lengths = [len(ids) for ids in input_ids]
    batches = (
        length_batches(lengths, batch_size) if bucket else arrival_batches(len(lengths), batch_size)
    )
    out: torch.Tensor | None = None
    for batch in bar(batches, desc=desc, unit="batch", enabled=progress):
        with torch.inference_mode():
            ids, mask = pad([input_ids[i] for i in batch])
            pooled = encode(ids, mask)  # (batch, d)
        # ``out`` is an ordinary tensor (not an inference tensor), so it can feed autograd.
        if out is None:
            out = torch.empty((len(input_ids), pooled.shape[-1]), dtype=pooled.dtype)
        out[torch.tensor(batch)] = pooled.detach().to("cpu")
    assert out is not None
    return out


@dataclass
class LocalData:
    """Examples ready for training: labels, and cached features or token ids by mode."""

    labels: torch.Tensor  # (n,) int64
    features: torch.Tensor | None = None  # (n, d), classifier mode
    input_ids: list[list[int]] | None = None  # adapter mode
    #: The query texts, for a retriever that fuses a lexical ranking (held-out data only).
    texts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.features is None and self.input_ids is None:
            raise ValueError("LocalData needs features or input_ids")
        n = len(self.labels)
        if self.features is not None and len(self.features) != n:
            raise ValueError(f"{len(self.features)} feature rows for {n} labels")
        if self.input_ids is not None and len(self.input_ids) != n:
            raise ValueError(f"{len(self.input_ids)} token sequences for {n} labels")
        if self.texts is not None and len(self.texts) != n:
            raise ValueError(f"{len(self.texts)} query texts for {n} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, positions: Sequence[int]) -> LocalData:
        """The examples at ``positions``, in that order."""
        index = torch.as_tensor(list(positions), dtype=torch.long)
        return LocalData(
            labels=self.labels[index],
            features=self.features[index] if self.features is not None else None,
            input_ids=[self.input_ids[i] for i in positions]
            if self.input_ids is not None
            else None,
            texts=tuple(self.texts[i] for i in positions) if self.texts is not None else None,
        )


def prepare_data(
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    mode: Mode,
    model_cfg: ModelConfig,
    device: str,
    get_model: Callable[[], QueryEncoder],
    cache: FeatureCache | None,
    batch_size: int,
    progress: bool = True,
    desc: str = "features",
) -> LocalData:
    """Features (classifier mode, from the cache when possible) or token ids (adapter mode);
    ``get_model`` is called only when the encoder is needed."""
    label_tensor = torch.tensor(list(labels), dtype=torch.long)
    if not texts:  # no examples (a node none of whose labels the server's map has): no error,
        # since whether a round fails must not depend on the data
        if mode is Mode.ADAPTER_CLASSIFIER:
            return LocalData(labels=label_tensor, input_ids=[])
        hidden = get_model().encoder.hidden_size
        return LocalData(labels=label_tensor, features=torch.zeros(0, hidden))
    if mode is Mode.ADAPTER_CLASSIFIER:
        tokens = get_model().encoder.tokenize(list(texts))
        return LocalData(labels=label_tensor, input_ids=tokens.input_ids)
    model: QueryEncoder | None = None

    def compute(todo: list[str]) -> torch.Tensor:
        nonlocal model
        model = model or get_model()
        return features_for(model, todo, batch_size=batch_size, progress=progress, desc=desc)

    if cache is None:
        return LocalData(labels=label_tensor, features=compute(list(texts)))
    space = functools.partial(space_key, model_cfg, device=device)  # asked again once loaded
    features = cache.features(space, texts, compute, desc=desc)
    return LocalData(labels=label_tensor, features=features)


def prepare_for(
    settings: Settings,
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    get_model: Callable[[], QueryEncoder],
    desc: str,
) -> LocalData:
    """:func:`prepare_data` with everything taken from the run's settings (disk cache on)."""
    return prepare_data(
        texts,
        labels,
        mode=settings.train.mode,
        model_cfg=settings.model,
        device=settings.device,
        get_model=get_model,
        cache=FeatureCache(settings.cache_dir),
        batch_size=settings.train.feature_batch_size,
        progress=settings.progress,
        desc=desc,
    )


def features_for(
    model: QueryEncoder,
    texts: Sequence[str],
    *,
    batch_size: int,
    progress: bool = True,
    desc: str = "features",
    bucket: bool = True,
) -> torch.Tensor:
    """Pooled vectors ``(n, d)`` through the current adapter, batched by length."""
    tokens = model.encoder.tokenize(list(texts))
    return extract_features(
        model.encode,
        model.encoder.pad,
        tokens.input_ids,
        batch_size=batch_size,
        bucket=bucket,
        progress=progress,
        desc=desc,
    )
