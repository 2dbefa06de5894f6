"""The settings' choices: every setting with a fixed set of values, and the approaches table."""

from __future__ import annotations

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


class Lexical(Choice):
    """A lexical index beside the head: ``bm25`` over the documents' words
    (:mod:`car_fl.heads.lexical`), fused with the head's ranking."""

    NONE = "none"
    BM25 = "bm25"


class Standardize(Choice):
    """Per-dimension scaling of pooled features with statistics shared by every party.

    ``documents``: each dimension's mean and deviation over the document corpus's embeddings
    (public to the federation; never a client's queries), applied to queries and documents
    alike (:mod:`car_fl.model.standardize`).
    """

    NONE = "none"
    DOCUMENTS = "documents"


class DPMode(Choice):
    """Local differential privacy: off, fixed clipping bound, adaptive clipping, or DP-SGD.

    ``record``: record-level DP-SGD on each client (:mod:`car_fl.privacy.dpsgd`).
    """

    NONE = "none"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    RECORD = "record"


class HeadTraits(NamedTuple):
    """What every party asks of a head's kind before building one (its scorer is in
    :mod:`car_fl.heads.registry`)."""

    #: The head has weights of its own to train (MIPS and kNN score with the encoder's states).
    weights: bool = False
    #: The adapter can train through it (kNN: no gradient reaches the encoder).
    adapts: bool = True
    #: Its rows start as the documents' embeddings: it needs the documents.
    from_documents: bool = False
    #: Linear probing (``fl.probe_rounds``, ``train.probe_epochs``) has this head to train alone.
    probe: bool = False


class HeadKind(Choice):
    """How labels are scored: CaR's classifier, MIPS against label documents, or kNN.

    ``mips``: query·(each label's document text) / ``head.temperature``, trains only the
    adapter; ``knn``: votes of the ``head.knn_k`` most similar training examples, trains nothing.
    """

    CLASSIFIER = "classifier"
    MIPS = "mips"
    KNN = "knn"
    #: Rows start as the documents' embeddings (CaR starts where MIPS is), with a shared
    #: query-side map (:mod:`car_fl.heads.document_head`).
    DOCUMENT = "document"
    #: The document head split into experts (clusters of documents) behind a gate
    #: (:mod:`car_fl.heads.experts`).
    MOE = "moe"

    @property
    def traits(self) -> HeadTraits:
        return HEAD_TRAITS[self]


HEAD_TRAITS = {
    HeadKind.CLASSIFIER: HeadTraits(weights=True, probe=True),
    HeadKind.MIPS: HeadTraits(),
    HeadKind.KNN: HeadTraits(adapts=False),
    HeadKind.DOCUMENT: HeadTraits(weights=True, from_documents=True),
    HeadKind.MOE: HeadTraits(weights=True, from_documents=True),
}


class MapKind(Choice):
    """A shared map on the query (or document) side of a document head, identity at start."""

    NONE = "none"
    #: x + x Mᵀ with a full d×d M (zero at start).
    LINEAR = "linear"
    #: x + x Uᵀ Vᵀ, U (r×d), V (d×r) zero at start: rank ``head.map_rank``.
    LOWRANK = "lowrank"


class AdapterKind(Choice):
    """The soft-embedding adapter's form (:mod:`car_fl.adapters`), each the identity at start.

    ``full``: x Wᵀ with a d×d W; ``lowrank``: x (I + U Vᵀ)ᵀ, U and V d×``adapter.rank``, U zero
    at start; ``diagonal``: x ⊙ s + b, a per-dimension scale and shift.
    """

    FULL = "full"
    LOWRANK = "lowrank"
    DIAGONAL = "diagonal"


class ExpertSending(Choice):
    """Which experts a client trains and sends (:mod:`car_fl.heads.experts`).

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
    #: IID by a keyed hash of each example's own text: adding or removing a record moves no
    #: other record to another shard (record-level DP on a shared file needs it).
    HASH = "hash"


class Split(Choice):
    """How examples are placed in train, validation and test (:mod:`car_fl.data.splits`)."""

    #: A seeded permutation (stratified by label with ``dataset.stratify``).
    SEEDED = "seeded"
    #: A keyed hash of each example's own text: adding or removing a record moves no other
    #: record to another split (record-level DP on a shared file needs it); not stratified.
    HASH = "hash"


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
    lexical: Lexical = Lexical.NONE


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
    FUSION = "fusion"

    @property
    def label(self) -> str:
        """The name reports use: ``MIPS``, ``classifier (CaR)``, ..."""
        return APPROACHES[self].label

    @classmethod
    def of(cls, head: HeadKind, mode: Mode, lexical: Lexical = Lexical.NONE) -> Approach:
        """The approach of a head kind, a training mode and a lexical index."""
        for approach, spec in APPROACHES.items():
            if spec.head == head and spec.mode == mode and spec.lexical == lexical:
                return approach
        raise ValueError(
            f"head.kind={head} with train.mode={mode} and head.lexical={lexical} is no "
            "approach of car-fl"
        )


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
    Approach.FUSION: ApproachSpec(
        HeadKind.DOCUMENT,
        Mode.CLASSIFIER,
        "document head + BM25 (fusion)",
        "The document head, trained as in document, its ranking fused with BM25's over the "
        "documents' words by reciprocal rank (head.fusion_k); the index is built from the "
        "documents alone.",
        Lexical.BM25,
    ),
}

#: ``model.dtype``: ``auto`` (see :func:`car_fl.model.encoder.pick_dtype`) or a torch dtype's name.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``device``: ``auto`` (CUDA, then Apple MPS, then CPU; :func:`car_fl.model.encoder.pick_device`).
DEVICES = ("auto", "cpu", "cuda", "mps")
#: ``comm.dtype``: dtypes a tensor may travel in; bfloat16 has no NumPy dtype, so no Array.
WIRE_DTYPES = ("float32", "float16")
PADDING_SIDES = ("auto", "left", "right")
#: ``model.blocks``: the transformer blocks on this machine, or on a blocks service
#: (:mod:`car_fl.blocks`; the service's address is node-local: ``model.blocks_service``).
BLOCKS = ("local", "remote")


def one_of(key: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    """Reject a ``value`` of ``key`` that is not among the ``valid`` names, listing them."""
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")


def positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


def at_least(key: str, value: float, low: int) -> None:
    """Refuse ``value`` below ``low``, and NaN (which no comparison lets through)."""
    if not value >= low:
        raise ValueError(f"{key} must be >= {low}, got {value}")
