"""``build_retriever``: a retriever whose start depends only on the settings and the public corpus
(a head's documents, embeddings or expert layout, the standardisation, the lexical index).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.document_head import DocumentHead
from car_fl.heads.experts import build_layout
from car_fl.heads.lexical import LexicalIndex
from car_fl.heads.retrieval import MIPSScorer
from car_fl.model.documents import document_features as embed_documents
from car_fl.model.documents import trained_rows
from car_fl.model.encoder import Encoder, load_encoder, pick_device
from car_fl.model.retriever import CaRRetriever
from car_fl.model.standardize import Standardizer
from car_fl.settings.schema import HeadKind, Lexical, Mode, Settings, Standardize


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

    frozen_mips = kind is HeadKind.MIPS and mode is Mode.CLASSIFIER
    standardize = settings.model.standardize is Standardize.DOCUMENTS
    needs_documents = kind.traits.from_documents or standardize
    if (needs_documents or frozen_mips) and document_features is None:
        if documents is None and not frozen_mips:
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
    if kind is HeadKind.MOE and layout is None:  # clustered in the space the head scores in
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
    if isinstance(model.head, MIPSScorer) and document_features is not None and frozen_mips:
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
