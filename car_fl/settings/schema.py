"""The configuration schema: typed, validated settings, and the single source of defaults.

Longer than 300 lines because it is one schema: every section of :class:`Settings`, its
defaults (``#:`` comments say what each value means) and its validation, read in one place.

Each section's ``__post_init__`` rejects impossible values with a message naming the key and
the fix, and turns the names of a choice into its :class:`Choice` enum. Hydra registers these
dataclasses as the schema of ``conf/`` (:mod:`car_fl.settings.compose`), so a group file there
holds only what it changes. Checks that need the privacy accountant (a reachable target ε) are
in :mod:`car_fl.settings.dp_plan`. Imports nothing of car-fl, nor Hydra, OmegaConf or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import EnumType, StrEnum
from typing import Any, NamedTuple, Self


class _ByValue(EnumType):
    """OmegaConf looks an enum member up by name (``Mode["..."]``); this accepts its value too,
    so that ``conf/`` and overrides write ``train.mode=adapter+classifier`` as users read it."""

    def __getitem__(cls, name: Any) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            return cls(name)


class Choice(StrEnum, metaclass=_ByValue):
    """A setting with a fixed set of values (a ``str`` enum: it compares equal to its value)."""

    @classmethod
    def parse(cls, key: str, value: object) -> Self:
        """The member named by ``value``; a ``ValueError`` naming ``key`` and the valid values."""
        try:
            return cls(value)  # type: ignore[arg-type]  # a str, or a member
        except ValueError:
            raise ValueError(
                f"{key}={value!r} is not valid; choose one of {', '.join(m.value for m in cls)}"
            ) from None


class Mode(Choice):
    """What is trained: the head alone on cached features, or the adapter and the head."""

    CLASSIFIER = "classifier"
    ADAPTER_CLASSIFIER = "adapter+classifier"


class Pooling(Choice):
    """How a sequence's hidden states become one vector.

    ``eos``: the state of an EOS token appended to every text (the method's choice for
    generative LMs); ``last``: the state of the text's own last token, nothing appended (what
    PromptEOL-style templates read); ``mean``: the masked mean over the real tokens.
    """

    EOS = "eos"
    LAST = "last"
    MEAN = "mean"


class FeatureNorm(Choice):
    """What each pooled vector is divided by, per example (nothing about other records).

    ``l2``: its Euclidean norm, so every feature has norm 1 (a linear head and DP clipping see
    one scale whatever a model's few very large dimensions do).
    """

    NONE = "none"
    L2 = "l2"


class DPMode(Choice):
    """Local differential privacy: off, fixed clipping bound, adaptive clipping, or DP-SGD.

    ``record``: record-level DP-SGD on each client (:mod:`car_fl.privacy.dpsgd`).
    """

    NONE = "none"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    RECORD = "record"


class HeadKind(Choice):
    """How labels are scored: CaR's classifier, MIPS against label documents, or kNN."""

    CLASSIFIER = "classifier"
    MIPS = "mips"
    KNN = "knn"
    #: Rows start as the documents' embeddings (CaR starts where MIPS is), with a shared
    #: query-side map (:mod:`car_fl.method.document_head`).
    DOCUMENT = "document"
    #: The document head split into experts (clusters of documents) behind a gate
    #: (:mod:`car_fl.method.experts`).
    MOE = "moe"


class MapKind(Choice):
    """A shared map on the query (or document) side of a document head, identity at start."""

    NONE = "none"
    #: x + x Mᵀ with a full d×d M (zero at start).
    LINEAR = "linear"
    #: x + x Uᵀ Vᵀ, U (r×d), V (d×r) zero at start: rank ``head.map_rank``.
    LOWRANK = "lowrank"


class ExpertSending(Choice):
    """Which experts a client trains and sends (:mod:`car_fl.method.experts`).

    ``routed``: those its queries reach (data-dependent: refused under any DP mode).
    ``all``: every expert, noised under DP. ``schedule``: the block of experts the server's
    fixed rotation gives the client this round (data-independent, fewer bytes both ways).
    """

    ROUTED = "routed"
    ALL = "all"
    SCHEDULE = "schedule"


class Similarity(Choice):
    """Inner product of the raw vectors, or of unit vectors (cosine)."""

    DOT = "dot"
    COSINE = "cosine"


class Reader(Choice):
    """File formats understood by :mod:`car_fl.data.readers`."""

    SMS_SPAM = "sms_spam"
    AG_NEWS = "ag_news"
    ARXIV = "arxiv"
    TABLE = "table"
    #: A document corpus: ``dataset.documents_path`` (documents) and ``dataset.path`` (queries).
    CORPUS = "corpus"


class OptimizerKind(Choice):
    """The ``torch.optim`` optimisers a run may use (``train.optimizer``)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


class Granularity(Choice):
    """Local DP: clip and noise once per round, or after every optimizer step (Algorithm 1)."""

    ROUND = "round"
    STEP = "step"


class NoiseRule(Choice):
    """Adaptive DP: noise std z_Δ·Cᵢ (``mechanism``), or Algorithm 1's bound on the raw norm."""

    MECHANISM = "mechanism"
    BOUND = "bound"


class AdaptiveRule(Choice):
    """How an adaptive clipping bound moves (:mod:`car_fl.privacy.adaptive`).

    ``geometric``: Andrew et al. (2021), from a noised clipped indicator: private.
    ``linear``: the CaR paper's C ← (1 − β)·C + β·γ·‖Δ‖ on the raw norm: not private.
    """

    GEOMETRIC = "geometric"
    LINEAR = "linear"


class Partitioning(Choice):
    """How the training split is divided among clients."""

    IID = "iid"
    DIRICHLET = "dirichlet"
    #: A corpus's queries, Dirichlet(α) over their documents' topic (``dataset.topic_key``).
    TOPIC = "topic"


class NormBoundMode(Choice):
    """The server's bound on a reply's update norm (:mod:`car_fl.server.update_norm`)."""

    AUTO = "auto"
    OFF = "off"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    DP = "dp"


class NormBoundAction(Choice):
    """What the server does with a reply above the update-norm bound."""

    REJECT = "reject"
    CLIP = "clip"


class StrategyName(Choice):
    """``strategy.name``: one ``conf/strategy/<name>.yaml`` each; :mod:`car_fl.server.aggregation`
    builds each one's Flower strategy."""

    FEDAVG = "fedavg"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed_mean"
    KRUM = "krum"
    MULTIKRUM = "multikrum"
    FEDADAM = "fedadam"
    FEDYOGI = "fedyogi"
    FEDAVGM = "fedavgm"
    FEDPROX = "fedprox"


class ApproachSpec(NamedTuple):
    """What an approach sets (``head.kind``, ``train.mode``) and what reports call it."""

    head: HeadKind
    mode: Mode
    label: str
    description: str


class Approach(StrEnum):
    """The retrieval approaches of the method's MIPS comparison, in its order, plus kNN.

    ``approach=<name>`` (a Hydra group registered from :data:`APPROACHES`) sets ``head.kind``
    and ``train.mode``, overriding ``mode=``.
    """

    MIPS = "mips"
    ADAPTER_MIPS = "adapter_mips"
    CAR = "car"
    ADAPTER_CAR = "adapter_car"
    KNN = "knn"
    DOCUMENT = "document"
    ADAPTER_DOCUMENT = "adapter_document"
    MOE = "moe"

    @property
    def label(self) -> str:
        """The name reports use: ``MIPS``, ``classifier (CaR)``, ..."""
        return APPROACHES[self].label

    @classmethod
    def of(cls, head: HeadKind, mode: Mode) -> Approach:
        """The approach of a head kind and a training mode."""
        for approach, spec in APPROACHES.items():
            if spec.head == head and spec.mode == mode:
                return approach
        raise ValueError(f"head.kind={head} with train.mode={mode} is no approach of car-fl")


#: The one table of approaches: ``conf``'s ``approach`` group and the reports derive from it.
APPROACHES: dict[Approach, ApproachSpec] = {
    Approach.MIPS: ApproachSpec(
        HeadKind.MIPS,
        Mode.CLASSIFIER,
        "MIPS",
        "MIPS on the frozen encoder: label documents and queries embedded alike, ranked by "
        "inner product. Nothing is trained.",
    ),
    Approach.ADAPTER_MIPS: ApproachSpec(
        HeadKind.MIPS,
        Mode.ADAPTER_CLASSIFIER,
        "adapter + MIPS",
        "MIPS with a trained soft-embedding adapter: softmax over query-document inner "
        "products, backpropagated through the frozen encoder into the adapter (no classifier "
        "head).",
    ),
    Approach.CAR: ApproachSpec(
        HeadKind.CLASSIFIER,
        Mode.CLASSIFIER,
        "classifier (CaR)",
        "CaR: the classifier head on cached hidden states of the frozen encoder.",
    ),
    Approach.ADAPTER_CAR: ApproachSpec(
        HeadKind.CLASSIFIER,
        Mode.ADAPTER_CLASSIFIER,
        "adapter + classifier (CaR)",
        "CaR with soft embeddings: the adapter and the classifier head, trained together.",
    ),
    Approach.KNN: ApproachSpec(
        HeadKind.KNN,
        Mode.CLASSIFIER,
        "kNN",
        "k nearest neighbours over the training examples' embeddings (frozen encoder), by "
        "inner product; head.knn_k neighbours vote. Nothing is trained.",
    ),
    Approach.DOCUMENT: ApproachSpec(
        HeadKind.DOCUMENT,
        Mode.CLASSIFIER,
        "document head (CaR)",
        "CaR with a document-initialised head on cached hidden states: rows start as the "
        "documents' embeddings (so it starts where MIPS is), with a shared query-side map.",
    ),
    Approach.ADAPTER_DOCUMENT: ApproachSpec(
        HeadKind.DOCUMENT,
        Mode.ADAPTER_CLASSIFIER,
        "adapter + document head (CaR)",
        "The document-initialised head and the soft-embedding adapter on the query side, "
        "trained together; document rows stay the frozen encoder's embeddings plus Δ.",
    ),
    Approach.MOE: ApproachSpec(
        HeadKind.MOE,
        Mode.CLASSIFIER,
        "mixture of experts (CaR)",
        "The document head split into experts (balanced clusters of documents) behind a gate "
        "that routes each query to its moe.route best experts.",
    ),
}

#: ``model.dtype``: ``auto`` (see :func:`car_fl.method.encoder.pick_dtype`) or a torch dtype's name.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``device``: ``auto`` (CUDA, then Apple MPS, then CPU; :func:`car_fl.method.encoder.pick_device`).
DEVICES = ("auto", "cpu", "cuda", "mps")
#: ``comm.dtype``: dtypes a tensor may travel in; bfloat16 has no NumPy dtype, so no Array.
WIRE_DTYPES = ("float32", "float16")
PADDING_SIDES = ("auto", "left", "right")


def one_of(key: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    """Reject a ``value`` of ``key`` that is not among the ``valid`` names, listing them."""
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


@dataclass
class DatasetConfig:
    """Where the examples come from and how they are split.

    ``path`` (a local file or folder) takes precedence over ``hub_id``. ``text_column`` and
    ``label_column`` name the fields of the hub dataset or of a ``table`` file. Duplicates are
    removed before splitting (``dedupe``); ``val_fraction`` of train becomes the validation
    split used for model selection.
    """

    name: str = "sms_spam"
    reader: Reader = Reader.SMS_SPAM
    hub_id: str | None = "ucirvine/sms_spam"
    hub_config: str | None = None
    path: str | None = None
    test_path: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    test_fraction: float = 0.2
    #: Share of the training examples held out for model selection (the best checkpoint; 0:
    #: none, best = final); test is only reported.
    val_fraction: float = 0.1
    #: Collapse duplicate texts (after Unicode and whitespace normalisation) before splitting;
    #: copies with conflicting labels are dropped.
    dedupe: bool = True
    stratify: bool = True
    min_examples_per_label: int = 1
    max_examples: int | None = None
    #: Each label's document text (MIPS compares queries with it); a label without one: its name.
    label_texts: dict[str, str] = field(default_factory=dict)
    #: reader=corpus: the documents file (JSONL: id, text, optional title and metadata; or a
    #: CSV/TSV with id and text columns); ``path`` is then the queries file (query, document
    #: id, optional split). Labels are the documents, in this file's order.
    documents_path: str | None = None
    #: reader=corpus: share of the documents held out as *new documents* (their training
    #: queries dropped: they arrive after training), chosen with the run's seed.
    new_fraction: float = 0.0
    #: reader=corpus: the metadata field naming a document's topic (fl.partitioning=topic).
    topic_key: str = "category"

    def __post_init__(self) -> None:
        self.reader = Reader.parse("dataset.reader", self.reader)
        if self.path is None and self.hub_id is None:
            raise ValueError(
                f"dataset {self.name!r} has neither dataset.path (a local file) nor "
                "dataset.hub_id (a Hugging Face dataset); set one of them"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction must be in (0, 1), got {self.test_fraction!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(
                f"dataset.val_fraction must be in [0, 1) (e.g. 0.1), got {self.val_fraction!r}"
            )
        if self.min_examples_per_label < 1:
            raise ValueError(
                f"dataset.min_examples_per_label must be >= 1, got {self.min_examples_per_label}"
            )
        if self.max_examples is not None and self.max_examples < 2:
            raise ValueError(f"dataset.max_examples must be >= 2 or null, got {self.max_examples}")
        if not 0.0 <= self.new_fraction < 1.0:
            raise ValueError(
                f"dataset.new_fraction must be in [0, 1) (e.g. 0.1), got {self.new_fraction!r}"
            )
        if self.reader is Reader.CORPUS and self.path is not None and not self.documents_path:
            raise ValueError(
                "dataset.reader=corpus needs dataset.documents_path (the documents file) beside "
                "dataset.path (the queries file)"
            )

    @property
    def label(self) -> str:
        """What logs, folder names and plots call the data: the local file's name, else the
        Hub dataset (``name`` is the reader's format, also for a synthetic file)."""
        if self.path is not None:
            return self.path.rstrip("/").rsplit("/", 1)[-1]
        return str(self.hub_id or self.name)


@dataclass
class ModelConfig:
    """The frozen encoder: which model, where it runs, how its output is pooled."""

    name: str = "tinyllama"
    name_or_path: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    revision: str | None = None
    dtype: str = "auto"
    pooling: Pooling = Pooling.EOS
    #: Which hidden layer is pooled: -1 the final one (after the model's last norm), 0 the
    #: embeddings, k the output of block k; negative counts from the end, as in Python.
    layer: int = -1
    #: A template around every text the encoder reads (queries and documents alike), with
    #: ``{text}`` where the text goes, e.g. PromptEOL's
    #: ``This sentence : "{text}" means in one word:"`` (with ``pooling: last``); null: none.
    prompt: str | None = None
    #: Per-example scaling of the pooled vector (:class:`FeatureNorm`).
    normalize: FeatureNorm = FeatureNorm.NONE
    max_length: int = 128
    #: Token limit of document texts (document heads, MIPS over a corpus); null: max_length.
    document_max_length: int | None = None
    padding_side: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        one_of("model.dtype", self.dtype, DTYPES)
        self.pooling = Pooling.parse("model.pooling", self.pooling)
        self.normalize = FeatureNorm.parse("model.normalize", self.normalize)
        if self.prompt is not None and self.prompt.count("{text}") != 1:
            raise ValueError(
                f"model.prompt={self.prompt!r} must hold {{text}} exactly once (where the text "
                'goes), e.g. \'This sentence : "{text}" means in one word:"\''
            )
        one_of("model.padding_side", self.padding_side, PADDING_SIDES)
        if self.max_length < 2:
            raise ValueError(f"model.max_length must be >= 2, got {self.max_length}")
        if self.document_max_length is not None and self.document_max_length < 2:
            raise ValueError(
                f"model.document_max_length must be >= 2 or null, got {self.document_max_length}"
            )


@dataclass
class HeadConfig:
    """How labels are scored (:class:`HeadKind`).

    ``classifier`` (CaR): optional linear pre-classifier with dropout, then a linear layer.
    ``mips``: query·document scores against each label's text, divided by ``temperature``
    (trains the adapter alone in ``adapter+classifier`` mode, nothing in ``classifier`` mode).
    ``knn``: votes of the ``knn_k`` most similar training examples (nothing is trained).
    """

    #: classifier: CaR (a trained classifier over the labels); mips: inner product of the query
    #: with each label's document text (dataset.label_texts, or the label name), embedded by the
    #: same encoder, trains the adapter only in mode=adapter; knn: votes of the head.knn_k most
    #: similar training examples (mode=classifier only).
    kind: HeadKind = HeadKind.CLASSIFIER
    #: Classifier head. null: a single linear layer d -> labels; an int n: linear d -> n,
    #: dropout, linear n -> labels.
    pre_classifier_dim: int | None = None
    dropout: float = 0.0
    #: mips / knn: dot (inner product) or cosine.
    similarity: Similarity = Similarity.DOT
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
    #: document / moe: shared maps learned across documents, identity at start: on the query
    #: side (so a document with one or two queries still benefits) and on the document side.
    query_map: MapKind = MapKind.LINEAR
    document_map: MapKind = MapKind.NONE
    #: Rank of a lowrank map.
    map_rank: int = 64

    def __post_init__(self) -> None:
        self.kind = HeadKind.parse("head.kind", self.kind)
        self.similarity = Similarity.parse("head.similarity", self.similarity)
        self.query_map = MapKind.parse("head.query_map", self.query_map)
        self.document_map = MapKind.parse("head.document_map", self.document_map)
        _positive("head.temperature", self.temperature)
        _positive("head.scale", self.scale)
        if self.map_rank < 1:
            raise ValueError(f"head.map_rank must be >= 1, got {self.map_rank}")
        if self.knn_k < 1:
            raise ValueError(f"head.knn_k must be >= 1, got {self.knn_k}")
        if self.pre_classifier_dim is not None and self.pre_classifier_dim < 1:
            raise ValueError(
                f"head.pre_classifier_dim must be a positive size or null, "
                f"got {self.pre_classifier_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"head.dropout must be in [0, 1), got {self.dropout}")


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
    #: Centralised training stops once this many epochs in a row have not improved the
    #: validation metric that selects the best epoch (``train.epochs`` is then a ceiling);
    #: null: every epoch runs.
    patience: int | None = None
    #: adapter+classifier, centralised: first train the head alone for this many epochs on
    #: the frozen features (cached, as CaR does), then the adapter and that head together
    #: (linear probing, then fine-tuning: Kumar et al., 2022). The probed head is the run's
    #: starting point (epoch 0), so validation never selects worse than CaR's head. 0: none.
    probe_epochs: int = 0

    def __post_init__(self) -> None:
        self.mode = Mode.parse("train.mode", self.mode)
        if self.probe_epochs < 0:
            raise ValueError(f"train.probe_epochs must be >= 0, got {self.probe_epochs}")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"train.patience must be >= 1 or null, got {self.patience}")
        self.optimizer = OptimizerKind.parse("train.optimizer", self.optimizer)
        for key in ("epochs", "batch_size", "eval_batch_size", "feature_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        _positive("train.lr", self.lr)
        if self.adapter_lr is not None:
            _positive("train.adapter_lr", self.adapter_lr)
        if self.rows_lr is not None:
            _positive("train.rows_lr", self.rows_lr)
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass
class EvalConfig:
    """Which top-K accuracies are reported (the largest K is the retrieval K by default), and
    what a federation's server evaluates when (docs/performance.md, "Evaluation in a
    federation"). Selection is always on validation, on the server, never on test and never
    on a client's report.
    """

    top_k: list[int] = field(default_factory=lambda: [1, 3, 5, 10])
    #: Federated runs: test metrics of every round's global state. null: yes in classifier
    #: mode (cached features, evaluation is cheap), no in adapter mode (every test text goes
    #: through the adapted encoder): the test set is then evaluated once, after the last round,
    #: for the final state and for the state selected on validation.
    test_every_round: bool | None = None
    #: Federated runs: the validation examples the server evaluates each round, a sample of
    #: this many drawn with the run's seed (the same every round); 0: all of them (exact).
    val_sample: int = 0
    #: Federated runs: evaluate round r's global state in a thread of the ServerApp while
    #: round r + 1 trains, instead of between the rounds while the clients wait. null: yes in
    #: adapter mode, no in classifier mode. The results are the same; only when they are
    #: written changes (round r's row once its evaluation is done).
    background: bool | None = None

    def __post_init__(self) -> None:
        if not self.top_k or any(k < 1 for k in self.top_k):
            raise ValueError(f"eval.top_k must be a non-empty list of K >= 1, got {self.top_k}")
        self.top_k = sorted(set(self.top_k))
        if self.val_sample < 0:
            raise ValueError(
                f"eval.val_sample must be >= 0 (0: all validation examples), got {self.val_sample}"
            )


@dataclass
class FLConfig:
    """The federation (Flower): clients, rounds, local epochs, partitioning, timeouts.

    The paper's defaults: 2 clients, 5 rounds x 2 local epochs.

    Sampling: each round asks ``clients_per_round`` nodes (or ``fraction_train`` of those
    connected), never fewer than ``min_clients``. Update-norm bound (server side, on
    ‖θᵢ − θ‖): ``norm_bound`` is ``off``, ``fixed`` (``max_update_norm``), ``adaptive``
    (``norm_bound_factor`` × the round's median update norm), ``dp`` (C plus the
    1 − ``norm_bound_tail`` quantile of the fixed-DP noise norm) or ``auto`` (``dp`` under
    fixed DP per round, else ``fixed`` when ``max_update_norm`` is set, else ``off``).
    """

    clients: int = 2
    #: After all fl.clients nodes joined, a round goes ahead with at least this many (a node
    #: may die mid-run); its replies are aggregated if valid.
    min_clients: int = 1
    #: A round is aggregated only with at least this many valid replies, and this fraction of
    #: the clients asked; otherwise the global model stays exactly as it was.
    min_valid_replies: int = 1
    min_valid_fraction: float = 0.0
    #: Cap on the example count a reply may claim; null: the shard size of the partition that
    #: node holds in this run (the server pins each node to the first partition it claims and
    #: refuses a second node claiming it). Nodes started with data-is-shard hold their own
    #: data, which the server cannot size: set this cap (e.g. the largest shard) for them.
    max_examples_per_client: int | None = None
    #: Client sampling: each round asks clients_per_round nodes (null: fraction_train of those
    #: connected), at least min_clients; seeded by the run's seed and the round.
    fraction_train: float = 1.0
    clients_per_round: int | None = None
    #: Bound on a reply's update norm ||theta_i - theta|| (its modes: the class docstring).
    #: Replies above it are rejected or clipped to it (norm_bound_action: reject or clip).
    norm_bound: NormBoundMode = NormBoundMode.AUTO
    max_update_norm: float | None = None
    norm_bound_factor: float = 3.0
    norm_bound_action: NormBoundAction = NormBoundAction.REJECT
    norm_bound_tail: float = 1e-6
    rounds: int = 5
    local_epochs: int = 2
    #: iid or dirichlet (non-IID over labels, concentration fl.alpha).
    partitioning: Partitioning = Partitioning.IID
    alpha: float = 1.0
    #: Seconds the server waits for a round's replies.
    round_timeout: float = 3600.0
    #: Seconds the server waits for all clients to connect.
    wait_for_nodes: float = 120.0

    def __post_init__(self) -> None:
        for key in ("clients", "rounds", "local_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"fl.{key} must be >= 1, got {getattr(self, key)}")
        if not 1 <= self.min_clients <= self.clients:
            raise ValueError(
                f"fl.min_clients must be in [1, fl.clients={self.clients}], got {self.min_clients}"
            )
        if self.min_valid_replies < 1:
            raise ValueError(f"fl.min_valid_replies must be >= 1, got {self.min_valid_replies}")
        if not 0.0 <= self.min_valid_fraction <= 1.0:
            raise ValueError(
                f"fl.min_valid_fraction must be in [0, 1], got {self.min_valid_fraction}"
            )
        if self.max_examples_per_client is not None and self.max_examples_per_client < 1:
            raise ValueError(
                f"fl.max_examples_per_client must be >= 1 or null, "
                f"got {self.max_examples_per_client}"
            )
        self.partitioning = Partitioning.parse("fl.partitioning", self.partitioning)
        if not 0.0 < self.fraction_train <= 1.0:
            raise ValueError(f"fl.fraction_train must be in (0, 1], got {self.fraction_train}")
        if self.clients_per_round is not None and not (
            self.min_clients <= self.clients_per_round <= self.clients
        ):
            raise ValueError(
                f"fl.clients_per_round must be null or in [fl.min_clients={self.min_clients}, "
                f"fl.clients={self.clients}], got {self.clients_per_round}"
            )
        self.norm_bound = NormBoundMode.parse("fl.norm_bound", self.norm_bound)
        self.norm_bound_action = NormBoundAction.parse(
            "fl.norm_bound_action", self.norm_bound_action
        )
        if self.max_update_norm is not None:
            _positive("fl.max_update_norm", self.max_update_norm)
        if self.norm_bound is NormBoundMode.FIXED and self.max_update_norm is None:
            raise ValueError(
                "fl.norm_bound=fixed needs fl.max_update_norm (e.g. fl.max_update_norm=10.0), "
                "or use fl.norm_bound=adaptive"
            )
        if not self.norm_bound_factor >= 1.0:
            raise ValueError(f"fl.norm_bound_factor must be >= 1, got {self.norm_bound_factor}")
        if not 0.0 < self.norm_bound_tail < 1.0:
            raise ValueError(f"fl.norm_bound_tail must be in (0, 1), got {self.norm_bound_tail}")
        _positive("fl.alpha", self.alpha)
        _positive("fl.round_timeout", self.round_timeout)
        if self.wait_for_nodes < 0:
            raise ValueError(f"fl.wait_for_nodes must be >= 0, got {self.wait_for_nodes}")

    def sample_size(self, connected: int) -> int:
        """How many of ``connected`` nodes one round asks (at least ``min_clients``)."""
        wanted = self.clients_per_round or math.floor(self.fraction_train * connected + 1e-9)
        return min(connected, max(self.min_clients, wanted))


@dataclass
class DPConfig:
    """Local differential privacy on each client (see :mod:`car_fl.privacy`).

    ``conf/dp/<mode>.yaml`` describes each mechanism; the values below are shared by all.
    """

    #: none, fixed, adaptive or record (:class:`DPMode`).
    mode: DPMode = DPMode.NONE
    #: C. fixed: bound on the L2 norm of the whole round's update (all sent tensors
    #: together); adaptive: the initial C_i; record: bound on each example's gradient norm.
    clip: float = 1.0
    #: fixed: σ₀ (noise std σ₀·C); adaptive: z (needs z < 2σ_b); record: σ, used when
    #: target_epsilon is null.
    noise_multiplier: float = 0.0
    #: round: clip and noise once per round; step: after every optimizer step (Algorithm 1).
    granularity: Granularity = Granularity.ROUND
    #: The first rounds train without DP.
    warmup_rounds: int = 0
    #: δ (record: must be below 1/n for a client's n examples).
    delta: float = 1e-5
    #: Stop contributing before a release would push ε past this (null: never stop). record:
    #: calibrate σ before training so that fl.rounds × fl.local_epochs × ⌈1/q⌉ steps spend at
    #: most this ε; a client never makes a release past it (null: use noise_multiplier).
    target_epsilon: float | None = None
    #: β, the linear adaptive rule only.
    update_rate: float = 0.05
    #: γ: target fraction of releases left unclipped (the CaR paper's 0.9).
    target_quantile: float = 0.9
    #: EMA of ‖Δ‖ for the linear rule (0: the raw norm); must be 0 with the geometric rule.
    ema_decay: float = 0.0
    #: mechanism: std z_Δ·C_i; bound: Algorithm 1's sqrt(2 z_Δ² ((1−β)² C_i² + β² γ² ‖Δ‖²)),
    #: which depends on the raw norm: NOT private (ε is reported as inf).
    noise_rule: NoiseRule = NoiseRule.MECHANISM
    #: geometric: private (Andrew et al. 2021); linear: the CaR paper's
    #: C_i ← (1 − β)·C_i + β·γ·‖Δ‖ on the raw norm, NOT private (ε is reported as inf).
    adaptive_rule: AdaptiveRule = AdaptiveRule.GEOMETRIC
    #: η_C, the geometric rule's step on log C_i per release (Andrew et al. use 0.2).
    clip_lr: float = 0.2
    #: σ_b, noise std of the clipped-indicator b (sensitivity 1); null: the paper's m/20
    #: (m = fl.clients). It takes the share z²/(2σ_b)² of each release's privacy budget.
    count_noise: float | None = None
    #: fixed, adaptive: a clipping bound of the adapter's own (adapter+classifier mode); null:
    #: one bound for every sent tensor together (dp.clip). Set, the adapter's update is clipped
    #: to it and the head's to dp.clip (or the adaptive C_i) separately, and each part's noise
    #: takes its share of the same budget (dp.adapter_share): ε is that of one joint release.
    adapter_clip: float | None = None
    #: w, the adapter's share of each release's update budget when dp.adapter_clip is set: its
    #: noise multiplier is z/√w and the head's z/√(1 − w), and (z/√w)⁻² + (z/√(1−w))⁻² = z⁻².
    adapter_share: float = 0.5

    # --- record-level DP-SGD (dp=record): clip = per-example C, noise_multiplier = σ (unless
    # target_epsilon calibrates it), delta = δ; see car_fl.privacy.record_accounting
    #: q: each step samples every local example independently with this probability
    #: (expected batch size q·n).
    sample_rate: float = 0.05

    def __post_init__(self) -> None:
        self.mode = DPMode.parse("dp.mode", self.mode)
        self.granularity = Granularity.parse("dp.granularity", self.granularity)
        self.noise_rule = NoiseRule.parse("dp.noise_rule", self.noise_rule)
        self.adaptive_rule = AdaptiveRule.parse("dp.adaptive_rule", self.adaptive_rule)
        _positive("dp.clip_lr (η_C)", self.clip_lr)
        if self.count_noise is not None:
            _positive("dp.count_noise (σ_b)", self.count_noise)
        if self.adapter_clip is not None and not self.adapter_clip > 0:
            raise ValueError(
                f"dp.adapter_clip (the adapter's own clipping bound) must be > 0 or null, got "
                f"{self.adapter_clip}; e.g. dp.adapter_clip=0.01"
            )
        if not 0 < self.adapter_share < 1:
            raise ValueError(
                f"dp.adapter_share (the adapter's share of the noise budget) must be in (0, 1), "
                f"got {self.adapter_share}; e.g. dp.adapter_share=0.5"
            )
        if (
            self.mode is DPMode.ADAPTIVE
            and self.adaptive_rule is AdaptiveRule.GEOMETRIC
            and self.ema_decay
        ):
            raise ValueError(
                f"dp.ema_decay={self.ema_decay} smooths the raw norms of the non-private linear "
                "rule only; set dp.ema_decay=0 (or dp.adaptive_rule=linear)"
            )
        if not self.clip > 0:
            raise ValueError(f"dp.clip (the clipping bound C) must be > 0, got {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"dp.noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 <= self.update_rate < 1:
            raise ValueError(f"dp.update_rate (β) must be in [0, 1), got {self.update_rate}")
        if not self.target_quantile > 0:
            raise ValueError(f"dp.target_quantile (γ) must be > 0, got {self.target_quantile}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp.delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"dp.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.warmup_rounds < 0:
            raise ValueError(f"dp.warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"dp.target_epsilon must be > 0 or null, got {self.target_epsilon}")
        if self.mode is DPMode.RECORD:
            self._check_record()

    def _check_record(self) -> None:
        """dp=record: q in (0, 1], σ > 0 unless a target ε calibrates it, no warm-up."""
        if not 0 < self.sample_rate <= 1:
            raise ValueError(
                f"dp.sample_rate (q, the Poisson sampling rate of DP-SGD) must be in (0, 1], "
                f"got {self.sample_rate}; e.g. dp.sample_rate=0.05"
            )
        if self.target_epsilon is None and not self.noise_multiplier > 0:
            raise ValueError(
                f"dp=record needs dp.noise_multiplier (σ) > 0, got {self.noise_multiplier}; "
                "set e.g. dp.noise_multiplier=1.0, or dp.target_epsilon=3 to calibrate σ"
            )
        if self.warmup_rounds:
            raise ValueError(
                f"dp=record trains every round with DP-SGD; dp.warmup_rounds must be 0, "
                f"got {self.warmup_rounds}"
            )


@dataclass
class StrategyConfig:
    """How the server combines valid replies (:mod:`car_fl.server.aggregation`).

    ``trim_fraction``: trimmed mean cuts ⌊β·n⌋ replies from each end of every coordinate.
    ``num_malicious``: Krum's f. ``num_selected``: Multi-Krum's m. ``eta``, ``eta_l``,
    ``beta_1``, ``beta_2``, ``tau``: FedAdam/FedYogi. ``server_lr``, ``server_momentum``:
    FedAvgM. ``proximal_mu``: FedProx's μ, used by the clients' local loss.
    """

    name: StrategyName = StrategyName.FEDAVG
    trim_fraction: float = 0.2
    num_malicious: int = 0
    num_selected: int = 1
    eta: float = 0.01
    eta_l: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    server_lr: float = 1.0
    server_momentum: float = 0.9
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        self.name = StrategyName.parse("strategy", self.name)
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(
                f"strategy.trim_fraction must be in [0, 0.5), got {self.trim_fraction}"
            )
        if self.num_malicious < 0:
            raise ValueError(f"strategy.num_malicious must be >= 0, got {self.num_malicious}")
        if self.num_selected < 1:
            raise ValueError(f"strategy.num_selected must be >= 1, got {self.num_selected}")
        for key in ("eta", "eta_l", "tau", "server_lr"):
            _positive(f"strategy.{key}", getattr(self, key))
        for key in ("beta_1", "beta_2", "server_momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.proximal_mu < 0:
            raise ValueError(f"strategy.proximal_mu must be >= 0, got {self.proximal_mu}")

    @property
    def prox_mu(self) -> float:
        """μ of the clients' proximal term: ``proximal_mu`` under FedProx, else 0."""
        return self.proximal_mu if self.name is StrategyName.FEDPROX else 0.0


@dataclass
class MoEConfig:
    """The mixture of experts (``head.kind=moe``, :mod:`car_fl.method.experts`).

    The documents are clustered into ``experts`` balanced clusters (in ``groups`` balanced
    groups first when a two-level gate is wanted); a query goes to its ``route`` best experts
    (within its ``route_groups`` best groups), so a query costs about
    (groups + route_groups·experts/groups + route·documents/experts)·d multiply-adds instead of
    documents·d.
    """

    experts: int = 64
    route: int = 4
    #: Experts a query reaches at evaluation and retrieval (null: ``route``): routing to more
    #: experts than in training costs a few more documents scored and recovers recall.
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
        if self.experts < 1:
            raise ValueError(f"moe.experts must be >= 1, got {self.experts}")
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
        if self.iterations < 0:
            raise ValueError(f"moe.iterations must be >= 0, got {self.iterations}")


@dataclass
class CommConfig:
    """What crosses the wire between server and clients (only the trainable tensors ever do)."""

    #: float32, or float16 (half the bytes; aggregation is still computed in float64).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype == "bfloat16":
            raise ValueError(
                "comm.dtype=bfloat16 is not supported: Flower arrays are NumPy arrays, which have "
                "no bfloat16; use float16 (same size) or float32"
            )
        one_of("comm.dtype", self.dtype, WIRE_DTYPES)


@dataclass
class Settings:
    """The whole resolved configuration of a run, typed and validated."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fl: FLConfig = field(default_factory=FLConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    seed: int = 42
    #: auto: CUDA, then Apple MPS, then CPU.
    device: str = "auto"
    #: car-fl's cache folder (features per text under features/, classifier mode). null:
    #: $CAR_FL_CACHE, else ~/.cache/car-fl. Ignored on a federated node, which writes only
    #: under its own node config's cache-dir (the same default).
    cache_dir: str | None = None
    #: Where results go. null: the Hydra run directory (centralised) or runs/<timestamp> (Flower).
    output_dir: str | None = None
    progress: bool = True
    #: Continue an interrupted federated run: resume=<its run directory> (same overrides,
    #: fl.rounds may be raised). Restores round, global parameters and metrics history from
    #: its last complete round checkpoint.
    resume: str | None = None

    def __post_init__(self) -> None:
        one_of("device", self.device, DEVICES)
        if self.head.kind is HeadKind.KNN and self.train.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError(
                "head.kind=knn trains nothing, so mode=adapter does not apply; use "
                "mode=classifier (kNN over the frozen encoder's embeddings)"
            )
        if self.dp.mode is DPMode.ADAPTIVE:
            z, m = self.dp.noise_multiplier, self.fl.clients
            sigma_b = self.dp.count_noise if self.dp.count_noise is not None else m / 20
            if not z < 2 * sigma_b:
                where = (
                    f"dp.count_noise = {sigma_b:g}"
                    if self.dp.count_noise is not None
                    else f"m/20 with m = fl.clients = {m}"
                )
                raise ValueError(
                    f"adaptive DP needs dp.noise_multiplier z < 2·σ_b = {2 * sigma_b:g} "
                    f"(σ_b = {where}), got z = {z:g}; lower dp.noise_multiplier or raise "
                    f"dp.count_noise above {z / 2:g}"
                )
        self._check_aggregation()
        self._check_documents()

    def _check_documents(self) -> None:
        """Document heads need documents; the experts a client sends under DP must not depend
        on its data; stateful server optimisers need every tensor every round."""
        kind = self.head.kind
        documents = self.dataset.reader is Reader.CORPUS or self.dataset.label_texts
        if kind in (HeadKind.DOCUMENT, HeadKind.MOE) and not documents:
            raise ValueError(
                f"head.kind={kind} starts its rows from the documents' embeddings: use a "
                "corpus (dataset=corpus) or give dataset.label_texts"
            )
        if kind is not HeadKind.MOE:
            return
        if self.dp.mode is not DPMode.NONE and self.moe.send is ExpertSending.ROUTED:
            raise ValueError(
                f"moe.send=routed sends the experts a client's queries reach, which depends on "
                f"its data; under dp={self.dp.mode} use moe.send=schedule (a fixed rotation) or "
                "moe.send=all (every expert, noised)"
            )
        stateful = (StrategyName.FEDADAM, StrategyName.FEDYOGI, StrategyName.FEDAVGM)
        if self.strategy.name in stateful and self.moe.send is not ExpertSending.ALL:
            raise ValueError(
                f"strategy={self.strategy.name} keeps server state for every tensor and needs "
                f"all of them each round; use moe.send=all, or strategy=fedavg (moe.send="
                f"{self.moe.send} sends only some experts)"
            )

    @property
    def approach(self) -> Approach:
        """The retrieval approach these settings run (:data:`APPROACHES`)."""
        return Approach.of(self.head.kind, self.train.mode)

    def _check_aggregation(self) -> None:
        """Strategy and norm-bound settings that only make sense with the federation's size."""
        if self.fl.norm_bound is NormBoundMode.DP and not (
            self.dp.mode is DPMode.FIXED and self.dp.granularity is Granularity.ROUND
        ):
            raise ValueError(
                "fl.norm_bound=dp derives the bound from fixed DP clipped once per round; it "
                f"needs dp=fixed and dp.granularity=round (got dp.mode={self.dp.mode}, "
                f"dp.granularity={self.dp.granularity}); use fl.norm_bound=adaptive or fixed"
            )
        asked = self.fl.sample_size(self.fl.clients)
        if (
            self.strategy.name is StrategyName.TRIMMED_MEAN
            and int(self.strategy.trim_fraction * asked) < 1
        ):
            fix = (
                f"set strategy.trim_fraction >= {1 / asked:.3g} (and < 0.5)"
                if asked >= 3
                else "it needs at least 3 clients per round (fl.clients=3)"
            )
            raise ValueError(
                f"strategy.trim_fraction={self.strategy.trim_fraction} cuts nothing from "
                f"{asked} replies per round (⌊β·n⌋ = 0); {fix}"
            )
        if (
            self.strategy.name in (StrategyName.KRUM, StrategyName.MULTIKRUM)
            and self.strategy.num_selected > asked
        ):
            raise ValueError(
                f"strategy.num_selected={self.strategy.num_selected} exceeds the {asked} "
                f"clients asked per round; set strategy.num_selected <= {asked}"
            )


def trains_nothing(settings: Settings) -> bool:
    """MIPS on the frozen encoder and kNN have no trainable parameter: one evaluation, no epochs."""
    kind = settings.head.kind
    return kind is HeadKind.KNN or (
        kind is HeadKind.MIPS and settings.train.mode is Mode.CLASSIFIER
    )
