"""The retriever's training: epochs, evaluation (the adapter's section is
:mod:`car_fl.adapters.config`'s; the head's and its experts' :mod:`car_fl.heads.config`'s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from car_fl.settings.choices import Mode, OptimizerKind, at_least, positive


@dataclass
class TrainConfig:
    """Local optimisation: mode, epochs, batch size, optimiser."""

    mode: Mode = Mode.CLASSIFIER
    epochs: int = 10
    batch_size: int = 4
    lr: float = 1e-3
    #: The adapter's learning rate; null: same as lr.
    adapter_lr: float | None = None
    #: The document rows' learning rate (head.kind=document or moe); null: same as lr.
    rows_lr: float | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    weight_decay: float = 0.0
    momentum: float = 0.0
    eval_batch_size: int = 64
    feature_batch_size: int = 32
    #: Training stops once this many epochs (or rounds that trained) have not improved on
    #: validation; null: every epoch or round runs.
    patience: int | None = None
    #: adapter+classifier, centralised: first train the head alone for up to this many epochs
    #: on cached features (keeping the epoch validation selects), then the adapter and that
    #: head together (Kumar et al., 2022); the probed head is epoch 0. 0: none.
    probe_epochs: int = 0

    def __post_init__(self) -> None:
        self.mode = Mode.parse("train.mode", self.mode)
        at_least("train.probe_epochs", self.probe_epochs, 0)
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"train.patience must be >= 1 or null, got {self.patience}")
        self.optimizer = OptimizerKind.parse("train.optimizer", self.optimizer)
        for key in ("epochs", "batch_size", "eval_batch_size", "feature_batch_size"):
            at_least(f"train.{key}", getattr(self, key), 1)
        positive("train.lr", self.lr)
        if self.adapter_lr is not None:
            positive("train.adapter_lr", self.adapter_lr)
        if self.rows_lr is not None:
            positive("train.rows_lr", self.rows_lr)
        at_least("train.weight_decay", self.weight_decay, 0)
        if not 0 <= self.momentum < 1:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum}")


@dataclass
class EvalConfig:
    """Which top-K accuracies are reported, and what a federation's server evaluates when
    (docs/performance.md, "Evaluation in a federation")."""

    top_k: list[int] = field(default_factory=lambda: [1, 3, 5, 10])
    #: Federated runs: test every round's global state (null: in classifier mode only; else
    #: test once at the end, the final and the selected state).
    test_every_round: bool | None = None
    #: Federated runs: validate each round on a seeded sample of this many (0: all).
    val_sample: int = 0
    #: Federated runs: evaluate round r while round r + 1 trains (null: in adapter mode only);
    #: the results, patience included, are the same.
    background: bool | None = None

    def __post_init__(self) -> None:
        if not self.top_k or any(k < 1 for k in self.top_k):
            raise ValueError(f"eval.top_k must be a non-empty list of K >= 1, got {self.top_k}")
        self.top_k = sorted(set(self.top_k))
        if self.val_sample < 0:
            raise ValueError(
                f"eval.val_sample must be >= 0 (0: all validation examples), got {self.val_sample}"
            )
