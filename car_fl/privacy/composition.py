"""A data owner's lifetime privacy: releases of every kind, composed with dp-accounting (PLD).

A node's ledger (:mod:`car_fl.client.ledger`) holds every release it ever made from one data
file, whatever the run, mode or round. This module says what each release is as a
dp-accounting event and composes them all in one privacy-loss-distribution accountant under
the **replace-one** relation (what holds while the example count n travels un-noised; see
:mod:`car_fl.privacy.record_accounting`):

- ``gaussian``: one client-level local-DP release (``dp=fixed|adaptive``, or one step of
  ``dp.granularity=step``) of multiplier μ = noise std / (2C), the sensitivity 2C being that of
  replacing the client's *whole* data, so also of replacing one record. Under replace-one
  dp-accounting reads a ``GaussianDpEvent(s)`` with sensitivity 2, so the same release is
  ``GaussianDpEvent(2μ)`` there (tested against client-level accounting).
- ``dpsgd``: record-level DP-SGD steps, ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``.
- ``non-private``: a release with no noise (``dp=none``, a warm-up round, the non-private
  adaptive rules). Its ε is infinite; it is counted apart, and the ε figure covers the others.

Identical releases are grouped before composing (k Gaussian releases of multiplier μ are one
of μ/√k), so a ledger of thousands of entries composes in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from car_fl.privacy.record_accounting import VALUE_DISCRETIZATION


class ReleaseKind(StrEnum):
    """What a release is, for accounting."""

    GAUSSIAN = "gaussian"
    DPSGD = "dpsgd"
    NON_PRIVATE = "non-private"


@dataclass(frozen=True)
class Release:
    """``count`` identical releases (``gaussian``, ``non-private``) or DP-SGD steps (``dpsgd``).

    ``noise_multiplier``: μ = std / (2C) for ``gaussian`` (what
    :func:`car_fl.privacy.accountant.epsilon` composes), σ for ``dpsgd``. ``sample_rate``: q
    for ``dpsgd`` (1 otherwise).
    """

    kind: ReleaseKind
    count: int
    noise_multiplier: float = 0.0
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ReleaseKind(self.kind))
        if self.count < 0:
            raise ValueError(f"a release count must be >= 0, got {self.count}")
        if self.kind is not ReleaseKind.NON_PRIVATE and not self.noise_multiplier > 0:
            raise ValueError(
                f"a {self.kind.value} release needs a noise multiplier > 0, got "
                f"{self.noise_multiplier}; a release without noise is non-private"
            )
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"a sampling rate must be in (0, 1], got {self.sample_rate}")

    @property
    def private(self) -> bool:
        return self.kind is not ReleaseKind.NON_PRIVATE

    def event(self) -> Any:
        """This release as one dp-accounting event (replace-one relation)."""
        import dp_accounting

        if self.kind is ReleaseKind.GAUSSIAN:
            one = dp_accounting.GaussianDpEvent(2.0 * self.noise_multiplier)
        elif self.kind is ReleaseKind.DPSGD:
            one = dp_accounting.PoissonSampledDpEvent(
                self.sample_rate, dp_accounting.GaussianDpEvent(self.noise_multiplier)
            )
        else:
            one = dp_accounting.NonPrivateDpEvent()
        return dp_accounting.SelfComposedDpEvent(one, self.count)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "count": self.count,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Release:
        return cls(
            kind=ReleaseKind(values["kind"]),
            count=int(values["count"]),
            noise_multiplier=float(values["noise_multiplier"]),
            sample_rate=float(values["sample_rate"]),
        )


def grouped(releases: Iterable[Release]) -> list[Release]:
    """The same releases with identical ones merged (their counts added), in a fixed order."""
    counts: Counter[tuple[ReleaseKind, float, float]] = Counter()
    for release in releases:
        counts[(release.kind, release.noise_multiplier, release.sample_rate)] += release.count
    return [
        Release(kind=kind, count=count, noise_multiplier=mu, sample_rate=q)
        for (kind, mu, q), count in sorted(counts.items(), key=lambda item: str(item[0]))
        if count > 0
    ]


def non_private_count(releases: Iterable[Release]) -> int:
    """How many of the releases carried no noise at all."""
    return sum(r.count for r in releases if not r.private)


def epsilon(releases: Iterable[Release], delta: float) -> float:
    """ε at δ of all the private releases together (PLD, replace-one); 0 with none.

    Non-private releases are left out (see :func:`non_private_count`): their ε is infinite,
    and a ledger reports how many there were beside the ε of the rest.
    """
    if not 0 < delta < 1:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    private = [r for r in grouped(releases) if r.private]
    if not private:
        return 0.0
    import dp_accounting
    from dp_accounting import pld

    accountant = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=VALUE_DISCRETIZATION,
    )
    accountant.compose(dp_accounting.ComposedDpEvent([r.event() for r in private]))
    value = float(accountant.get_epsilon(target_delta=delta))
    return value if math.isfinite(value) else math.inf
