"""The server's evaluation of the global model, which holds validation and test.

Every round's global model on validation (selection), and on test every round or once at the
end (:class:`EvalPlan`). Clients never evaluate: selection rests on the server's own figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord

from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.experts import MixtureHead
from car_fl.model.build import build_retriever
from car_fl.model.retriever import CaRRetriever
from car_fl.protocol.messages import from_record
from car_fl.results.selection import eval_row
from car_fl.settings.schema import Mode, Settings
from car_fl.training.evaluation import HeldOut, LazyRetriever


@dataclass(frozen=True)
class EvalPlan:
    """What the server evaluates when, from ``eval.*`` (null: by mode)."""

    #: Test metrics every round; else once at the end, for the final and the selected state.
    test_every_round: bool
    #: Validation examples evaluated each round (0: all).
    val_sample: int
    #: Round r's evaluation runs while round r + 1 trains.
    background: bool

    @classmethod
    def of(cls, settings: Settings) -> EvalPlan:
        cheap = settings.train.mode is Mode.CLASSIFIER  # cached features: a head's pass
        test, background = settings.eval.test_every_round, settings.eval.background
        return cls(
            test_every_round=cheap if test is None else test,
            val_sample=settings.eval.val_sample,
            background=(not cheap) if background is None else background,
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
    #: What is evaluated each round (exact, every round, by default).
    plan: EvalPlan = EvalPlan(test_every_round=True, val_sample=0, background=False)
    #: The validation each round is evaluated on (``held_out``'s, or its seeded sample).
    per_round: HeldOut | None = None

    def __post_init__(self) -> None:
        if self.per_round is None:
            self.per_round = self.held_out.sample_validation(
                self.plan.val_sample, seed=self.settings.seed
            )

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
            plan=EvalPlan.of(settings),
        )

    @property
    def layout(self) -> ExpertLayout | None:
        """The mixture of experts' layout (the server's clustering), sent to every client."""
        head = self.model.head
        return head.layout if isinstance(head, MixtureHead) else None

    @property
    def tests_every_round(self) -> bool:
        """Whether each round has test metrics (always without a validation split)."""
        return self.plan.test_every_round or self.held_out.validation is None

    @property
    def selection(self) -> str:
        """How the best state is chosen (the summary's ``selection``)."""
        held = self.per_round
        assert held is not None
        if held.validation is None or held.validation is self.held_out.validation:
            return self.held_out.selection
        whole = len(self.held_out.validation or [])
        return f"validation sample ({len(held.validation)} of {whole})"

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        """One round's metrics of the global model ``arrays``: ``val_*`` (on the sample, if
        one is set) and ``test_*``, which are NaN when the test set waits for the end."""
        self.model.load_trainable_state_dict(from_record(arrays))
        held = self.per_round
        assert held is not None
        if self.tests_every_round:
            return held.evaluate(self.model, self.settings)
        validation = held.metrics_on(held.validation, self.model, self.settings)
        assert validation is not None
        later = {name: math.nan for name in validation}  # the same metrics, on test, later
        return eval_row(validation, later)

    def test(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """``test_*`` metrics of the trainable ``state`` (the whole test split)."""
        self.model.load_trainable_state_dict(state)
        return eval_row(None, self.held_out.on_test(self.model, self.settings))
