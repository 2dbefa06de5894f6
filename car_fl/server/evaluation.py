"""The server's evaluation of the global model, which holds validation and test.

Clients train on shards of the training split only; the server prepares the held-out splits
once (:class:`~car_fl.method.evaluation.HeldOut`) and evaluates every round's global model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import ArrayRecord

from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits
from car_fl.method.evaluation import HeldOut, LazyRetriever
from car_fl.method.experts import ExpertLayout, MixtureHead
from car_fl.method.model import CaRRetriever, build_retriever
from car_fl.protocol.messages import from_record
from car_fl.settings.schema import Settings


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
                settings,
                len(splits.label_map),
                hidden_size=int(held_out.test.features.shape[1]),
                documents=lazy.documents,
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

    @property
    def layout(self) -> ExpertLayout | None:
        """The mixture of experts' layout (the server's clustering), sent to every client."""
        head = self.model.head
        return head.layout if isinstance(head, MixtureHead) else None

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of the global model ``arrays``."""
        self.model.load_trainable_state_dict(from_record(arrays))
        return self.held_out.evaluate(self.model, self.settings)
