"""Local DP: clipping, noise, the adaptive rule, warm-up, accounting, and bad parameters."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from flwr.app import RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.client import NodeInfo, load_privacy, train_round
from car_fl.config import DPConfig, load_settings
from car_fl.data import load_splits
from car_fl.model import build_retriever
from car_fl.privacy.accountant import epsilon, release_multiplier
from car_fl.privacy.client import ClientPrivacy, DPState, PrivacyBudgetExhausted
from car_fl.privacy.mechanism import (
    bound_noise_std,
    clip,
    flat_norm,
    next_clip,
    noise_generator,
    privatize,
    smoothed_norm,
    update_noise_multiplier,
)


def privacy(mode: str, *, clients: int = 2, **kw: object) -> ClientPrivacy:
    cfg = DPConfig(mode=mode, **kw)  # type: ignore[arg-type]
    return ClientPrivacy(
        cfg, num_clients=clients, seed=1, client=0, state=ClientPrivacy.initial_state(cfg)
    )


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=4),
    scale=st.floats(1e-6, 1e6),
    bound=st.floats(1e-4, 1e4),
    seed=st.integers(0, 2**31),
)
def test_clipped_update_never_exceeds_the_bound(
    shapes: list[list[int]], scale: float, bound: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    delta = {
        f"t{i}": torch.randn(s, generator=g, dtype=torch.float64) * scale
        for i, s in enumerate(shapes)
    }
    clipped, norm = clip(delta, bound)
    assert flat_norm(clipped) <= bound * (1 + 1e-6)
    assert norm == pytest.approx(flat_norm(delta))
    if norm <= bound:  # nothing to clip: unchanged
        assert all(torch.equal(clipped[k], delta[k]) for k in delta)


def test_clipping_uses_one_norm_over_all_tensors() -> None:
    delta = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}  # joint norm 5
    clipped, norm = clip(delta, 1.0)
    assert norm == 5.0
    assert clipped["a"].item() == pytest.approx(0.6) and clipped["b"].item() == pytest.approx(0.8)


def sample_noise(p: ClientPrivacy, draws: int = 200_000) -> torch.Tensor:
    zeros = {"w": torch.zeros(draws, dtype=torch.float64)}
    return p.release(zeros, zeros, server_round=1)["w"]


def test_fixed_noise_has_std_sigma0_times_c() -> None:
    noise = sample_noise(privacy("fixed", clip=2.0, noise_multiplier=0.3))
    assert float(noise.std()) == pytest.approx(0.3 * 2.0, rel=0.02)
    assert abs(float(noise.mean())) < 0.01


def test_adaptive_noise_has_std_z_delta_times_c() -> None:
    p = privacy("adaptive", clients=10, clip=1.5, noise_multiplier=0.5)
    z_delta = (0.5**-2 - 1.0**-2) ** -0.5  # σ_b = 10/20, so 2σ_b = 1
    assert p.z_delta == pytest.approx(z_delta)
    noise = sample_noise(p)
    assert float(noise.std()) == pytest.approx(z_delta * 1.5, rel=0.02)


def test_noise_is_reproducible_and_never_shared() -> None:
    a = torch.randn(5, generator=noise_generator(seed=1, client=0, round=3))
    b = torch.randn(5, generator=noise_generator(seed=1, client=0, round=3))
    c = torch.randn(5, generator=noise_generator(seed=1, client=1, round=3))
    d = torch.randn(5, generator=noise_generator(seed=1, client=0, round=4))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_z_delta_formula_and_its_domain() -> None:
    assert update_noise_multiplier(0.1, 2) == pytest.approx((0.1**-2 - 0.2**-2) ** -0.5)
    assert update_noise_multiplier(0.1, 3) == pytest.approx((0.1**-2 - 0.3**-2) ** -0.5)
    with pytest.raises(ValueError, match=r"z < 2·σ_b = m/10 = 0.2 with m = 2 clients.*z = 0.2"):
        update_noise_multiplier(0.2, 2)


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_adaptive_clip_follows_the_rule_on_scripted_norms(decay: float) -> None:
    beta, gamma, c0 = 0.05, 0.9, 1.0
    p = privacy(
        "adaptive",
        clip=c0,
        noise_multiplier=0.1,
        update_rate=beta,
        target_quantile=gamma,
        ema_decay=decay,
    )
    norms = [2.0, 0.5, 3.0, 1.0, 10.0]
    expected_c, ema = c0, None
    zero = {"w": torch.zeros(4, dtype=torch.float64)}
    for r, norm in enumerate(norms, start=1):
        after = {"w": torch.tensor([norm, 0.0, 0.0, 0.0], dtype=torch.float64)}
        p.release(zero, after, server_round=r)
        ema = norm if ema is None or decay == 0 else decay * ema + (1 - decay) * norm
        expected_c = (1 - beta) * expected_c + beta * gamma * ema
        assert p.state.clip == pytest.approx(expected_c, rel=1e-12)
    assert smoothed_norm(None, 2.0, 0.9) == 2.0
    assert next_clip(1.0, 2.0, rate=0.5, target=1.0) == 1.5


def test_bound_noise_rule_option() -> None:
    p = privacy("adaptive", clip=2.0, noise_multiplier=0.1, noise_rule="bound")
    assert p.z_delta is not None
    expected = math.sqrt(2 * p.z_delta**2 * (0.95**2 * 4.0 + 0.05**2 * 0.81 * 9.0))
    assert p.noise_std(3.0) == pytest.approx(expected)
    assert bound_noise_std(1.0, 1.0, 0.0, rate=0.0, target=1.0) == pytest.approx(math.sqrt(2))


def test_huge_clip_and_zero_noise_give_back_the_update_exactly() -> None:
    before = {"w": torch.tensor([0.1, 0.2, 0.3])}
    after = {"w": torch.tensor([0.3, -0.7, 1e-8])}
    released, _ = privatize(
        before, after, bound=1e30, std=0.0, generator=noise_generator(seed=0, client=0, round=1)
    )
    assert torch.equal(released["w"], after["w"])


def test_one_release_epsilon_matches_dp_accounting_and_grows() -> None:
    one = epsilon({0.5: 1}, 1e-5)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(0.5))
    assert one == pytest.approx(accountant.get_epsilon(1e-5))
    # Flower 1.39's own test vector: multiplier 0.5, 5 releases, δ = 1e-5 -> ε ≈ 30.127.
    assert epsilon({0.5: 5}, 1e-5) == pytest.approx(30.127, abs=1e-3)
    eps = [epsilon({0.5: k}, 1e-5) for k in range(1, 6)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert release_multiplier(noise_std=0.3, clip_bound=1.5) == pytest.approx(0.1)
    assert epsilon({}, 1e-5) == 0.0 and math.isinf(epsilon({0.0: 1}, 1e-5))


def test_client_reports_epsilon_of_its_releases() -> None:
    p = privacy("fixed", clip=1.0, noise_multiplier=1.0)  # multiplier 1 / 2 = 0.5
    zero = {"w": torch.zeros(3)}
    for r in range(1, 4):
        p.release(zero, zero, server_round=r)
    assert p.metrics()["dp-epsilon"] == pytest.approx(epsilon({0.5: 3}, 1e-5))
    assert p.metrics()["dp-releases"] == 3


def test_target_epsilon_stops_a_client_before_it_overspends() -> None:
    p = privacy(
        "fixed", clip=1.0, noise_multiplier=1.0, target_epsilon=epsilon({0.5: 2}, 1e-5) + 1e-9
    )
    zero = {"w": torch.zeros(3)}
    p.release(zero, zero, server_round=1)
    p.release(zero, zero, server_round=2)
    with pytest.raises(PrivacyBudgetExhausted, match=r"client 0 stops contributing.*target"):
        p.release(zero, zero, server_round=3)
    assert sum(p.state.releases.values()) == 2


def test_non_finite_update_is_never_clipped_or_sent() -> None:
    p = privacy("fixed", clip=1.0, noise_multiplier=0.1)
    before = {"head.classifier.weight": torch.zeros(2), "head.classifier.bias": torch.zeros(1)}
    after = {
        "head.classifier.weight": torch.tensor([1.0, float("nan")]),
        "head.classifier.bias": torch.zeros(1),
    }
    with pytest.raises(FloatingPointError, match=r"client 0.*'head.classifier.weight'.*NaN"):
        p.release(before, after, server_round=1)
    assert p.state.releases == {}


def test_dp_state_round_trips_through_a_flower_record() -> None:
    state = DPState(clip=0.7, ema=1.25, releases={0.05: 3, 0.1: 2})
    assert DPState.from_record(state.to_record()) == state
    assert DPState.from_record(DPState(clip=1.0).to_record()) == DPState(clip=1.0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dp=fixed dp.clip=0", r"dp.clip \(the clipping bound C\) must be > 0"),
        ("dp=fixed dp.clip=-1", r"dp.clip .* must be > 0"),
        ("dp=fixed dp.noise_multiplier=-0.1", r"dp.noise_multiplier must be >= 0"),
        ("dp=adaptive dp.update_rate=1.0", r"dp.update_rate \(β\) must be in \[0, 1\)"),
        ("dp=adaptive dp.update_rate=-0.1", r"dp.update_rate \(β\) must be in \[0, 1\)"),
        ("dp=adaptive dp.target_quantile=0", r"dp.target_quantile \(γ\) must be > 0"),
        ("dp=adaptive dp.noise_multiplier=0.2", r"m = 2 clients, got z = 0.2"),
        ("dp=adaptive fl.clients=3 dp.noise_multiplier=0.35", r"m = 3 clients"),
        ("dp=fixed dp.delta=0", r"dp.delta must be in \(0, 1\)"),
        ("dp=fixed dp.delta=1", r"dp.delta must be in \(0, 1\)"),
        ("dp=fixed dp.granularity=epoch", r"dp.granularity='epoch' is not valid"),
        ("dp=laplace", r"(?s)Could not find 'dp/laplace'.*adaptive.*fixed.*none"),
    ],
)
def test_impossible_dp_parameters_are_rejected_at_start(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)


# ------------------------------------------------------------------ through the client's round


@pytest.fixture
def round_inputs(make_settings):  # type: ignore[no-untyped-def]
    def make(*overrides: str):  # type: ignore[no-untyped-def]
        s = make_settings("fl.local_epochs=1", *overrides)
        splits = load_splits(s.dataset, seed=s.seed)
        initial = build_retriever(s, len(splits.label_map)).trainable_state_dict()
        return s, NodeInfo(0, 2), initial

    return make


def test_dp_none_and_huge_clip_without_noise_reproduce_the_non_dp_round(round_inputs) -> None:  # type: ignore[no-untyped-def]
    s_none, node, initial = round_inputs("dp=none")
    s_fixed, _, _ = round_inputs("dp=fixed", "dp.clip=1e30", "dp.noise_multiplier=0")
    plain, _ = train_round(s_none, node, initial, 1, RecordDict())
    fixed, metrics = train_round(s_fixed, node, initial, 1, RecordDict())
    assert metrics["dp-active"] == 1
    for name in plain:
        assert torch.equal(plain[name], fixed[name]), name


def test_warmup_rounds_add_no_noise_and_later_rounds_do(round_inputs) -> None:  # type: ignore[no-untyped-def]
    s_none, node, initial = round_inputs("dp=none")
    s_dp, _, _ = round_inputs("dp=adaptive", "dp.warmup_rounds=1", "dp.clip=1e30")
    state = RecordDict()
    for server_round in (1, 2):
        plain, _ = train_round(s_none, node, initial, server_round, RecordDict())
        private, metrics = train_round(s_dp, node, initial, server_round, state)
        same = all(torch.equal(plain[k], private[k]) for k in plain)
        assert same == (server_round == 1)
        assert metrics["dp-active"] == int(server_round == 2)
        assert (metrics["dp-epsilon"] > 0) == (server_round == 2)


def test_adaptive_state_persists_in_the_node_state(round_inputs) -> None:  # type: ignore[no-untyped-def]
    s, node, initial = round_inputs("dp=adaptive")
    state = RecordDict()
    _, first = train_round(s, node, initial, 1, state)
    assert load_privacy(s, node, state).state.clip == first["dp-next-clip"]
    _, second = train_round(s, node, initial, 2, state)
    assert second["dp-clip"] == first["dp-next-clip"] != s.dp.clip
    assert second["dp-releases"] == 2 and second["dp-epsilon"] > first["dp-epsilon"]


def test_step_granularity_clips_every_step(round_inputs) -> None:  # type: ignore[no-untyped-def]
    s, node, initial = round_inputs(
        "dp=fixed", "dp.granularity=step", "dp.clip=1e-3", "dp.noise_multiplier=0", "train.lr=0.5"
    )
    state, metrics = train_round(s, node, initial, 1, RecordDict())
    steps = math.ceil(160 / s.train.batch_size)  # client 0 of 2 holds 160 examples
    assert metrics["dp-releases"] == steps
    moved = flat_norm({k: state[k] - initial[k] for k in state})
    assert moved <= steps * 1e-3 * (1 + 1e-5)


def test_step_granularity_with_adaptive_clipping_adapts_every_step(round_inputs) -> None:  # type: ignore[no-untyped-def]
    s, node, initial = round_inputs("dp=adaptive", "dp.granularity=step", "dp.clip=0.01")
    state = RecordDict()
    _, metrics = train_round(s, node, initial, 1, state)
    steps = math.ceil(160 / s.train.batch_size)
    assert metrics["dp-releases"] == steps
    # C_i moved once per step: (1 - β)^steps of the initial bound plus the norm terms.
    assert metrics["dp-next-clip"] != pytest.approx(0.01)
    assert load_privacy(s, node, state).state.clip == metrics["dp-next-clip"]
