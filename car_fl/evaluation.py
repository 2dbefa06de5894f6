"""Evaluation on the held-out splits: validation selects the model, test is reported.

:class:`HeldOut` prepares both splits once and evaluates a model on them (the centralised run
after each epoch, the server after each round); :class:`ServerEvaluator` is the server's
evaluation of the global model, which holds the held-out splits (clients train on shards of the
training split only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord

from car_fl.config import Settings
from car_fl.data import load_splits, partition
from car_fl.data.labels import LabelMap
from car_fl.data.splits import DataSplits
from car_fl.features import LocalData, prepare_for
from car_fl.model import CaRRetriever, build_retriever
from car_fl.records import from_record
from car_fl.retrieval import label_documents
from car_fl.selection import eval_row
from car_fl.train import evaluate


class LazyRetriever:
    """The run's retriever, built (encoder loaded) only when a feature is not cached."""

    def __init__(self, settings: Settings, splits: DataSplits) -> None:
        self.settings, self.names = settings, splits.label_map.names
        self.model: CaRRetriever | None = None

    def __call__(self) -> CaRRetriever:
        if self.model is None:
            documents = label_documents(self.names, self.settings.dataset.label_texts)
            self.model = build_retriever(self.settings, len(self.names), documents=documents)
        return self.model


@dataclass
class HeldOut:
    """Validation (``None`` without one: ``dataset.val_fraction=0``) and test examples."""

    test: LocalData
    validation: LocalData | None

    @classmethod
    def prepare(
        cls,
        settings: Settings,
        splits: DataSplits,
        *,
        get_model: Callable[[], CaRRetriever],
        desc: str = "",
    ) -> HeldOut:
        """Features (or token ids) of the test and validation splits; ``desc`` prefixes the
        progress bars (e.g. ``"server "``)."""
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
        return cls(test=test, validation=validation)

    @property
    def selection(self) -> str:
        """How the best model is chosen (the summary's ``selection``)."""
        return "validation" if self.validation is not None else "final (no validation split)"

    def evaluate(self, model: CaRRetriever, settings: Settings) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of ``model``."""
        batch, top_k = settings.train.eval_batch_size, settings.eval.top_k
        return eval_row(
            evaluate(model, self.validation, batch_size=batch, top_k=top_k)
            if self.validation is not None
            else None,
            evaluate(model, self.test, batch_size=batch, top_k=top_k),
        )


@dataclass
class ServerEvaluator:
    """The global model's evaluation on the server, which holds validation and test."""

    settings: Settings
    label_map: LabelMap
    held_out: HeldOut
    model: CaRRetriever
    #: Examples in each client's shard of this run (partition id → count), the reply cap.
    shard_sizes: dict[int, int] = field(default_factory=dict)
    #: Split sizes and the duplicates removed before splitting.
    data_stats: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, settings: Settings) -> ServerEvaluator:
        splits = load_splits(settings.dataset, seed=settings.seed)
        lazy = LazyRetriever(settings, splits)
        held_out = HeldOut.prepare(settings, splits, get_model=lazy, desc="server ")
        if lazy.model is not None:
            model = lazy.model
        else:  # classifier mode with cached test features: no encoder needed on the server
            assert held_out.test.features is not None
            model = build_retriever(
                settings, len(splits.label_map), hidden_size=int(held_out.test.features.shape[1])
            )
        shard_sizes = {
            pid: len(
                partition(
                    splits.train,
                    partition_id=pid,
                    num_partitions=settings.fl.clients,
                    scheme=settings.fl.partitioning,
                    alpha=settings.fl.alpha,
                    seed=settings.seed,
                )
            )
            for pid in range(settings.fl.clients)
        }
        return cls(
            settings=settings,
            label_map=splits.label_map,
            held_out=held_out,
            model=model,
            shard_sizes=shard_sizes,
            data_stats=splits.stats,
        )

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of the global model ``arrays``."""
        self.model.load_trainable_state_dict(from_record(arrays))
        return self.held_out.evaluate(self.model, self.settings)
