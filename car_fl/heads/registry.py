"""The heads by ``head.kind``: the one place a new head is registered.

What is asked of a kind without building it is its :class:`~car_fl.settings.choices.HeadTraits`;
docs/architecture.md ("Adding a head") works one example through.
"""

from __future__ import annotations

import torch

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.document_head import DocumentScorer
from car_fl.heads.experts import MixtureScorer
from car_fl.heads.head import ClassifierScorer
from car_fl.heads.retrieval import KNNScorer, MIPSScorer
from car_fl.heads.scorer import Scorer, ScorerSpec
from car_fl.settings.schema import HeadConfig, HeadKind, MoEConfig

#: ``head.kind`` → its scorer.
SCORERS: dict[HeadKind, type[Scorer]] = {
    scorer.kind: scorer
    for scorer in (ClassifierScorer, MIPSScorer, KNNScorer, DocumentScorer, MixtureScorer)
}


def build_scorer(
    head: HeadConfig,
    *,
    dim: int,
    num_labels: int,
    device: torch.device | str = "cpu",
    moe: MoEConfig | None = None,
    layout: ExpertLayout | None = None,
) -> Scorer:
    """The scorer of ``head.kind`` (:meth:`~car_fl.heads.scorer.Scorer.build`); ``TypeError``
    for a head with a 0-d parameter, which no message could carry."""
    spec = ScorerSpec(head, dim, num_labels, device=device, moe=moe, layout=layout)
    scorer = SCORERS[head.kind].build(spec)
    for name, parameter in scorer.named_parameters():
        if parameter.dim() == 0:
            raise TypeError(
                f"head.kind={head.kind}: its parameter {name!r} is 0-d, and Flower's messages "
                "carry no 0-d arrays; give it shape (1,)"
            )
    return scorer
