"""Aggregation: the strategy registry, exact FedAvg behind the checks, the update-norm bound,
client sampling, FedProx's term, and every strategy in a short federation end to end."""

from __future__ import annotations

import csv
import logging
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
)

from car_fl.client.local_dp import ClientPrivacy
from car_fl.model.retriever import build_retriever
from car_fl.privacy.mechanism import privatize, split_adapter
from car_fl.protocol.messages import decode, to_record
from car_fl.server.aggregation import REGISTRY, flower_strategy
from car_fl.server.strategy import (
    GuardedStrategy,
    NormBound,
    gaussian_norm_quantile,
    released_parts,
    spec_of,
    update_norm,
)
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import NormBoundAction, NormBoundMode, StrategyConfig, StrategyName
from car_fl.simulation.in_process import run_local
from car_fl.training.train import ProximalTerm
from tests.helpers import reply, set_task_identity
from tests.reference import CaRFedAvg

SPEC = {"w": ((2, 3), np.dtype("float32")), "b": ((3,), np.dtype("float32"))}


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    """In-process federations run clients one after another on tiny tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def params(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": (scale * rng.normal(size=(2, 3))).astype(np.float32),
        "b": (scale * rng.normal(size=3)).astype(np.float32),
    }


class FakeGrid:
    """Only what configure_train needs: the connected node ids."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def configured(strategy: GuardedStrategy, global_: dict[str, np.ndarray], nodes: list[int]) -> None:
    """Run configure_train for round 1 (sets the reference of update norms)."""
    set_task_identity()
    record = to_record({k: torch.from_numpy(v) for k, v in global_.items()})
    strategy.configure_train(1, record, ConfigRecord(), FakeGrid(nodes))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ registry


def test_every_strategy_name_builds_flowers_own_strategy() -> None:
    expected = {
        "fedavg": FedAvg,
        "median": FedMedian,
        "trimmed_mean": FedTrimmedAvg,
        "krum": Krum,
        "multikrum": MultiKrum,
        "fedadam": FedAdam,
        "fedyogi": FedYogi,
        "fedavgm": FedAvgM,
        "fedprox": FedProx,
    }
    assert set(REGISTRY) == set(StrategyName) == set(expected)
    for name, cls in expected.items():
        assert type(flower_strategy(StrategyConfig(name=StrategyName(name)))) is cls


def test_unknown_strategy_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="choose one of fedavg, median, trimmed_mean"):
        StrategyConfig(name="fedsgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"strategy=fedsgd is not an option of strategy;.*fedavg"):
        load_settings(["strategy=fedsgd"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fl.fraction_train=0"], "fl.fraction_train must be in"),
        (["fl.clients=4", "fl.min_clients=3", "fl.clients_per_round=2"], "fl.clients_per_round"),
        (["fl.norm_bound=fixed"], "needs fl.max_update_norm"),
        (["fl.norm_bound=dp"], "needs dp=fixed and dp.granularity=round"),
        (["fl.norm_bound=dp", "dp=fixed", "dp.granularity=step"], "dp.granularity=round"),
        (["fl.norm_bound=sometimes"], "fl.norm_bound='sometimes' is not valid"),
        (["fl.norm_bound_action=ignore"], "fl.norm_bound_action"),
        (["fl.max_update_norm=0"], "fl.max_update_norm must be > 0"),
        (["fl.norm_bound_factor=0.5"], "fl.norm_bound_factor must be >= 1"),
        (["fl.norm_bound_tail=1"], "fl.norm_bound_tail"),
        (["strategy=trimmed_mean"], "needs at least 3 clients"),
        (["strategy=trimmed_mean", "fl.clients=5", "strategy.trim_fraction=0.1"], ">= 0.2"),
        (["strategy=multikrum", "strategy.num_selected=3"], "strategy.num_selected=3 exceeds"),
        (["strategy.trim_fraction=0.5"], "strategy.trim_fraction must be in"),
        (["strategy.server_momentum=1"], "strategy.server_momentum"),
        (["strategy.proximal_mu=-1"], "strategy.proximal_mu"),
        (["strategy.eta=0"], "strategy.eta must be > 0"),
    ],
)
def test_configuration_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(overrides)


# ------------------------------------------------------------------- FedAvg behind the checks


@pytest.mark.parametrize("bound", ["off", "adaptive", "fixed"])
def test_fedavg_with_every_check_equals_the_weighted_average_exactly(bound: str) -> None:
    """Honest replies: bit-identical to Σ nᵢ/n·θᵢ computed in float64 in node order."""
    global_ = params(0)
    clients = {12: (params(2), 30), 11: (params(1), 10), 13: (params(3), 60)}
    norm_bound = NormBound(mode=NormBoundMode(bound), value=100.0, factor=3.0)
    strategy = CaRFedAvg(
        spec=SPEC, shard_sizes={0: 10, 1: 30, 2: 60}, norm_bound=norm_bound, min_valid=3
    )
    configured(strategy, global_, sorted(clients))
    replies = [
        reply(node, arrays, n, **{"partition-id": node - 11})
        for node, (arrays, n) in clients.items()
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    for name in SPEC:
        expected = np.zeros(SPEC[name][0])
        for node in sorted(clients):
            values, n = clients[node]
            expected = expected + values[name].astype(np.float64) * (n / 100)
        np.testing.assert_array_equal(decode(arrays[name]), expected.astype(np.float32))
        assert arrays[name].stype == "car_fl.raw"
    assert metrics["num-examples"] == 100
    assert strategy.history[-1].rejected == {}


def test_float16_replies_are_combined_in_float64_and_sent_back_in_float16() -> None:
    spec = {"w": ((2, 3), np.dtype("float16")), "b": ((3,), np.dtype("float16"))}
    strategy = GuardedStrategy(FedMedian(), spec=spec)
    replies = [
        reply(n, {k: v.astype(np.float16) for k, v in params(n).items()}, 5) for n in (1, 2, 3)
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    stacked = np.stack([params(n)["w"].astype(np.float16) for n in (1, 2, 3)])
    np.testing.assert_array_equal(decode(arrays["w"]), np.median(stacked, axis=0))
    assert decode(arrays["w"]).dtype == np.float16


def test_robust_strategies_ignore_a_huge_reply_that_fedavg_takes() -> None:
    honest = [reply(n, params(n), 10) for n in (1, 2, 3, 4)]
    hostile = reply(5, {k: np.full_like(v, 3e30) for k, v in params(5).items()}, 10)
    for inner, robust in (
        (FedAvg(), False),
        (FedMedian(), True),
        (Krum(num_malicious_nodes=1), True),
    ):
        strategy = GuardedStrategy(inner, spec=SPEC)
        arrays, _ = strategy.aggregate_train(1, [*honest, hostile])
        assert arrays is not None
        largest = float(np.abs(decode(arrays["w"])).max())
        assert (largest < 10) is robust, (type(inner).__name__, largest)


def test_an_aggregate_that_overflows_the_models_dtype_keeps_the_model() -> None:
    # Each reply is finite in float32; a server optimiser's step from them is not.
    strategy = GuardedStrategy(FedAvgM(server_learning_rate=4.0, server_momentum=0.0), spec=SPEC)
    configured(strategy, params(0), [1, 2])
    huge = {k: np.full_like(v, 3e38) for k, v in params(1).items()}
    arrays, metrics = strategy.aggregate_train(1, [reply(1, huge, 10), reply(2, huge, 10)])
    assert arrays is None and metrics is None  # the round is skipped: the model stays as it was


# --------------------------------------------------------------------------- update-norm bound


def test_update_norm_is_the_l2_norm_of_all_tensors_and_inf_when_not_finite() -> None:
    a, b = params(1), params(2)
    flat = np.concatenate([(a[k].astype(np.float64) - b[k]).ravel() for k in SPEC])
    assert update_norm(a, b) == pytest.approx(float(np.linalg.norm(flat)), rel=1e-12)
    assert update_norm({k: np.full_like(v, 3e30) for k, v in a.items()}, b) > 1e30
    assert update_norm({**a, "w": np.full_like(a["w"], np.inf)}, b) == math.inf


@pytest.mark.parametrize(("dim", "std"), [(1, 1.0), (10, 0.5), (1000, 0.1)])
def test_gaussian_norm_quantile_bounds_the_empirical_quantile(dim: int, std: float) -> None:
    tail = 1e-2
    rng = np.random.default_rng(dim)
    norms = np.linalg.norm(rng.normal(scale=std, size=(5_000, dim)), axis=1)
    bound = gaussian_norm_quantile(parts=[(std, dim)], tail=tail)
    empirical = float(np.quantile(norms, 1 - tail))
    assert empirical <= bound <= empirical + 4 * std  # an upper bound, and not a loose one


def test_the_quantile_of_parts_with_other_stds_bounds_the_empirical_quantile() -> None:
    tail, parts = 1e-2, [(0.5, 30), (0.05, 300)]
    rng = np.random.default_rng(0)
    noise = np.concatenate([rng.normal(scale=s, size=(5_000, d)) for s, d in parts], axis=1)
    empirical = float(np.quantile(np.linalg.norm(noise, axis=1), 1 - tail))
    assert empirical <= gaussian_norm_quantile(parts=parts, tail=tail) <= empirical + 2 * 0.5


@pytest.mark.parametrize(
    ("extra", "shapes"),
    [
        ((), {"adapter.weight": (64, 8), "head.weight": (400, 64)}),
        (("dp.adapter_clip=0.01",), {"adapter.weight": (64, 8), "head.weight": (400, 64)}),
        (("dp.adapter_clip=0.01",), {"adapter.weight": (64, 64), "head.weight": (2, 64)}),
        (("dp.adapter_clip=0.01", "head.kind=mips"), {"adapter.weight": (64, 64)}),
    ],
)
def test_honest_fixed_dp_releases_pass_the_auto_bound_with_or_without_an_adapter_clip(
    extra: tuple[str, ...], shapes: dict[str, tuple[int, int]]
) -> None:
    """The node's own release (ClientPrivacy), trained far past its bounds, against the
    server's automatic bound: with dp.adapter_clip the head's noise is larger than σ₀·C and
    the clipped update reaches √(C² + C_a²); no honest reply may be rejected for it."""
    settings = load_settings(["dp=fixed", "mode=adapter", "dp.noise_multiplier=0.5", *extra])
    record = to_record({name: torch.zeros(shape) for name, shape in shapes.items()})
    bound = GuardedStrategy.for_run(settings, spec=spec_of(record)).norm_bound  # the server's
    assert bound.mode == "dp"
    state = ClientPrivacy.initial_state(settings.dp)
    client = ClientPrivacy(settings.dp, num_clients=settings.fl.clients, client=0, state=state)
    before = {name: torch.zeros(shape) for name, shape in shapes.items()}
    norms, part_norms = [], []
    zero = {k: v.double().numpy() for k, v in before.items()}
    for seed in range(100):
        gen = torch.Generator().manual_seed(seed)
        after = {k: v + torch.randn(v.shape, generator=gen) for k, v in before.items()}
        released = client.release(before, after, server_round=1)
        as_np = {k: v.double().numpy() for k, v in released.items()}
        norms.append(update_norm(as_np, zero))
        parts = split_adapter(as_np) if bound.part_values is not None else ()
        part_norms.append([update_norm(as_np, {k: zero[k] for k in p}) for p in parts])
    limit = bound.bound(1, norms)
    assert limit is not None and max(norms) <= limit <= 2 * max(norms)  # not a vacuous bound
    if bound.part_values is not None:  # each part within its own bound too, not vacuously
        most = np.max(part_norms, axis=0)
        assert all(most <= bound.part_values) and all(most >= np.divide(bound.part_values, 2))


def test_under_fixed_dp_the_bound_is_c_plus_the_noise_quantile_without_user_input() -> None:
    settings = load_settings(["dp=fixed", "dp.clip=0.5", "dp.noise_multiplier=0.2"])
    bound = NormBound.from_settings(settings, dim=400)
    assert bound.mode == "dp"
    expected = 0.5 + 0.1 * (20 + math.sqrt(2 * math.log(1e6)))
    assert bound.value == pytest.approx(expected)
    # with dp.adapter_clip: the whole and each part, three checks at a third of the tail each
    two = load_settings(
        ["dp=fixed", "dp.clip=0.5", "dp.noise_multiplier=0.2", "dp.adapter_clip=0.1"]
    )
    split = NormBound.from_settings(two, dim=400, adapter_dim=100)
    parts = released_parts(two.dp, dim=400, adapter_dim=100)
    third = two.fl.norm_bound_tail / 3
    noise = gaussian_norm_quantile(parts=[p[1:] for p in parts], tail=third)
    assert split.value == pytest.approx(math.sqrt(0.5**2 + 0.1**2) + noise)
    assert split.part_values == pytest.approx(
        [c + gaussian_norm_quantile(parts=[(std, d)], tail=third) for c, std, d in parts]
    )
    assert NormBound.from_settings(load_settings(), dim=400).mode == "off"
    fixed = NormBound.from_settings(load_settings(["fl.max_update_norm=2.5"]), dim=400)
    assert (fixed.mode, fixed.value) == ("fixed", 2.5)


def test_honest_dp_replies_pass_the_derived_bound_and_a_client_skipping_the_clip_does_not() -> None:
    """Curious server, honest clients: C + noise passes; a client that does not clip fails."""
    settings = load_settings(["dp=fixed", "dp.clip=0.5", "dp.noise_multiplier=0.3"])
    dim = 6 + 3
    global_ = params(0)
    strategy = CaRFedAvg(spec=SPEC, norm_bound=NormBound.from_settings(settings, dim=dim))
    configured(strategy, global_, [1, 2, 3, 4])
    before = {k: torch.from_numpy(v) for k, v in global_.items()}
    replies = []
    for node in (1, 2, 3):  # honest: trained far (norm ≫ C), then clipped and noised
        after = {k: v + torch.from_numpy(params(node, scale=5.0)[k]) for k, v in before.items()}
        released, _ = privatize(
            before,
            after,
            bound=0.5,
            std=0.15,
            generator=torch.Generator().manual_seed(node),  # test-only: exact values
        )
        replies.append(reply(node, {k: v.numpy() for k, v in released.items()}, 5))
    unclipped = {k: v + params(4, scale=5.0)[k] for k, v in global_.items()}
    replies.append(reply(4, unclipped, 5))
    strategy.aggregate_train(1, replies)
    stats = strategy.history[-1]
    assert set(stats.rejected) == {4}
    assert "exceeds the bound" in stats.rejected[4] and "fl.norm_bound=dp" in stats.rejected[4]
    assert stats.norm_bound is not None
    assert all(stats.update_norms[n] <= stats.norm_bound for n in (1, 2, 3))


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_adaptive_bound_rejects_or_clips_a_scaled_update(action: str) -> None:
    global_ = params(0)
    honest = {n: {k: v + 0.1 * params(n)[k] for k, v in global_.items()} for n in (1, 2, 3)}
    scaled = {k: v + 50 * (honest[3][k] - v) for k, v in global_.items()}
    strategy = CaRFedAvg(
        spec=SPEC,
        norm_bound=NormBound(
            mode=NormBoundMode.ADAPTIVE, factor=3.0, action=NormBoundAction(action)
        ),
    )
    configured(strategy, global_, [1, 2, 3, 4])
    replies = [reply(n, honest[n], 10) for n in (1, 2, 3)] + [reply(4, scaled, 10)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    stats = strategy.history[-1]
    norms = stats.update_norms
    assert stats.norm_bound == pytest.approx(3 * statistics.median_low(norms.values()))
    if action == "reject":
        assert set(stats.rejected) == {4}
        expected = {
            k: np.mean([honest[n][k].astype(np.float64) for n in (1, 2, 3)], axis=0) for k in SPEC
        }
    else:
        assert stats.clipped == [4] and not stats.rejected
        assert stats.norm_bound is not None
        factor = stats.norm_bound / norms[4]
        clipped = {
            k: global_[k] + (scaled[k].astype(np.float64) - global_[k]) * factor for k in SPEC
        }
        assert update_norm(clipped, global_) == pytest.approx(stats.norm_bound)
        expected = {
            k: np.mean([*(honest[n][k].astype(np.float64) for n in (1, 2, 3)), clipped[k]], axis=0)
            for k in SPEC
        }
    for k in SPEC:
        np.testing.assert_allclose(decode(arrays[k]), expected[k], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------- sampling


def test_sampling_is_seeded_by_round_and_never_below_min_clients() -> None:
    settings = load_settings(["fl.clients=10", "fl.fraction_train=0.3", "fl.min_clients=4"])
    assert settings.fl.sample_size(10) == 4
    assert load_settings(["fl.clients=10", "fl.fraction_train=0.3"]).fl.sample_size(10) == 3
    assert load_settings(["fl.clients=10", "fl.clients_per_round=7"]).fl.sample_size(10) == 7
    strategy = CaRFedAvg(spec=SPEC, min_clients=2, sample_size=lambda n: n // 2, seed=5)
    grid = FakeGrid(list(range(100, 110)))
    picks = [strategy.sample(r, grid)[0] for r in (1, 2, 3)]  # type: ignore[arg-type]
    assert all(len(p) == 5 and p == sorted(p) for p in picks)
    assert len({tuple(p) for p in picks}) > 1
    assert picks[0] == strategy.sample(1, grid)[0]  # type: ignore[arg-type]


@pytest.mark.slow
def test_with_4_nodes_and_2_per_round_each_round_asks_2_and_says_which(
    make_settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "fl"
    settings = make_settings(
        "fl.clients=4",
        "fl.clients_per_round=2",
        "fl.rounds=3",
        "fl.local_epochs=1",
        f"output_dir={out}",
    )
    with caplog.at_level(logging.INFO, logger="car_fl"):
        metrics = run_local(settings)
    asked = metrics["asked"]
    assert len(asked) == 3 and all(len(nodes) == 2 for nodes in asked)
    assert all(row["clients_asked"] == 2 and row["clients_ok"] == 2 for row in metrics["history"])
    rows = list(csv.DictReader((out / "clients.csv").open()))
    for round_, nodes in enumerate(asked, start=1):
        in_csv = sorted(int(r["node"]) for r in rows if int(r["round"]) == round_)
        assert in_csv == sorted(nodes)
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith(f"round {round_:>3d} |")
        ]
        assert len(lines) == 1 and lines[0].endswith("asked " + ", ".join(map(str, sorted(nodes))))


# ------------------------------------------------------------------------------------- FedProx


def test_proximal_term_is_mu_half_squared_distance_with_its_gradient(make_settings) -> None:
    model = build_retriever(make_settings(), 4, hidden_size=8)
    anchor = {k: v.detach() + 0.5 for k, v in model.trainable_parameters().items()}
    term = ProximalTerm(model, anchor, 0.2)
    value = term()
    assert float(value.detach()) == pytest.approx(
        0.5 * 0.2 * 0.25 * sum(p.numel() for p in term.params.values())
    )
    value.backward()
    for name, param in term.params.items():
        torch.testing.assert_close(param.grad, 0.2 * (param.detach() - anchor[name]))


@pytest.mark.slow
def test_fedprox_clients_stay_closer_to_the_global_model(make_settings, tmp_path: Path) -> None:
    drift = {}
    for mu in (0.0, 10.0):
        settings = make_settings(
            "strategy=fedprox",
            f"strategy.proximal_mu={mu}",
            "fl.rounds=1",
            "train.lr=0.05",
            f"output_dir={tmp_path / str(mu)}",
        )
        metrics = run_local(settings)
        row = metrics["history"][0]
        drift[mu] = row
        assert math.isfinite(row["test_top1"])
    csv_rows = {
        mu: list(csv.DictReader((tmp_path / str(mu) / "clients.csv").open())) for mu in drift
    }
    norms = {mu: max(float(r["update_norm"]) for r in rows) for mu, rows in csv_rows.items()}
    assert norms[10.0] < 0.5 * norms[0.0]


# ---------------------------------------------------------------------- every strategy, end to end


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.value for s in StrategyName])
def test_every_strategy_runs_a_short_federation_end_to_end(
    make_settings, tmp_path: Path, name: str
) -> None:
    out = tmp_path / name
    settings = make_settings(
        f"strategy={name}",
        "fl.clients=3",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "train.lr=0.01",
        f"output_dir={out}",
    )
    metrics = run_local(settings)
    assert metrics["summary"]["complete"]
    history = metrics["history"]
    assert [r["round"] for r in history] == [1, 2] and not metrics["summary"]["skipped_rounds"]
    assert history[-1]["test_top1"] > metrics["summary"]["initial"]["test_top1"]
    assert (out / "checkpoints" / "final").exists()


def test_the_run_strategy_wires_the_settings(make_settings) -> None:
    settings = make_settings(
        "strategy=krum",
        "fl.clients=4",
        "fl.clients_per_round=3",
        "fl.norm_bound=adaptive",
        "fl.norm_bound_action=clip",
        "fl.max_examples_per_client=99",
    )
    record = to_record({"w": torch.zeros(2, 3)})
    strategy = GuardedStrategy.for_run(settings, spec=spec_of(record), shard_sizes={0: 1})
    assert isinstance(strategy.inner, Krum) and strategy.inner.num_malicious_nodes == 1
    assert strategy.sample_size(4) == 3
    assert (strategy.norm_bound.mode, strategy.norm_bound.action) == ("adaptive", "clip")
    assert strategy.claims.max_examples == 99


@pytest.mark.slow
def test_a_federation_samples_2_of_4_nodes_with_a_robust_strategy(
    make_settings, tmp_path: Path
) -> None:
    out = tmp_path / "fl"
    settings = make_settings(
        "strategy=median",
        "fl.clients=4",
        "fl.clients_per_round=2",
        "fl.rounds=2",
        "fl.local_epochs=1",
        f"output_dir={out}",
    )
    metrics = run_local(settings)
    assert [r["clients_asked"] for r in metrics["history"]] == [2, 2]
    assert [len(asked) for asked in metrics["asked"]] == [2, 2]
    rows = list(csv.DictReader((out / "clients.csv").open()))
    for round_ in ("1", "2"):
        assert sorted(r["status"] for r in rows if r["round"] == round_) == ["ok", "ok"]
