"""Balanced clusters of document embeddings: the experts of the mixture of experts.

scikit-learn's ``KMeans`` places the centroids; it has no size-constrained k-means, so the
balanced assignment (at most ⌈n/k⌉ points a cluster, by proposals, :func:`balanced_assign`) is
written here, alternating with the centroids for a few Lloyd iterations, by cosine similarity.
"""

from __future__ import annotations

import base64
import hashlib
import math
from dataclasses import dataclass

import numpy as np


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def balanced_assign(x: np.ndarray, centroids: np.ndarray, capacity: int) -> np.ndarray:
    """Cluster of each row of ``x`` ``(n,)``: the most similar centroid with room (≤ capacity)."""
    n, k = len(x), len(centroids)
    if capacity * k < n:
        raise ValueError(f"{k} clusters of at most {capacity} cannot hold {n} points")
    sims = (_unit(x) @ _unit(centroids).T).astype(np.float64)  # (n, k)
    room = np.full(k, capacity)
    assign = np.full(n, -1)
    while (open_points := np.flatnonzero(assign < 0)).size:
        choice = sims[open_points].argmax(axis=1)
        sim = sims[open_points, choice]
        order = np.lexsort((-sim, choice))  # by cluster, most similar first
        grouped = choice[order]
        starts = np.searchsorted(grouped, grouped, side="left")
        rank = np.arange(len(order)) - starts
        accepted = rank < room[grouped]
        assign[open_points[order[accepted]]] = grouped[accepted]
        np.subtract.at(room, grouped[accepted], 1)
        sims[:, room == 0] = -np.inf
    return assign


def balanced_kmeans(x: np.ndarray, k: int, *, seed: int, iterations: int = 10) -> np.ndarray:
    """Labels ``(n,)`` of ``k`` balanced clusters (at most ⌈n/k⌉ points each) of ``x``."""
    from sklearn.cluster import KMeans  # scikit-learn: only when clustering

    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"cannot make {k} clusters of {n} documents; use 1 to {n} experts")
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    unit = _unit(np.asarray(x, dtype=np.float32))
    centroids = KMeans(n_clusters=k, n_init=1, random_state=seed, max_iter=50).fit(unit)
    centers = centroids.cluster_centers_
    capacity = math.ceil(n / k)
    assign = balanced_assign(unit, centers, capacity)
    for _ in range(iterations):
        centers = np.stack([unit[assign == c].mean(axis=0) for c in range(k)])
        again = balanced_assign(unit, centers, capacity)
        if np.array_equal(again, assign):
            break
        assign = again
    return assign.astype(np.int64)


def balanced_tree(
    x: np.ndarray, *, experts: int, groups: int | None, seed: int, iterations: int = 10
) -> tuple[np.ndarray, np.ndarray | None]:
    """Each document's expert ``(n,)`` and, with ``groups``, each expert's group ``(experts,)``
    (``groups`` balanced groups, each split into balanced experts numbered group by group)."""
    if groups is None:
        return balanced_kmeans(x, experts, seed=seed, iterations=iterations), None
    if experts % groups:
        raise ValueError(f"{experts} experts do not split into {groups} equal groups")
    per_group = experts // groups
    group_of_doc = balanced_kmeans(x, groups, seed=seed, iterations=iterations)
    expert_of = np.empty(len(x), dtype=np.int64)
    for g in range(groups):
        members = np.flatnonzero(group_of_doc == g)
        local = balanced_kmeans(x[members], per_group, seed=seed + g + 1, iterations=iterations)
        expert_of[members] = g * per_group + local
    return expert_of, np.repeat(np.arange(groups), per_group)


@dataclass(frozen=True)
class ExpertLayout:
    """Each document's expert ``(documents,)`` and, with two levels, each expert's group."""

    expert_of: np.ndarray
    group_of: np.ndarray | None = None

    def __post_init__(self) -> None:
        experts = int(self.expert_of.max()) + 1 if len(self.expert_of) else 0
        counts = np.bincount(self.expert_of, minlength=experts)
        if experts == 0 or (counts == 0).any():
            raise ValueError("an expert layout needs at least one document in every expert")
        if self.group_of is not None and len(self.group_of) != experts:
            raise ValueError(f"{len(self.group_of)} expert groups for {experts} experts")

    @property
    def experts(self) -> int:
        return int(self.expert_of.max()) + 1

    @property
    def groups(self) -> int | None:
        return None if self.group_of is None else int(self.group_of.max()) + 1

    def members(self, expert: int) -> np.ndarray:
        """The documents of ``expert``, in label order."""
        return np.flatnonzero(self.expert_of == expert)

    def sizes(self) -> np.ndarray:
        return np.bincount(self.expert_of, minlength=self.experts)

    def to_text(self) -> str:
        """A compact text (base64 of int32s) for checkpoints and messages."""
        parts = [self.expert_of.astype("<i4").tobytes()]
        if self.group_of is not None:
            parts.append(self.group_of.astype("<i4").tobytes())
        return ".".join(base64.b64encode(p).decode("ascii") for p in parts)

    @classmethod
    def from_text(cls, text: str) -> ExpertLayout:
        parts = [np.frombuffer(base64.b64decode(p), dtype="<i4") for p in text.split(".")]
        if not 1 <= len(parts) <= 2:
            raise ValueError("an expert layout text has one or two parts")
        groups = parts[1].astype(np.int64) if len(parts) == 2 else None
        return cls(expert_of=parts[0].astype(np.int64), group_of=groups)

    def digest(self) -> str:
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:16]
