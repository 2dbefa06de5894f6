"""Serving a trained checkpoint: a retriever with its labels, documents and weights.

:func:`load_retriever` reads a checkpoint folder written by a run (its settings, label map and
trainable tensors) and gives a :class:`~car_fl.method.model.CaRRetriever` ready for
:meth:`~car_fl.method.model.CaRRetriever.retrieve`. A kNN checkpoint holds no weights: its
memory is rebuilt from the training split its settings name (:func:`training_features`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from car_fl.data.labels import LabelMap
from car_fl.method.features import LocalData, QueryEncoder, prepare_for
from car_fl.method.model import CaRRetriever, build_retriever
from car_fl.method.retrieval import label_documents
from car_fl.method.scorers import KNNScorer
from car_fl.results.checkpoint import load_checkpoint
from car_fl.settings.schema import Settings


def load_retriever(
    path: str | Path, *, device: str | None = "auto", model: str | None = None
) -> CaRRetriever:
    """A retriever ready for ``retrieve``, from a folder written by
    :func:`car_fl.results.checkpoint.save_checkpoint`: its settings, label map and weights.

    ``device``: where to run (``None``: the checkpoint's setting); ``model``: an encoder hub id
    or folder in place of the one it was trained with. MIPS gets its label documents; kNN, which
    has no weights, rebuilds its memory from the training split its settings name
    (``FileNotFoundError`` when that data cannot be read).
    """
    ckpt = load_checkpoint(path)
    settings = ckpt.settings
    if model is not None:
        settings.model.name_or_path = model
    if device is not None:
        settings.device = device
    names = ckpt.label_map.names
    documents = label_documents(names, settings.dataset.label_texts)
    retriever = build_retriever(settings, len(names), documents=documents)
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
