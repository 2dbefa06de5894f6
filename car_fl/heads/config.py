"""What configures a head: each ``head.kind``'s registration, the one place a head is named
(:data:`HEADS`: its traits, its scorer, the approaches it forms), and the ``head`` and ``moe``
settings sections with their choices.

Imports no torch: the settings compose these sections and check a run against the traits
before anything is built; a kind's scorer is imported by :func:`car_fl.heads.scorer.scorer_class`
when a head is built. docs/architecture.md ("Adding a head") works one example through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from car_fl.common.choice import Choice, at_least, positive


class Lexical(Choice):
    """A lexical index beside the head: ``bm25`` over the documents' words
    (:mod:`car_fl.heads.lexical`), fused with the head's ranking."""

    NONE = "none"
    BM25 = "bm25"


class MapKind(Choice):
    """A shared map on the query (or document) side of a document head, identity at start."""

    NONE = "none"
    #: x + x Mᵀ with a full d×d M (zero at start).
    LINEAR = "linear"
    #: x + x Uᵀ Vᵀ, U (r×d), V (d×r) zero at start: rank ``head.map_rank``.
    LOWRANK = "lowrank"


class Similarity(Choice):
    """Inner product of the raw vectors, or of unit vectors (cosine)."""

    DOT = "dot"
    COSINE = "cosine"


class ExpertSending(Choice):
    """Which experts a client trains and sends (:mod:`car_fl.heads.experts`).

    ``routed``: those its queries reach (data-dependent: refused under any DP mode).
    ``all``: every expert, noised under DP. ``schedule``: the block of experts the server's
    fixed rotation gives the client this round (data-independent, fewer bytes both ways).
    """

    ROUTED = "routed"
    ALL = "all"
    SCHEDULE = "schedule"


class HeadTraits(NamedTuple):
    """What every party asks of a head's kind before building one."""

    #: The head has weights of its own to train (MIPS and kNN score with the encoder's states).
    weights: bool = False
    #: The adapter can train through it (kNN: no gradient reaches the encoder).
    adapts: bool = True
    #: Its rows start as the documents' embeddings: it needs the documents.
    from_documents: bool = False
    #: Linear probing (``fl.probe_rounds``, ``train.probe_epochs``) has this head to train alone.
    probe: bool = False
    #: It scores with the training examples' features it remembers (kNN): a run hands them
    #: over before it scores, so even with nothing to train they are encoded.
    memory: bool = False
    #: It is split into experts behind a gate: it needs a layout (the server's, or its own
    #: clustering of the documents), and ``moe`` configures it.
    experts: bool = False


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
        return HEADS[self].traits

    @property
    def spec(self) -> HeadSpec:
        return HEADS[self]


class ApproachSpec(NamedTuple):
    """An approach a head forms (``approach=<name>`` sets ``head.kind``, ``train.mode`` and
    ``head.lexical``): whether the adapter trains, what reports call it, what it is."""

    adapter: bool
    label: str
    description: str
    lexical: Lexical = Lexical.NONE


class HeadSpec(NamedTuple):
    """A head kind's registration: its traits, its scorer as ``module:Class`` (imported when a
    head is built), and the approaches it forms by name, in the method's order."""

    traits: HeadTraits
    scorer: str
    approaches: dict[str, ApproachSpec]


#: Every head kind, in the method's order of its approaches (MIPS, CaR, kNN, ...).
HEADS: dict[HeadKind, HeadSpec] = {
    HeadKind.MIPS: HeadSpec(
        HeadTraits(),
        "car_fl.heads.retrieval:MIPSScorer",
        {
            "mips": ApproachSpec(
                False,
                "MIPS",
                "MIPS on the frozen encoder: label documents and queries embedded alike, ranked "
                "by inner product. Nothing is trained.",
            ),
            "adapter_mips": ApproachSpec(
                True,
                "adapter + MIPS",
                "MIPS with a trained soft-embedding adapter: softmax over query-document inner "
                "products, backpropagated through the frozen encoder into the adapter (no "
                "classifier head).",
            ),
        },
    ),
    HeadKind.CLASSIFIER: HeadSpec(
        HeadTraits(weights=True, probe=True),
        "car_fl.heads.scorer:ClassifierScorer",
        {
            "car": ApproachSpec(
                False,
                "classifier (CaR)",
                "CaR: the classifier head on cached hidden states of the frozen encoder.",
            ),
            "adapter_car": ApproachSpec(
                True,
                "adapter + classifier (CaR)",
                "CaR with soft embeddings: the adapter and the classifier head, trained together.",
            ),
        },
    ),
    HeadKind.KNN: HeadSpec(
        HeadTraits(adapts=False, memory=True),
        "car_fl.heads.retrieval:KNNScorer",
        {
            "knn": ApproachSpec(
                False,
                "kNN",
                "k nearest neighbours over the training examples' embeddings (frozen encoder), "
                "by inner product; head.knn_k neighbours vote. Nothing is trained.",
            ),
        },
    ),
    HeadKind.DOCUMENT: HeadSpec(
        HeadTraits(weights=True, from_documents=True),
        "car_fl.heads.document_head:DocumentScorer",
        {
            "document": ApproachSpec(
                False,
                "document head (CaR)",
                "CaR with a document-initialised head on cached hidden states: rows start as "
                "the documents' embeddings (so it starts where MIPS is), with a shared "
                "query-side map.",
            ),
            "adapter_document": ApproachSpec(
                True,
                "adapter + document head (CaR)",
                "The document-initialised head and the soft-embedding adapter on the query "
                "side, trained together; document rows stay the frozen encoder's embeddings "
                "plus Δ.",
            ),
            "fusion": ApproachSpec(
                False,
                "document head + BM25 (fusion)",
                "The document head, trained as in document, its ranking fused with BM25's over "
                "the documents' words by reciprocal rank (head.fusion_k); the index is built "
                "from the documents alone.",
                Lexical.BM25,
            ),
        },
    ),
    HeadKind.MOE: HeadSpec(
        HeadTraits(weights=True, from_documents=True, experts=True),
        "car_fl.heads.experts:MixtureScorer",
        {
            "moe": ApproachSpec(
                False,
                "mixture of experts (CaR)",
                "The document head split into experts (balanced clusters of documents) behind "
                "a gate that routes each query to its moe.route best experts.",
            ),
        },
    ),
}
#: Every approach by name (``approach=<name>``), in the method's order, with its head.
APPROACHES: dict[str, tuple[HeadKind, ApproachSpec]] = {
    name: (kind, approach)
    for kind, spec in HEADS.items()
    for name, approach in spec.approaches.items()
}


def formed_approach(kind: HeadKind, adapter: bool, lexical: Lexical = Lexical.NONE) -> str | None:
    """The name of the approach a head kind forms with or without the adapter and a lexical
    index, or ``None`` when it forms none."""
    for name, approach in HEADS[kind].approaches.items():
        if approach.adapter == adapter and approach.lexical == lexical:
            return name
    return None


def approach_of(kind: HeadKind, adapter: bool, lexical: Lexical = Lexical.NONE) -> str:
    """:func:`formed_approach`; ``ValueError`` when it forms none (a run valid all the same)."""
    name = formed_approach(kind, adapter, lexical)
    if name is not None:
        return name
    raise ValueError(
        f"head.kind={kind} with{'' if adapter else 'out'} the adapter and head.lexical="
        f"{lexical} is no approach of car-fl"
    )


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
