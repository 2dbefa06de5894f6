"""car_fl.simulation.label_mix: the curious server's shadow-model attack on a shard's label mix."""

from __future__ import annotations

import math

import numpy as np
import torch

from car_fl.data.labels import LabelMap
from car_fl.model.retriever import build_retriever
from car_fl.simulation.label_mix import Pool, attack, draw, label_mixes

LABELS = LabelMap(tuple(f"topic{i}" for i in range(4)))


def pool(seed: int, n: int = 400, dim: int = 16) -> Pool:
    """Four separable clusters: what a label mix does to an update is easy to see."""
    generator = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(len(LABELS), dim, generator=generator)
    labels = torch.arange(n) % len(LABELS)
    noise = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return Pool(features=centres[labels] + noise, labels=labels)


def run(settings, mode: str):
    state = build_retriever(settings, len(LABELS), hidden_size=16).trainable_state_dict()
    return attack(
        settings,
        mode=mode,
        shadow_pool=pool(1),
        target_pool=pool(2),
        label_map=LABELS,
        global_state=state,
        shadows=60,
        targets=30,
        examples=40,
    )


def test_a_drawn_shard_has_the_mix_it_was_drawn_with() -> None:
    rng = np.random.default_rng(0)
    (mix,) = label_mixes(1, len(LABELS), alpha=0.5, rng=rng)
    shard, shares = draw(pool(1), mix, 200, rng)
    counts = torch.bincount(shard.labels, minlength=len(LABELS)).numpy()
    assert np.allclose(counts / 200, shares) and abs(shares.sum() - 1) < 1e-9
    assert np.abs(shares - mix).max() < 0.15


def test_without_dp_a_reply_gives_the_shards_label_mix_away(make_settings) -> None:
    result = run(make_settings("dp=none", "fl.rounds=1", "fl.local_epochs=1"), "none")
    assert math.isinf(result.epsilon)
    assert result.majority >= 0.8 and result.majority >= result.majority_baseline + 0.3
    assert result.presence > result.presence_baseline


def test_client_level_noise_leaves_the_attack_no_better_than_guessing(make_settings) -> None:
    settings = make_settings(
        "dp=fixed", "dp.noise_multiplier=1000", "dp.clip=1", "fl.rounds=1", "fl.local_epochs=1"
    )
    result = run(settings, "client-level")
    assert result.epsilon < 0.01
    assert result.majority <= 0.6  # four labels: a guess is right about a third of the time
