"""A curious server's shadow-model attack on a shard's label mix, through the node's real release.

The server trains *shadow* nodes on label mixes it chose, through the node's own round
(:func:`car_fl.client.round.train_shard`), fits a ridge map from update to label shares, and
reads the targets' replies: their majority label and present labels, each scored against the
best guess without any reply (docs/privacy.md, "What each DP mode protects").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from sklearn.linear_model import RidgeCV
from sklearn.preprocessing import StandardScaler

from car_fl.client.round import Shard, train_shard
from car_fl.data.labels import LabelMap
from car_fl.model.features import LocalData
from car_fl.settings.compose import NodeInfo
from car_fl.settings.schema import Settings


@dataclass(frozen=True)
class Pool:
    """Examples to draw shards from: pooled features ``(n, d)`` and label ids ``(n,)``."""

    features: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True)
class MixAttack:
    """How well the attack reads target nodes' label mixes, beside the no-reply baseline."""

    mode: str
    #: The ε a target's reply states (``inf`` when it says it is not private), at its δ.
    epsilon: float
    majority: float
    majority_baseline: float
    presence: float
    presence_baseline: float
    shadows: int
    targets: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def label_mixes(count: int, labels: int, *, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` label mixes (rows sum to 1), Dirichlet(α): small α, skewed shards."""
    return rng.dirichlet(np.full(labels, alpha), size=count)


def draw(pool: Pool, mix: np.ndarray, n: int, rng: np.random.Generator) -> tuple[Pool, np.ndarray]:
    """A shard of ``n`` examples from ``pool`` with the label mix ``mix``, and its true shares."""
    counts = rng.multinomial(n, mix)
    picks = []
    for label, count in enumerate(counts):
        where = np.flatnonzero(pool.labels.numpy() == label)
        picks.append(rng.choice(where, size=count, replace=count > len(where)))
    chosen = torch.as_tensor(np.concatenate(picks), dtype=torch.long)
    return Pool(pool.features[chosen], pool.labels[chosen]), counts / n


def update_of(
    settings: Settings,
    shard: Pool,
    label_map: LabelMap,
    global_state: dict[str, torch.Tensor],
    *,
    node: int,
) -> tuple[np.ndarray, float]:
    """What the server sees of one node's round: the update (reply − global), flattened, and
    the ε the reply states. The round is the node's own, from a fresh per-run state."""
    data = LocalData(labels=shard.labels, features=shard.features)
    state, metrics = train_shard(
        settings,
        NodeInfo(partition_id=node, num_partitions=node + 1),
        Shard(data=data, label_map=label_map, examples=len(data)),
        global_state,
        1,
        RecordDict(),
    )
    delta = [(state[k].float() - global_state[k].float()).flatten() for k in sorted(state)]
    private = bool(metrics.get("dp-active", 0))
    return torch.cat(delta).numpy(), float(metrics["dp-epsilon"]) if private else math.inf


def attack(
    settings: Settings,
    *,
    mode: str,
    shadow_pool: Pool,
    target_pool: Pool,
    label_map: LabelMap,
    global_state: dict[str, torch.Tensor],
    shadows: int,
    targets: int,
    examples: int,
    alpha: float = 0.5,
    presence: float = 0.1,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> MixAttack:
    """Train ``shadows`` shadow nodes on ``shadow_pool``, fit the map, read ``targets`` nodes
    drawn from ``target_pool`` (disjoint examples): the scores of :class:`MixAttack`."""
    rng = np.random.default_rng(seed)
    labels = len(label_map)
    rows: list[np.ndarray] = []
    shares: list[np.ndarray] = []
    epsilons: list[float] = []
    for node, (pool, count) in enumerate([(shadow_pool, shadows), (target_pool, targets)]):
        for mix in label_mixes(count, labels, alpha=alpha, rng=rng):
            shard, share = draw(pool, mix, examples, rng)
            update, eps = update_of(settings, shard, label_map, global_state, node=node)
            rows.append(update)
            shares.append(share)
            epsilons.append(eps)
            if progress is not None:
                progress(1)
    x, y = np.stack(rows), np.stack(shares)
    scaler = StandardScaler().fit(x[:shadows])
    ridge = RidgeCV(alphas=np.logspace(-2, 5, 15)).fit(scaler.transform(x[:shadows]), y[:shadows])
    guess = ridge.predict(scaler.transform(x[shadows:]))
    truth = y[shadows:]
    shadow_majority = np.bincount(y[:shadows].argmax(1), minlength=labels).argmax()
    shadow_presence = (y[:shadows] >= presence).mean(0) >= 0.5
    return MixAttack(
        mode=mode,
        epsilon=max(epsilons[shadows:]),
        majority=float((guess.argmax(1) == truth.argmax(1)).mean()),
        majority_baseline=float((truth.argmax(1) == shadow_majority).mean()),
        presence=float(((guess >= presence) == (truth >= presence)).mean()),
        presence_baseline=float((shadow_presence[None, :] == (truth >= presence)).mean()),
        shadows=shadows,
        targets=targets,
    )
