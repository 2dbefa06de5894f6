"""The curious server and the wire: what a DP client's replies let others learn.

The server knows the whole configuration (seed included), every round number, node and
partition id, and every reply. These tests play it with exactly that and nothing more.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.node import Node
from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.privacy.mechanism import difference, flat_norm
from car_fl.protocol.messages import train_reply
from car_fl.settings.compose import NodeInfo
from car_fl.settings.schema import Settings
from car_fl.testing.tiny import build_llama, synthetic_examples, write_tsv
from tests.reference import clip

#: Values a DP reply may carry besides the noised parameters: the example count (a public
#: value under DP, see docs/privacy.md), the privacy spent and public counts, and values that
#: do not depend on the data at all (not ``encoder-loads``: it says whether the node's texts
#: were all in its feature cache, i.e. whether its records changed since an earlier run).
ALLOWED = {
    "num-examples",
    "dp-epsilon",
    "dp-releases",
    "partition-id",
    "torch-threads",
    "dp-active",
}

MODES = [
    ("dp=fixed",),
    ("dp=fixed", "dp.granularity=step", "fl.max_examples_per_client=300"),
    ("dp=adaptive",),
    ("dp=adaptive", "dp.granularity=step", "fl.max_examples_per_client=300"),
    ("dp=adaptive", "dp.adaptive_rule=linear"),
    ("dp=adaptive", "dp.noise_rule=bound"),
]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden size 256: the adapter alone sends 65,536 noised coordinates."""
    return build_llama(tmp_path_factory.mktemp("models") / "wide-llama", hidden=256)


def initial_state(settings: Settings) -> dict[str, torch.Tensor]:
    splits = load_splits(settings.dataset, seed=settings.seed)
    return build_retriever(settings, len(splits.label_map)).trainable_state_dict()


def seeded_guess(like: dict[str, torch.Tensor], *, seed: int, client: int, server_round: int):
    """The noise car-fl used to draw, from (seed, client, round, step): all known to the server."""
    digest = hashlib.sha256(f"car-fl-dp:{seed}:{client}:{server_round}:0".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return {
        k: torch.randn(v.shape, generator=generator, dtype=torch.float64).to(v.dtype)
        for k, v in like.items()
    }


@pytest.mark.parametrize(
    ("dp", "expected_std"),
    [
        # σ₀·C
        (["dp=fixed", "dp.clip=0.5", "dp.noise_multiplier=0.2"], 0.2 * 0.5),
        # z_Δ·C₁ with z = 0.1, σ_b = m/20 = 0.1 (round 1 clips with the initial C₁ = dp.clip)
        (["dp=adaptive", "dp.clip=0.5"], (0.1**-2 - 0.2**-2) ** -0.5 * 0.5),
    ],
    ids=["fixed", "adaptive"],
)
@pytest.mark.slow
def test_curious_server_cannot_rebuild_or_remove_the_noise(
    make_settings, wide_llama: Path, dp: list[str], expected_std: float
) -> None:
    s = make_settings(
        "mode=adapter", "fl.local_epochs=1", "dataset.max_examples=100", *dp, model_dir=wide_llama
    )
    node, theta = NodeInfo(0, 2), initial_state(s)
    # Two runs with identical configuration, each client with fresh state, same round.
    first, m1 = Node(config={}).train(s, node, theta, 1, RecordDict())
    second, m2 = Node(config={}).train(s, node, theta, 1, RecordDict())
    assert m1 == m2 and m1["dp-active"] == 1
    for name in first:
        assert not torch.equal(first[name], second[name]), name
    # Local training is deterministic, so the replies differ by the noise alone: its spread is
    # the configured one (65,796 coordinates: 2 % is about 5 standard errors).
    gap = torch.cat([(first[k] - second[k]).flatten().double() for k in first])
    assert float(gap.std()) / math.sqrt(2) == pytest.approx(expected_std, rel=0.02)
    assert abs(float(gap.mean())) < 5 * expected_std * math.sqrt(2 / gap.numel())
    # Regenerating the noise from what the server knows (seed, partition id, round), or from
    # the run seed's global stream, does not strip it: what remains is nowhere near an
    # update clipped to C.
    moved = difference(first, theta)
    torch.manual_seed(s.seed)
    guesses = [
        seeded_guess(moved, seed=s.seed, client=node.partition_id, server_round=1),
        {k: torch.randn_like(v) for k, v in moved.items()},
    ]
    for guess in guesses:
        residual = {k: moved[k] - guess[k] * expected_std for k in moved}
        assert flat_norm(residual) > 10 * s.dp.clip
    # The noise drowns the clipped update: the best the server holds is signal + noise.
    assert flat_norm(moved) > 10 * s.dp.clip
    clipped, _ = clip(moved, s.dp.clip)
    assert flat_norm(clipped) == pytest.approx(s.dp.clip)


@pytest.mark.slow
@pytest.mark.parametrize("dp", MODES, ids=lambda m: " ".join(m))
def test_a_dp_reply_holds_nothing_data_dependent_but_parameters_count_and_epsilon(
    make_settings, tmp_path: Path, dp: tuple[str, ...]
) -> None:
    other_data = write_tsv(tmp_path / "other.tsv", synthetic_examples(333, seed=1))
    runs = []
    for data in (None, other_data):
        extra = [f"dataset.path={data}"] if data else []
        s = make_settings("fl.local_epochs=1", *dp, *extra)
        node = NodeInfo(0, 2)
        state, metrics = Node(config={}).train(s, node, initial_state(s), 1, RecordDict())
        runs.append(metrics)
        # What crosses the wire: the (noised) parameters and these metrics, nothing else.
        content = train_reply(state, metrics, dtype=s.comm.dtype)
        assert set(content.array_records) == {"arrays"}
        assert set(content.array_records["arrays"]) == set(state)
        assert set(content.metric_records) == {"metrics"} and not content.config_records
        assert set(content.metric_records["metrics"]) <= ALLOWED, set(metrics) - ALLOWED
    # Different data, of another size, same configuration: every value is the same, the
    # example count included (it was the data's n, un-noised: the attacker read it off).
    # (No encoder-loads under DP: the second dataset's features were not cached, so the
    # encoder loaded once more, and the count told whether the node's records had changed.)
    first, second = runs
    assert first == second
    assert first["dp-active"] == 1 and first["dp-epsilon"] > 0
