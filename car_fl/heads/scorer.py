"""The interface every head implements: pooled queries ``(batch, d)`` → a score per label.

A head is one :class:`Scorer` subclass in its own module, built from the settings by
:meth:`Scorer.build` and registered in :data:`car_fl.heads.config.HEADS`; the retriever holds it as
its ``head``. An *index* through the current adapter (MIPS's label documents) is built by
:meth:`Scorer.index`, once for all batches of an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from car_fl.heads.config import HeadConfig, HeadKind, MoEConfig, Similarity

if TYPE_CHECKING:
    from car_fl.heads.clustering import ExpertLayout

#: Token id lists → pooled vectors ``(n, d)`` through the retriever's adapter and encoder.
EncodeIds = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True)
class ScorerSpec:
    """What a head is built from: its settings, the feature width and the number of labels;
    a mixture of experts also its ``moe`` settings and ``layout``."""

    head: HeadConfig
    dim: int
    num_labels: int
    device: torch.device | str = "cpu"
    moe: MoEConfig | None = None
    layout: ExpertLayout | None = None

    @property
    def similarity(self) -> Similarity:
        """MIPS's and kNN's similarity (resolved by ``Settings``; dot for a bare config)."""
        return self.head.similarity or Similarity.DOT


class Scorer(nn.Module):
    """Pooled queries ``(batch, d)`` → scores ``(batch, labels)`` that rank like logits."""

    kind: ClassVar[HeadKind]
    #: Per-example gradients need a loop over examples (routing is data-dependent, so
    #: ``torch.func.vmap`` cannot trace it).
    per_example_loop: ClassVar[bool] = False
    #: Whether :meth:`index` runs the encoder through the adapter (MIPS's label documents): a
    #: second path to the adapter, so DP-SGD clips one example at a time.
    index_uses_adapter: ClassVar[bool] = False

    #: Whether the softmax of the scores is a probability the head was trained to give
    #: (cross-entropy over the labels); MIPS and kNN have none.
    calibrated: ClassVar[bool] = True

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        """The scorer ``spec`` asks for (its initialisation draws from torch's global RNG)."""
        raise NotImplementedError

    @property
    def score_kind(self) -> str:
        """What :meth:`reported` scores are (:data:`car_fl.heads.head.SCORE_KINDS`)."""
        return "logit"

    def reported(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores retrieval returns: those :meth:`forward` computed (MIPS undoes its
        temperature, so that a hit's score is its similarity)."""
        return scores

    def index(self, encode: EncodeIds, *, adapted: bool) -> torch.Tensor | None:
        """What the queries are scored against, through the adapter (``None``: nothing)."""
        return None

    def forward(
        self,
        queries: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores; ``labels`` are given while training (a mixture of experts routes by them)."""
        raise NotImplementedError

    def loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of ``scores`` from :meth:`forward`: cross-entropy."""
        return F.cross_entropy(scores, labels)

    def evaluation_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of evaluation ``scores`` (from the last :meth:`forward`)."""
        return F.cross_entropy(scores, labels, reduction="sum")
