"""Serving a trained checkpoint: :func:`load_retriever` gives a ready
:class:`~car_fl.model.retriever.CaRRetriever`; a kNN checkpoint, which holds no weights,
rebuilds its memory from the training split its settings name (:func:`training_features`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from car_fl.data.labels import LabelMap
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.experts import MixtureHead
from car_fl.heads.retrieval import KNNScorer
from car_fl.model.encoder import Encoder
from car_fl.model.features import (
    LocalData,
    QueryEncoder,
    document_texts,
    documents_identity,
    prepare_for,
)
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.model.sources import encoder_digest
from car_fl.results.run import load_checkpoint
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)


def load_retriever(
    path: str | Path,
    *,
    device: str | None = "auto",
    model: str | None = None,
    blocks_service: str | None = None,
    documents_path: str | Path | None = None,
    encoder: Encoder | None = None,
) -> CaRRetriever:
    """A retriever ready for ``retrieve``, from a folder a run checkpointed (its weights, labels).

    ``device`` (None: the checkpoint's), ``model`` (an encoder in place of the trained one),
    ``documents_path`` (its digest must match) and ``encoder`` (one already in memory, e.g.
    :meth:`car_fl.serving.rag.Generator.as_encoder`) replace what the checkpoint names.
    """
    ckpt = load_checkpoint(path)
    settings = ckpt.settings
    if model is not None:
        settings.model.name_or_path = model
    if blocks_service is not None:  # the blocks on a service (car_fl.blocks), not loaded here
        settings.model.blocks, settings.model.blocks_service = "remote", blocks_service
    if device is not None:
        settings.device = device
    if documents_path is not None:
        settings.dataset.documents_path = str(documents_path)
    names = ckpt.label_map.names
    check_documents(settings, names, ckpt.extra, path)
    trained_with, now = ckpt.extra.get(ENCODER_EXTRA), encoder_digest(settings.model)
    if encoder is None and trained_with is not None and now is not None and now != trained_with:
        log.warning(
            "%s was trained with another encoder than %s holds here (digest %s, here %s): its "
            "adapter and head expect that one's features, and may retrieve worse",
            path,
            settings.model.name_or_path,
            trained_with,
            now,
        )
    documents = document_texts(settings, names)
    layout = ckpt.extra.get(LAYOUT_EXTRA)
    retriever = build_retriever(
        settings,
        len(names),
        encoder=encoder,
        documents=documents,
        layout=ExpertLayout.from_text(layout) if layout else None,
    )
    retriever.load_trainable_state_dict(ckpt.state)
    if isinstance(retriever.head, KNNScorer):  # no weights: its memory is the training split
        try:
            memory = training_features(settings, ckpt.label_map, get_model=lambda: retriever)
        except (OSError, ValueError) as err:  # the data is missing or unreadable
            raise FileNotFoundError(
                f"{path} is a kNN checkpoint: it holds no weights, and its memory, the "
                f"training split of {settings.dataset.path or settings.dataset.hub_id!r}, "
                f"could not be read ({err}); make that data reachable, or retrieve from a "
                "classifier or MIPS checkpoint"
            ) from err
        assert memory.features is not None  # kNN trains nothing: classifier mode
        retriever.set_memory(memory.features, memory.labels)
    retriever.set_labels(names, documents, settings=settings)
    retriever.eval()
    return retriever


def training_features(
    settings: Settings, label_map: LabelMap, *, get_model: Callable[[], QueryEncoder]
) -> LocalData:
    """The training split that ``settings`` name, with ``label_map``'s ids, prepared."""
    from car_fl.data.splits import load_splits  # datasets: only when asked

    splits = load_splits(settings.dataset, seed=settings.seed, label_map=label_map)
    train = splits.train
    return prepare_for(
        settings, train["text"], train["label"], get_model=get_model, desc="training features"
    )


#: Checkpoint ``extra`` keys: the corpus's digest, a mixture of experts' layout, the encoder's.
DIGEST_EXTRA = "documents_digest"
LAYOUT_EXTRA = "moe_layout"
ENCODER_EXTRA = "encoder_digest"


def checkpoint_extra(
    settings: Settings, names: Sequence[str], model: CaRRetriever
) -> dict[str, str]:
    """What a run's checkpoints record beside the weights so that they can serve documents,
    and the encoder they were trained with (a resume refuses another)."""
    extra = dict(documents_identity(settings, names))
    encoder = encoder_digest(settings.model)
    if encoder is not None:
        extra[ENCODER_EXTRA] = encoder
    if isinstance(model.head, MixtureHead):
        extra[LAYOUT_EXTRA] = model.head.layout.to_text()
    return extra


def check_documents(
    settings: Settings, names: Sequence[str], extra: Mapping[str, Any], path: str | Path
) -> None:
    """Refuse a corpus whose documents differ from those the checkpoint was trained on."""
    recorded = extra.get(DIGEST_EXTRA)
    if recorded is None:
        return
    try:
        found = documents_identity(settings, names).get(DIGEST_EXTRA)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"{path} serves the corpus {settings.dataset.documents_path!r}, which could not be "
            f"read ({err}); pass documents_path= (car-fl retrieve --documents) to its file"
        ) from err
    if found != recorded:
        raise ValueError(
            f"the documents in {settings.dataset.documents_path} are not those {path} was "
            f"trained on (digest {found} != {recorded}); use the same documents file"
        )
