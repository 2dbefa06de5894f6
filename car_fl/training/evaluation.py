"""Evaluation on the held-out splits: validation selects the model, test is reported.

:class:`HeldOut` prepares both splits once and evaluates a model on them (the centralised run
after each epoch; the server after each round, :mod:`car_fl.server.evaluation`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from car_fl.data.splits import DataSplits
from car_fl.model.build import build_retriever
from car_fl.model.documents import split_texts
from car_fl.model.features import LocalData, prepare_for
from car_fl.model.retriever import CaRRetriever
from car_fl.results.selection import eval_row
from car_fl.settings.schema import Lexical, Settings
from car_fl.training.train import evaluate


class LazyRetriever:
    """The run's retriever, built (encoder loaded) only when a feature is not cached."""

    def __init__(self, settings: Settings, splits: DataSplits) -> None:
        self.settings, self.names = settings, splits.label_map.names
        self.documents = split_texts(settings, splits)
        self.model: CaRRetriever | None = None

    def __call__(self) -> CaRRetriever:
        if self.model is None:
            self.model = build_retriever(self.settings, len(self.names), documents=self.documents)
        return self.model


@dataclass
class HeldOut:
    """Validation (``None`` without one: ``dataset.val_fraction=0``) and test examples. A corpus
    with new documents also reports ``new_*`` and ``old_*`` metrics: on the queries of documents
    that had no training query, and on the others."""

    test: LocalData
    validation: LocalData | None
    new_documents: frozenset[int] = frozenset()

    def subsets(self, data: LocalData) -> dict[str, torch.Tensor]:
        """``new`` and ``old`` query masks of ``data`` (none without new documents)."""
        if not self.new_documents:
            return {}
        new = torch.isin(data.labels, torch.tensor(sorted(self.new_documents)))
        return {"new": new, "old": ~new}

    @classmethod
    def prepare(
        cls,
        settings: Settings,
        splits: DataSplits,
        *,
        get_model: Callable[[], CaRRetriever],
        desc: str = "",
    ) -> HeldOut:
        """Features (or token ids) of the test and validation splits; ``desc`` prefixes the bars."""
        test = prepare_for(
            settings,
            splits.test["text"],
            splits.test["label"],
            get_model=get_model,
            desc=f"{desc}test features",
        )
        validation = (
            prepare_for(
                settings,
                splits.validation["text"],
                splits.validation["label"],
                get_model=get_model,
                desc=f"{desc}validation features",
            )
            if len(splits.validation)
            else None
        )
        if settings.head.lexical is not Lexical.NONE:  # the fused ranking reads the texts
            test = dataclasses.replace(test, texts=tuple(splits.test["text"]))
            if validation is not None:
                validation = dataclasses.replace(validation, texts=tuple(splits.validation["text"]))
        return cls(test=test, validation=validation, new_documents=splits.new_documents)

    @property
    def selection(self) -> str:
        """How the best model is chosen (the summary's ``selection``)."""
        return "validation" if self.validation is not None else "final (no validation split)"

    def evaluate(self, model: CaRRetriever, settings: Settings) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of ``model``."""
        return eval_row(
            self.metrics_on(self.validation, model, settings), self.on_test(model, settings)
        )

    def metrics_on(
        self, data: LocalData | None, model: CaRRetriever, settings: Settings
    ) -> dict[str, float] | None:
        """The metrics of ``model`` on ``data`` (unprefixed), or None without data."""
        if data is None:
            return None
        return evaluate(
            model,
            data,
            batch_size=settings.train.eval_batch_size,
            top_k=settings.eval.top_k,
            subsets=self.subsets(data),
        )

    def on_test(self, model: CaRRetriever, settings: Settings) -> dict[str, float]:
        """The metrics of ``model`` on the test split (unprefixed)."""
        metrics = self.metrics_on(self.test, model, settings)
        assert metrics is not None
        return metrics

    def sample_validation(self, size: int, *, seed: int) -> HeldOut:
        """The same splits with validation cut to ``size`` examples drawn with ``seed`` (kept
        in their order); as it is when ``size`` is 0 or not smaller than validation."""
        if self.validation is None or size == 0 or size >= len(self.validation):
            return self
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(len(self.validation), generator=generator)[:size]
        positions = sorted(int(i) for i in chosen)
        return HeldOut(self.test, self.validation.select(positions), self.new_documents)
