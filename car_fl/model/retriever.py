"""The CaR retriever: frozen encoder → soft-embedding adapter → transformer → pooling → scorer.

``scores = HEAD(POOL(TRF(ADP(TKN(x)))))``. What requires a gradient is trained;
:meth:`CaRRetriever.trainable_state_dict` is exactly what travels and what a checkpoint holds.

:func:`build_retriever` makes a retriever whose start depends only on the settings and the
public corpus (a head's documents, embeddings or expert layout, the standardisation, the
lexical index).

Per-dimension standardisation of pooled features (:class:`Standardizer`) with statistics of
the document corpus: x ↦ (x − μ) / σ, μ and σ each dimension's mean and deviation over the
documents' embeddings. A generative LM's few "rogue dimensions" (Timkey & van Schijndel, 2021)
decide inner products alone; standardising gives each its share. The public documents alone
give μ and σ, so every party computes the same; a module, so the adapter trains through it
(docs/retrieval.md, "Features worth searching").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from car_fl.adapters.adapter import Adapter, build_adapter
from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.document_head import DocumentHead
from car_fl.heads.experts import MixtureHead, build_layout, experts_in
from car_fl.heads.fusion import reciprocal_rank_fusion
from car_fl.heads.lexical import LexicalIndex
from car_fl.heads.retrieval import KNNScorer, MIPSScorer
from car_fl.heads.scorer import Retrieval, Scorer, build_scorer, retrieve, scorer_class
from car_fl.model.encoder import Encoder, load_encoder, pick_device
from car_fl.model.features import document_features as embed_documents
from car_fl.model.features import encode_documents, extract_features, trained_rows
from car_fl.privacy.mechanism import ADAPTER_PREFIX
from car_fl.settings.schema import (
    AdapterConfig,
    HeadConfig,
    HeadKind,
    Lexical,
    Mode,
    MoEConfig,
    Settings,
    Standardize,
    TrainConfig,
)


def build_retriever(
    settings: Settings,
    num_labels: int,
    *,
    encoder: Encoder | None = None,
    hidden_size: int | None = None,
    documents: Sequence[str] | None = None,
    document_features: torch.Tensor | None = None,
    layout: ExpertLayout | None = None,
) -> CaRRetriever:
    """A retriever whose head initialisation depends only on ``settings.seed``.

    With ``hidden_size`` and no ``encoder`` in classifier mode the encoder is not loaded. A
    document head starts from ``document_features`` or the ``documents``' cached embeddings; a
    mixture of experts takes ``layout`` (the server's) or clusters the documents (seeded).
    """
    mode = settings.train.mode
    if encoder is None and (hidden_size is None or mode is Mode.ADAPTER_CLASSIFIER):
        encoder = load_encoder(settings.model, device=settings.device)
    kind = settings.head.kind
    loaded = encoder

    def get_encoder() -> Encoder:
        return loaded or load_encoder(settings.model, device=settings.device)

    # a head that encodes the documents for its index (MIPS): frozen, they are embedded once
    frozen_index = scorer_class(kind).index_uses_adapter and mode is Mode.CLASSIFIER
    standardize = settings.model.standardize is Standardize.DOCUMENTS
    needs_documents = kind.traits.from_documents or standardize
    if (needs_documents or frozen_index) and document_features is None:
        if documents is None and not frozen_index:
            why = f"head.kind={kind}" if not standardize else "model.standardize=documents"
            raise ValueError(f"{why} needs the documents (texts or embeddings)")
        if documents is not None:  # the frozen documents' embeddings, through the cache
            document_features = embed_documents(settings, documents, get_encoder=get_encoder)
    scaler = None
    if standardize:  # the documents a run trains on: new ones arrive later, as added ones do
        assert document_features is not None
        scaler = Standardizer(int(document_features.shape[1]))
        trained = trained_rows(settings, num_labels)
        scaler.fit(document_features if trained is None else document_features[trained])
    if kind.traits.experts and layout is None:  # clustered in the space the head scores in
        assert document_features is not None
        space = document_features if scaler is None else scaler(document_features)
        layout = build_layout(space, settings.moe, seed=settings.seed)
    torch.manual_seed(settings.seed)
    model = CaRRetriever(
        encoder,
        num_labels,
        head=settings.head,
        mode=mode,
        hidden_size=hidden_size,
        device=pick_device(settings.device),
        moe=settings.moe,
        layout=layout,
        adapter=settings.adapter,
        seed=settings.seed,
    )
    if scaler is not None:
        model.standardizer.load(scaler)
    if isinstance(model.head, MIPSScorer) and document_features is not None and frozen_index:
        model.head.set_document_features(document_features)
    elif isinstance(model.head, MIPSScorer) and documents is not None and model.has_encoder:
        model.set_documents(documents)  # re-encoded through the adapter while it trains
    if settings.head.lexical is Lexical.BM25:
        if documents is None:
            raise ValueError("head.lexical=bm25 needs the documents' texts")
        model.lexical = LexicalIndex(documents)
    if isinstance(model.head, DocumentHead):
        assert document_features is not None
        model.set_document_features(document_features)
        trained = trained_rows(settings, num_labels)
        if trained is not None:
            model.head.set_trained_rows(trained.to(model.device))
    return model


#: The fewest documents whose deviation standardisation trusts (a handful of label texts is no
#: sample of a space).
MIN_DOCUMENTS = 8
#: A deviation below this share of the median divides by that floor instead: a dimension
#: constant across documents but not queries would otherwise decide every cosine.
RELATIVE_FLOOR = 0.01


class Standardizer(nn.Module):
    """``(..., d)`` → ``(x − μ) / σ``; the identity until :meth:`fit` is called. μ and σ are
    outside the state dict (never trained, sent or saved): every party computes them."""

    mean: torch.Tensor
    deviation: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim), persistent=False)
        self.register_buffer("deviation", torch.ones(dim), persistent=False)
        self.fitted = False

    def fit(self, documents: torch.Tensor) -> None:
        """μ and σ of the documents' embeddings ``(documents, d)``, in float32."""
        if documents.ndim != 2 or documents.shape[1] != self.mean.shape[0]:
            raise ValueError(
                f"documents of shape {tuple(documents.shape)} for features of dimension "
                f"{self.mean.shape[0]}"
            )
        if documents.shape[0] < MIN_DOCUMENTS:
            raise ValueError(
                f"model.standardize=documents needs at least {MIN_DOCUMENTS} documents to "
                f"estimate each dimension's deviation, got {documents.shape[0]}; use a corpus "
                "(dataset=corpus) or model.standardize=none"
            )
        x = documents.detach().float()
        deviation = x.std(dim=0)
        floor = float(RELATIVE_FLOOR * deviation.median())
        deviation = deviation.clamp_min(floor) if floor > 0 else torch.ones_like(deviation)
        with torch.no_grad():
            self.mean.copy_(x.mean(dim=0))
            self.deviation.copy_(deviation)
        self.fitted = True

    def load(self, other: Standardizer) -> None:
        """The statistics ``other`` was fitted to."""
        with torch.no_grad():
            self.mean.copy_(other.mean)
            self.deviation.copy_(other.deviation)
        self.fitted = other.fitted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fitted:
            return x
        return (x.float() - self.mean) / self.deviation


log = logging.getLogger(__name__)


class CaRRetriever(nn.Module):
    """Encoder (frozen), adapter and one scorer (``head``), trained in one :class:`Mode`."""

    def __init__(
        self,
        encoder: Encoder | None,
        num_labels: int,
        *,
        head: HeadConfig,
        mode: Mode,
        hidden_size: int | None = None,
        device: torch.device | str = "cpu",
        moe: MoEConfig | None = None,
        layout: ExpertLayout | None = None,
        adapter: AdapterConfig | None = None,
        seed: int = 0,
    ) -> None:
        """Without an ``encoder`` give ``hidden_size``; a mixture of experts needs ``moe`` and
        its ``layout``; ``adapter`` defaults to the full d×d, its random start from ``seed``."""
        super().__init__()
        self._encoder = encoder
        self.mode = mode
        if encoder is not None:
            dim, device = encoder.hidden_size, encoder.device
        elif hidden_size is None:
            raise ValueError("a retriever without an encoder needs hidden_size")
        else:
            dim = hidden_size
        if encoder is None and self.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError("adapter+classifier mode needs the encoder")
        if not head.kind.traits.adapts and self.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError(f"a {head.kind} head trains nothing; use mode=classifier")
        self.num_labels = num_labels
        self._device = torch.device(device)
        self.adapter: Adapter = build_adapter(adapter or AdapterConfig(), dim, seed=seed).to(device)
        #: Pooled features → the space every scorer works in (the identity unless fitted to the
        #: corpus's documents by :func:`~car_fl.model.retriever.build_retriever`).
        self.standardizer = Standardizer(dim).to(device)
        #: A lexical index whose ranking is fused with the head's (:meth:`fuse`), or None.
        self.lexical: LexicalIndex | None = None
        self.fusion_k, self.fusion_weight = head.fusion_k, head.fusion_weight
        self.head: Scorer = build_scorer(
            head, dim=dim, num_labels=num_labels, device=device, moe=moe, layout=layout
        )
        self.adapter.requires_grad_(self.mode is Mode.ADAPTER_CLASSIFIER)
        #: What :meth:`retrieve` names: label names and documents, in label order, and the
        #: settings (:meth:`set_labels`).
        self.label_names: tuple[str, ...] | None = None
        self.label_texts: tuple[str, ...] | None = None
        self.settings: Settings | None = None
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.parameters() if not p.requires_grad)
        log.info(
            "CaR retriever (%s, %s head): %s trainable, %s frozen parameters",
            self.mode.value,
            self.kind.value,
            f"{trainable:,}",
            f"{frozen:,}",
        )

    @property
    def encoder(self) -> Encoder:
        """The frozen encoder; raises if this retriever was built on cached features only."""
        if self._encoder is None:
            raise RuntimeError("this retriever was built without its encoder (cached features)")
        return self._encoder

    @property
    def has_encoder(self) -> bool:
        return self._encoder is not None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kind(self) -> HeadKind:
        """The retrieval method: the scorer's kind."""
        return self.head.kind

    @property
    def per_example_loop(self) -> bool:
        """DP-SGD computes per-example gradients one example at a time (routing heads)."""
        return bool(self.head.per_example_loop)

    @property
    def uses_adapter(self) -> bool:
        """The adapter is applied when trained, or when it holds non-identity weights."""
        return self.mode is Mode.ADAPTER_CLASSIFIER or not self.adapter.is_identity()

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token ids and mask ``(batch, seq)`` → pooled vectors ``(batch, d)``."""
        embeddings = self.encoder.embed(input_ids)  # (batch, seq, d)
        if self.uses_adapter:
            embeddings = self.adapter(embeddings)
        hidden = self.encoder.transform(embeddings, attention_mask)  # (batch, seq, d)
        return self.encoder.pool(hidden, attention_mask)  # (batch, d)

    def _encode_ids(self, input_ids: list[list[int]]) -> torch.Tensor:
        return self.encode(*self.encoder.pad(input_ids))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        features: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, labels)``, and the loss when ``labels`` are given, from token ids
        and mask or from pooled ``features``."""
        if features is None:
            if input_ids is None or attention_mask is None:
                raise ValueError("forward needs input_ids and attention_mask, or features")
            features = self.encode(input_ids, attention_mask)
        training = labels if self.training else None  # a mixture of experts routes by them
        logits = self.score(features, labels=training)  # (batch, labels)
        loss = self.head.loss(logits, labels) if labels is not None else None
        return logits, loss

    # ------------------------------------------------------------------------------ scoring
    def index(self) -> torch.Tensor | None:
        """What the scorer scores against through the current adapter (MIPS: the documents)."""
        index = self.head.index(self._encode_ids, adapted=self.uses_adapter)
        return None if index is None else self.standardizer(index)

    def score(
        self,
        features: torch.Tensor,
        *,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled queries ``(batch, d)`` → one score per label ``(batch, labels)``; ``index``
        from :meth:`index`, ``labels`` while training (a mixture of experts routes by them)."""
        queries = self.standardizer(features)
        return self.head(queries, index if index is not None else self.index(), labels)

    def fuse(self, scores: torch.Tensor, texts: Sequence[str]) -> torch.Tensor:
        """What ranks the labels: the head's ``scores`` ``(batch, labels)``, fused by reciprocal
        rank with the lexical index's scores of the query ``texts`` when there is an index (a
        document without a word of the query in common is not in the lexical ranking)."""
        if self.lexical is None:
            return scores
        if len(texts) != scores.shape[0]:
            raise ValueError(f"{len(texts)} query texts for {scores.shape[0]} rows of scores")
        lexical = self.lexical.scores(texts)
        unmatched = lexical.masked_fill(lexical <= 0, float("-inf"))  # no word in common
        # on the CPU, in float64 (deep ranks differ by ~1e-8; MPS has no float64)
        return reciprocal_rank_fusion(
            scores.float().cpu(), unmatched, k=self.fusion_k, weights=(self.fusion_weight, 1.0)
        )

    def set_documents(self, texts: Sequence[str]) -> None:
        """MIPS: the labels' document texts, in label order (needs the encoder)."""
        if not isinstance(self.head, MIPSScorer):
            raise TypeError(f"label documents are for a MIPS head, not {self.kind.value}")
        limit = self.encoder.cfg.document_max_length
        self.head.set_documents(self.encoder.tokenize(list(texts), max_length=limit).input_ids)

    def set_document_features(self, features: torch.Tensor) -> None:
        """Document heads: the documents' frozen embeddings ``(labels, d)``, in label order."""
        if not isinstance(self.head, DocumentHead):
            raise TypeError(f"document embeddings are for a document head, not {self.kind.value}")
        self.head.set_document_features(self.standardizer(features.to(self.device)))

    def add_documents(self, names: Sequence[str], texts: Sequence[str]) -> range:
        """A document head: new documents as rows (Δ = 0), without retraining; no other
        document's score changes. Returns their label indices (needs the encoder)."""
        if not isinstance(self.head, DocumentHead):
            raise TypeError(f"documents are added to a document head, not {self.kind.value}")
        if self.label_names is None or self.label_texts is None:
            raise RuntimeError("add_documents needs the labels: use load_retriever or set_labels")
        if len(names) != len(texts) or not names:
            raise ValueError(f"{len(names)} new document ids for {len(texts)} texts")
        clash = sorted(set(names) & set(self.label_names))
        if clash or len(set(names)) != len(names):
            raise ValueError(f"document ids already present or repeated: {clash or list(names)}")
        model_cfg = self.encoder.cfg
        features = encode_documents(
            self.encoder,
            texts,
            max_length=model_cfg.document_max_length or model_cfg.max_length,
            batch_size=self.settings.train.feature_batch_size if self.settings else 32,
        )
        added = self.head.add_documents(self.standardizer(features.to(self.device)))
        self.num_labels = self.head.num_labels
        self.label_names = (*self.label_names, *names)
        self.label_texts = (*self.label_texts, *texts)
        if self.lexical is not None:  # the index covers every document the head scores
            self.lexical = LexicalIndex(self.label_texts)
        return added

    def set_memory(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """kNN: the training examples' embeddings ``(n, d)`` and labels ``(n,)``."""
        if not isinstance(self.head, KNNScorer):
            raise TypeError(f"a memory of examples is for a kNN head, not {self.kind.value}")
        self.head.set_memory(self.standardizer(features.to(self.device)), labels)

    # ------------------------------------------------------------------- trainable parameters
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name → parameter for whatever requires a gradient (the adapter's first)."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def adapter_penalty(self) -> torch.Tensor | None:
        """``adapter.anchor`` λ·‖ADP − I‖²_F while the adapter trains (None otherwise), added to
        the loss (it depends on no record)."""
        anchor = self.adapter.cfg.anchor
        if anchor <= 0 or self.mode is not Mode.ADAPTER_CLASSIFIER:
            return None
        return anchor * self.adapter.deviation()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the trainable tensors, in a fixed order."""
        return {k: v.detach().cpu().clone() for k, v in self.trainable_parameters().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load exactly the trainable tensors (an adapter may also be given in classifier mode);
        ``ValueError`` for missing, unexpected or wrongly shaped ones."""
        if isinstance(self.head, MixtureHead):  # a client holds the experts it was sent
            self.head.set_available(experts_in(state))
        expected = self.trainable_parameters()
        optional = {ADAPTER_PREFIX + k: p for k, p in self.adapter.named_parameters()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected) - set(optional))
        if missing or unexpected:
            raise ValueError(
                f"trainable state mismatch: missing {missing}, unexpected {unexpected}; was it "
                "saved with another mode, head or model?"
            )
        targets = {**optional, **expected}
        with torch.no_grad():
            for name, value in state.items():
                target = targets[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(value.shape)}, expected "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(value.to(device=target.device, dtype=target.dtype))

    # ---------------------------------------------------------------------------- serving
    def set_labels(
        self, names: Sequence[str], documents: Sequence[str], *, settings: Settings | None = None
    ) -> None:
        """The label names and documents (label order) that :meth:`retrieve` returns."""
        if not len(names) == len(documents) == self.num_labels:
            counts = f"{len(names)} names and {len(documents)} documents"
            raise ValueError(f"{counts} for {self.num_labels} labels")
        self.label_names, self.label_texts = tuple(names), tuple(documents)
        self.settings = settings

    def retrieve(
        self, texts: Sequence[str], k: int, *, batch_size: int | None = None
    ) -> list[Retrieval]:
        """For each query text, its ``k`` best labels with the head's scores, probabilities
        (heads trained with cross-entropy) and documents (:class:`Retrieval`)."""
        if self.label_names is None or self.label_texts is None:
            raise RuntimeError("retrieve needs the labels: use load_retriever or set_labels")
        if not texts:
            return []
        if batch_size is None:
            batch_size = (self.settings.train if self.settings else TrainConfig()).eval_batch_size
        ids = self.encoder.tokenize(list(texts)).input_ids
        features = extract_features(
            self.encode,
            self.encoder.pad,
            ids,
            batch_size=batch_size,
            progress=False,
            desc="queries",
        )
        self.eval()
        out: list[Retrieval] = []
        with torch.inference_mode():
            index = self.index()
            for start in range(0, len(features), batch_size):  # one batch of scores at a time
                batch = features[start : start + batch_size].to(self.device)
                scores = self.score(batch, index=index).float().cpu()  # (batch, labels)
                if self.lexical is not None:
                    fused = self.fuse(scores, texts[start : start + batch_size])
                    kind, calibrated = "rrf", False
                else:
                    fused = self.head.reported(scores)
                    kind, calibrated = self.head.score_kind, self.head.calibrated
                out += retrieve(
                    fused,
                    k,
                    self.label_names,
                    self.label_texts,
                    score_kind=kind,
                    calibrated=calibrated,
                )
        return out
