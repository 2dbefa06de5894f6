"""The retriever and its training: the adapter, the head (and its mixture of experts), epochs,
evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from car_fl.settings.choices import (
    AdapterKind,
    ExpertSending,
    HeadKind,
    Lexical,
    MapKind,
    Mode,
    OptimizerKind,
    Similarity,
    at_least,
    positive,
)


@dataclass
class AdapterConfig:
    """The soft-embedding adapter between the token embeddings and the first block
    (:mod:`car_fl.adapters`); it trains in ``mode=adapter`` only, at ``train.adapter_lr``."""

    #: full (d×d), lowrank (identity + a rank-``rank`` residual), diagonal: :class:`AdapterKind`.
    kind: AdapterKind = AdapterKind.FULL
    #: lowrank: the rank r of the residual (1 ≤ r ≤ d; 4 to 64 is typical).
    rank: int = 16
    #: λ of the identity anchor (L2-SP): λ·‖ADP − I‖²_F added to the loss (0: none); it depends
    #: on the adapter alone, so under dp=record it is post-processing.
    anchor: float = 0.0
    #: Dropout on the soft embeddings (the adapter's output) while training (0: none).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.kind = AdapterKind.parse("adapter.kind", self.kind)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"adapter.rank must be an integer >= 1, got {self.rank!r}")
        if not (isinstance(self.anchor, int | float) and 0 <= self.anchor < float("inf")):
            raise ValueError(
                f"adapter.anchor (λ of the identity anchor) must be a finite number >= 0, got "
                f"{self.anchor!r}; e.g. adapter.anchor=0.01"
            )
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class HeadConfig:
    """How labels are scored (:class:`HeadKind`)."""

    kind: HeadKind = HeadKind.CLASSIFIER
    #: Classifier head. null: a single linear layer d -> labels; an int n: linear d -> n,
    #: dropout, linear n -> labels.
    pre_classifier_dim: int | None = None
    dropout: float = 0.0
    #: mips / knn: dot or cosine; null: ``model.similarity``, filled in when composed (a head
    #: built without it scores with dot).
    similarity: Similarity | None = None
    #: MIPS training scores are divided by this.
    temperature: float = 1.0
    knn_k: int = 10
    #: document / moe: scores are s·cos(query, row); s starts here (a softmax temperature
    #: 1/s) and is learned when learn_scale.
    scale: float = 20.0
    learn_scale: bool = True
    #: document / moe: train a residual per document row (rows = document embedding + Δ, Δ = 0
    #: at start; learning rate train.rows_lr). false: rows stay the document embeddings.
    train_rows: bool = True
    #: document / moe: maps shared by all documents, identity at start, on each side.
    query_map: MapKind = MapKind.LINEAR
    document_map: MapKind = MapKind.NONE
    #: Rank of a lowrank map.
    map_rank: int = 64
    #: bm25: a BM25 index beside the head, the rankings fused by reciprocal rank (approach=fusion).
    lexical: Lexical = Lexical.NONE
    #: fused = w / (fusion_k + head's rank) + 1 / (fusion_k + BM25's rank).
    fusion_k: int = 60
    #: w above (1: plain reciprocal-rank fusion; 0: BM25 alone, its ties ordered by the head).
    fusion_weight: float = 1.0

    def __post_init__(self) -> None:
        self.kind = HeadKind.parse("head.kind", self.kind)
        if self.similarity is not None:
            self.similarity = Similarity.parse("head.similarity", self.similarity)
        self.query_map = MapKind.parse("head.query_map", self.query_map)
        self.document_map = MapKind.parse("head.document_map", self.document_map)
        self.lexical = Lexical.parse("head.lexical", self.lexical)
        at_least("head.fusion_k", self.fusion_k, 1)
        if not self.fusion_weight >= 0:
            raise ValueError(f"head.fusion_weight must be >= 0, got {self.fusion_weight}")
        positive("head.temperature", self.temperature)
        positive("head.scale", self.scale)
        at_least("head.map_rank", self.map_rank, 1)
        at_least("head.knn_k", self.knn_k, 1)
        if self.pre_classifier_dim is not None and self.pre_classifier_dim < 1:
            raise ValueError(
                f"head.pre_classifier_dim must be a positive size or null, "
                f"got {self.pre_classifier_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"head.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class MoEConfig:
    """The mixture of experts (``head.kind=moe``, :mod:`car_fl.heads.experts`): ``experts``
    balanced clusters of documents (in ``groups`` first for a two-level gate); a query goes to
    its ``route`` best experts (within its ``route_groups`` best groups)."""

    experts: int = 64
    route: int = 4
    #: Experts a query reaches at evaluation and retrieval (null: ``route``).
    eval_route: int | None = None
    #: Two levels: the experts in this many groups (null: one level, a gate over all experts).
    groups: int | None = None
    route_groups: int = 2
    #: What a client trains and sends (:class:`ExpertSending`); ``schedule`` gives each client
    #: one of ``schedule_blocks`` blocks of experts per round, rotating.
    send: ExpertSending = ExpertSending.ROUTED
    schedule_blocks: int = 4
    #: Lloyd iterations of the balanced clustering.
    iterations: int = 10

    def __post_init__(self) -> None:
        self.send = ExpertSending.parse("moe.send", self.send)
        at_least("moe.experts", self.experts, 1)
        if not 1 <= self.route <= self.experts:
            raise ValueError(
                f"moe.route must be in [1, moe.experts={self.experts}], got {self.route}"
            )
        if self.eval_route is not None and not self.route <= self.eval_route <= self.experts:
            raise ValueError(
                f"moe.eval_route must be in [moe.route={self.route}, moe.experts="
                f"{self.experts}] (or null: route), got {self.eval_route}"
            )
        if self.groups is not None:
            if not 2 <= self.groups <= self.experts or self.experts % self.groups:
                raise ValueError(
                    f"moe.groups must divide moe.experts={self.experts} and be >= 2 (or null for "
                    f"one level), got {self.groups}"
                )
            if not 1 <= self.route_groups <= self.groups:
                raise ValueError(
                    f"moe.route_groups must be in [1, moe.groups={self.groups}], "
                    f"got {self.route_groups}"
                )
            if self.route > self.route_groups * self.experts // self.groups:
                raise ValueError(
                    f"moe.route={self.route} exceeds the experts of the moe.route_groups="
                    f"{self.route_groups} groups a query reaches"
                )
        if self.send is ExpertSending.SCHEDULE and not 1 <= self.schedule_blocks <= self.experts:
            raise ValueError(
                f"moe.schedule_blocks must be in [1, moe.experts={self.experts}], "
                f"got {self.schedule_blocks}"
            )
        at_least("moe.iterations", self.iterations, 0)


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
