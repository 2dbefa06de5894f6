"""The global label map: one fixed label ↔ index mapping per dataset, saved with checkpoints."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LabelMap:
    """An ordered, immutable list of label names; a label's index is its class id."""

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate label names in label map: {list(self.names)}")
        if not self.names:
            raise ValueError("a label map needs at least one label")

    @classmethod
    def from_labels(cls, labels: Iterable[str]) -> LabelMap:
        """Sorted unique names, so that the map does not depend on example order."""
        return cls(tuple(sorted(set(labels))))

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self._lookup[name]

    def encode(self, labels: Sequence[str], *, source: str = "data") -> list[int]:
        """Label names → ids. Unknown names raise a ``ValueError`` listing them."""
        unknown = sorted(set(labels) - set(self._lookup))
        if unknown:
            raise ValueError(
                f"{source} has labels that are not in the global label map: {unknown} "
                f"(known: {list(self.names)[:20]}{' ...' if len(self) > 20 else ''}); every "
                "client must use the same dataset and label set as the server"
            )
        return [self._lookup[name] for name in labels]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.names[i] for i in ids]

    @property
    def _lookup(self) -> dict[str, int]:
        cached: dict[str, int] | None = self.__dict__.get("_lookup_cache")
        if cached is None:
            cached = {name: i for i, name in enumerate(self.names)}
            object.__setattr__(self, "_lookup_cache", cached)
        return cached

    def to_list(self) -> list[str]:
        return list(self.names)
