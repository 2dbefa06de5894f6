"""The CaR retriever: frozen encoder → soft-embedding adapter → transformer → pooling → head.

``logits = HEAD(POOL(TRF(ADP(TKN(x)))))``. Only the adapter (in ``adapter+classifier`` mode)
and the head are trainable; :meth:`CaRRetriever.trainable_state_dict` is exactly what travels
between server and clients and what a checkpoint holds.

The head is CaR's classifier, or one of the baselines of :mod:`car_fl.retrieval`: MIPS against
the labels' document embeddings (trainable through the adapter only) or kNN over a memory of
training embeddings (nothing trainable).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.adapter import SoftEmbeddingAdapter
from car_fl.config import HeadConfig, HeadKind, Mode, Settings
from car_fl.encoder import Encoder, load_encoder, pick_device
from car_fl.head import ClassifierHead
from car_fl.retrieval import knn_scores, mips_scores

log = logging.getLogger(__name__)


class CaRRetriever(nn.Module):
    """Encoder (frozen), adapter and head, trained in one of the two :class:`Mode` s."""

    def __init__(
        self,
        encoder: Encoder | None,
        num_labels: int,
        *,
        head: HeadConfig,
        mode: Mode | str,
        hidden_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Without an ``encoder`` (classifier mode on cached features) give ``hidden_size``."""
        super().__init__()
        self._encoder = encoder
        self.mode = Mode(mode)
        if encoder is not None:
            dim, device = encoder.hidden_size, encoder.device
        elif hidden_size is None:
            raise ValueError("a retriever without an encoder needs hidden_size")
        else:
            dim = hidden_size
        if encoder is None and self.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError("adapter+classifier mode needs the encoder")
        self.kind = HeadKind(head.kind)
        if self.kind is HeadKind.KNN and self.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError("a kNN head trains nothing; use mode=classifier")
        self.num_labels = num_labels
        self.head_config = head
        self._device = torch.device(device)
        self.adapter = SoftEmbeddingAdapter(dim).to(device)
        self.head = (
            ClassifierHead(
                dim, num_labels, pre_classifier_dim=head.pre_classifier_dim, dropout=head.dropout
            ).to(device)
            if self.kind is HeadKind.CLASSIFIER
            else None
        )
        self.adapter.requires_grad_(self.mode is Mode.ADAPTER_CLASSIFIER)
        #: MIPS: the label documents' token ids (re-encoded through the adapter) or embeddings
        self.document_ids: list[list[int]] | None = None
        self.document_features: torch.Tensor | None = None
        #: kNN: training embeddings and their labels
        self.memory: torch.Tensor | None = None
        self.memory_labels: torch.Tensor | None = None
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.parameters() if not p.requires_grad)
        log.info(
            "CaR retriever (%s): %s trainable, %s frozen parameters",
            self.mode.value,
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

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        features: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, labels)`` and the cross-entropy loss when ``labels`` are given.

        Pass either token ids and mask, or precomputed pooled ``features`` ``(batch, d)``.
        """
        if features is None:
            if input_ids is None or attention_mask is None:
                raise ValueError("forward needs input_ids and attention_mask, or features")
            features = self.encode(input_ids, attention_mask)
        logits = self.score(features)  # (batch, labels)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss

    # ------------------------------------------------------------------------------ scoring
    def score(
        self, features: torch.Tensor, *, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled queries ``(batch, d)`` → one score per label ``(batch, labels)``.

        For MIPS, ``documents`` (from :meth:`document_embeddings`) saves re-encoding the
        labels' texts for every batch of an evaluation.
        """
        cfg = self.head_config
        if self.kind is HeadKind.CLASSIFIER:
            assert self.head is not None
            logits: torch.Tensor = self.head(features)
            return logits
        if self.kind is HeadKind.MIPS:
            docs = documents if documents is not None else self.document_embeddings()
            return mips_scores(features, docs, kind=cfg.similarity, temperature=cfg.temperature)
        if self.memory is None or self.memory_labels is None:
            raise RuntimeError("a kNN head needs its memory: call set_memory(features, labels)")
        return knn_scores(
            features,
            self.memory,
            self.memory_labels,
            self.num_labels,
            k=cfg.knn_k,
            kind=cfg.similarity,
        )

    def set_documents(self, texts: Sequence[str]) -> None:
        """MIPS: the labels' document texts, in label order (needs the encoder)."""
        if len(texts) != self.num_labels:
            raise ValueError(f"{len(texts)} label documents for {self.num_labels} labels")
        self.document_ids = self.encoder.tokenize(list(texts)).input_ids
        self.document_features = None

    def set_document_features(self, features: torch.Tensor) -> None:
        """MIPS without the encoder: precomputed document embeddings ``(labels, d)``."""
        if features.shape[0] != self.num_labels:
            raise ValueError(f"{features.shape[0]} label documents for {self.num_labels} labels")
        self.document_features = features.to(self.device)

    def document_embeddings(self) -> torch.Tensor:
        """The label documents ``(labels, d)`` through the current adapter.

        Re-encoded on every call while the adapter is in use (with gradients when enabled),
        encoded once and kept otherwise.
        """
        if self.document_ids is not None and (self.uses_adapter or self.document_features is None):
            ids, mask = self.encoder.pad(self.document_ids)
            if self.uses_adapter:
                return self.encode(ids, mask)
            with torch.no_grad():
                self.document_features = self.encode(ids, mask)
        if self.document_features is None:
            raise RuntimeError("a MIPS head needs its label documents: call set_documents")
        return self.document_features

    def set_memory(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """kNN: the training examples' embeddings ``(n, d)`` and labels ``(n,)``."""
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} memory rows for {len(labels)} labels")
        self.memory = features.to(self.device)
        self.memory_labels = labels.to(self.device)

    # ------------------------------------------------------------------- trainable parameters
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name → parameter for what is trained in this mode (adapter only if trained)."""
        params = {}
        if self.head is not None:
            params = {f"head.{k}": v for k, v in self.head.named_parameters()}
        if self.mode is Mode.ADAPTER_CLASSIFIER:
            params = {"adapter.weight": self.adapter.weight, **params}
        return params

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the trainable tensors, in a fixed order."""
        return {k: v.detach().cpu().clone() for k, v in self.trainable_parameters().items()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load exactly the trainable tensors (an adapter may also be given in classifier mode).

        Raises ``ValueError`` for missing, unexpected or wrongly shaped tensors.
        """
        expected = self.trainable_parameters()
        optional = {"adapter.weight": self.adapter.weight}
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


def build_retriever(
    settings: Settings,
    num_labels: int,
    *,
    encoder: Encoder | None = None,
    hidden_size: int | None = None,
    documents: Sequence[str] | None = None,
) -> CaRRetriever:
    """A retriever whose head initialisation depends only on ``settings.seed``.

    With ``hidden_size`` and no ``encoder`` in classifier mode, the encoder is not loaded
    (training on cached features); otherwise it is loaded unless given. A MIPS head gets its
    label ``documents`` here when the encoder is loaded (see
    :func:`car_fl.retrieval.label_documents`).
    """
    mode = Mode(settings.train.mode)
    if encoder is None and (hidden_size is None or mode is Mode.ADAPTER_CLASSIFIER):
        encoder = load_encoder(settings.model, device=settings.device)
    torch.manual_seed(settings.seed)
    model = CaRRetriever(
        encoder,
        num_labels,
        head=settings.head,
        mode=mode,
        hidden_size=hidden_size,
        device=pick_device(settings.device),
    )
    if model.kind is HeadKind.MIPS and documents is not None and model.has_encoder:
        model.set_documents(documents)
    return model
