"""What configures the soft-embedding adapter: each ``adapter.kind``'s one registration (its
class as ``module:Class``) and the ``adapter`` settings section.

Imports no torch: the settings compose this section; :func:`car_fl.adapters.adapter.adapter_class`
imports a kind's class when an adapter is built. docs/architecture.md ("Adding an adapter kind").
"""

from __future__ import annotations

from dataclasses import dataclass

from car_fl.common.choice import Choice


class AdapterKind(Choice):
    """The soft-embedding adapter's form (:mod:`car_fl.adapters`), each the identity at start.

    ``full``: x Wᵀ with a d×d W; ``lowrank``: x (I + U Vᵀ)ᵀ, U and V d×``adapter.rank``, U zero
    at start; ``diagonal``: x ⊙ s + b, a per-dimension scale and shift.
    """

    FULL = "full"
    LOWRANK = "lowrank"
    DIAGONAL = "diagonal"

    @property
    def module_class(self) -> str:
        """Its class as ``module:Class`` (:data:`ADAPTERS`)."""
        return ADAPTERS[self]


#: Every adapter kind's class, imported when an adapter of that kind is built.
ADAPTERS: dict[AdapterKind, str] = {
    AdapterKind.FULL: "car_fl.adapters.adapter:FullAdapter",
    AdapterKind.LOWRANK: "car_fl.adapters.lowrank:LowRankAdapter",
    AdapterKind.DIAGONAL: "car_fl.adapters.diagonal:DiagonalAdapter",
}


@dataclass
class AdapterConfig:
    """The soft-embedding adapter between the token embeddings and the first block
    (:mod:`car_fl.adapters`); it trains in ``mode=adapter`` only, at ``train.adapter_lr``."""

    #: full (d×d), lowrank (identity + a rank-``rank`` residual), diagonal: :class:`AdapterKind`.
    kind: AdapterKind = AdapterKind.FULL
    #: lowrank: the rank r of the residual (1 ≤ r ≤ d; 4 to 64 is typical).
    rank: int = 16
    #: λ of the identity anchor (L2-SP): λ·‖ADP − I‖²_F added to the loss (0: none); it depends
    #: on the adapter alone, so under dp=record it is post-processing.
    anchor: float = 0.0
    #: Dropout on the soft embeddings (the adapter's output) while training (0: none).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.kind = AdapterKind.parse("adapter.kind", self.kind)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"adapter.rank must be an integer >= 1, got {self.rank!r}")
        if not (isinstance(self.anchor, int | float) and 0 <= self.anchor < float("inf")):
            raise ValueError(
                f"adapter.anchor (λ of the identity anchor) must be a finite number >= 0, got "
                f"{self.anchor!r}; e.g. adapter.anchor=0.01"
            )
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout!r}")
