"""The CaR retriever: frozen encoder → soft-embedding adapter → transformer → pooling → head.

``logits = HEAD(POOL(TRF(ADP(TKN(x)))))``. Only the adapter (in ``adapter+classifier`` mode)
and the head are trainable; :meth:`CaRRetriever.trainable_state_dict` is exactly what travels
between server and clients and what a checkpoint holds.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.adapter import SoftEmbeddingAdapter
from car_fl.config import HeadConfig, Mode, Settings
from car_fl.encoder import Encoder, load_encoder, pick_device
from car_fl.head import ClassifierHead

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
        self.adapter = SoftEmbeddingAdapter(dim).to(device)
        self.head = ClassifierHead(
            dim, num_labels, pre_classifier_dim=head.pre_classifier_dim, dropout=head.dropout
        ).to(device)
        self.adapter.requires_grad_(self.mode is Mode.ADAPTER_CLASSIFIER)
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
        return self.head.classifier.weight.device

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
        logits = self.head(features)  # (batch, labels)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss

    # ------------------------------------------------------------------- trainable parameters
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name → parameter for what is trained in this mode (adapter only if trained)."""
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
) -> CaRRetriever:
    """A retriever whose head initialisation depends only on ``settings.seed``.

    With ``hidden_size`` and no ``encoder`` in classifier mode, the encoder is not loaded
    (training on cached features); otherwise it is loaded unless given.
    """
    mode = Mode(settings.train.mode)
    if encoder is None and (hidden_size is None or mode is Mode.ADAPTER_CLASSIFIER):
        encoder = load_encoder(settings.model, device=settings.device)
    torch.manual_seed(settings.seed)
    return CaRRetriever(
        encoder,
        num_labels,
        head=settings.head,
        mode=mode,
        hidden_size=hidden_size,
        device=pick_device(settings.device),
    )
