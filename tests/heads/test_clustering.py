"""Balanced clusters: no cluster above ⌈n/k⌉, seeded, and separated groups found."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.heads.clustering import balanced_assign, balanced_kmeans, balanced_tree


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 12), seed=st.integers(0, 100))
def test_every_point_lands_in_a_cluster_of_at_most_the_ceiling(n: int, k: int, seed: int) -> None:
    k = min(k, n)
    x = np.random.default_rng(seed).normal(size=(n, 5))
    labels = balanced_kmeans(x, k, seed=seed, iterations=2)
    sizes = np.bincount(labels, minlength=k)
    assert len(labels) == n and sizes.max() <= math.ceil(n / k) and labels.min() >= 0


def test_balanced_assignment_prefers_the_most_similar_free_cluster() -> None:
    x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    centroids = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert balanced_assign(x, centroids, 2).tolist() == [0, 0, 1]
    assert balanced_assign(x, centroids, 1 + 1).tolist() == [0, 0, 1]
    # capacity 1 with 2 clusters cannot hold 3 points
    with pytest.raises(ValueError, match="cannot hold 3 points"):
        balanced_assign(x, centroids, 1)


def test_separated_groups_become_clusters_and_the_seed_fixes_them() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 16)) * 10
    x = np.concatenate([c + rng.normal(size=(25, 16)) for c in centres])
    labels = balanced_kmeans(x, 4, seed=1)
    for block in range(4):
        assert len(set(labels[block * 25 : (block + 1) * 25].tolist())) == 1
    assert np.array_equal(labels, balanced_kmeans(x, 4, seed=1))
    experts, groups = balanced_tree(x, experts=8, groups=4, seed=1)
    assert groups is not None and groups.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for block in range(4):  # each true group sits in one group of experts
        assert len(set(groups[experts[block * 25 : (block + 1) * 25]].tolist())) == 1
    with pytest.raises(ValueError, match="cannot make 101 clusters of 100 documents"):
        balanced_kmeans(x, 101, seed=0)
