"""A head built from its ``head.kind``: the scorer its registration names
(:data:`car_fl.heads.config.HEADS`), imported only now."""

from __future__ import annotations

import importlib

import torch

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.config import HeadConfig, HeadKind, MoEConfig
from car_fl.heads.scorer import Scorer, ScorerSpec


def scorer_class(kind: HeadKind) -> type[Scorer]:
    """The scorer class ``kind``'s registration names (``module:Class``), checked to be a
    :class:`~car_fl.heads.scorer.Scorer` of that kind."""
    module, _, name = kind.spec.scorer.partition(":")
    scorer = getattr(importlib.import_module(module), name)
    if not (isinstance(scorer, type) and issubclass(scorer, Scorer) and scorer.kind is kind):
        raise TypeError(f"head.kind={kind}: {kind.spec.scorer} is no Scorer of kind {kind}")
    return scorer


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
    scorer = scorer_class(head.kind).build(spec)
    for name, parameter in scorer.named_parameters():
        if parameter.dim() == 0:
            raise TypeError(
                f"head.kind={head.kind}: its parameter {name!r} is 0-d, and Flower's messages "
                "carry no 0-d arrays; give it shape (1,)"
            )
    return scorer
