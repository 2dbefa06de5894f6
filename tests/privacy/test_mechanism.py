"""Local DP: clipping, noise, the adaptive rule, warm-up, accounting, and bad parameters."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.client.local_dp import (
    ClientPrivacy,
    StepPrivatizer,
)
from car_fl.privacy.accountant import (
    combined_multiplier,
    epsilon,
    indicator_multiplier,
    release_multiplier,
)
from car_fl.privacy.mechanism import (
    clip_per_example,
    flat_norm,
    float64_device,
    in_float64,
    per_example_norms,
    privatize,
)
from car_fl.settings.compose import load_settings
from car_fl.settings.dp_modes.adaptive import (
    bound_noise_std,
    geometric_clip,
    linear_clip,
    smoothed_norm,
    update_noise_multiplier,
)
from tests.helpers import client_privacy, load_script
from tests.reference import clip


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
    noise = sample_noise(client_privacy("fixed", clip=2.0, noise_multiplier=0.3))
    assert float(noise.std()) == pytest.approx(0.3 * 2.0, rel=0.02)
    assert abs(float(noise.mean())) < 0.01


def test_adaptive_noise_has_std_z_delta_times_c() -> None:
    p = client_privacy("adaptive", clients=10, clip=1.5, noise_multiplier=0.5)
    z_delta = (0.5**-2 - 1.0**-2) ** -0.5  # σ_b = 10/20, so 2σ_b = 1
    assert p.z_delta == pytest.approx(z_delta)
    noise = sample_noise(p)
    assert float(noise.std()) == pytest.approx(z_delta * 1.5, rel=0.02)


def test_only_an_injected_generator_makes_the_noise_repeat() -> None:
    zeros = {"w": torch.zeros(1000)}

    def release(generator: torch.Generator | None) -> torch.Tensor:
        p = client_privacy("fixed", clip=1.0, noise_multiplier=1.0, generator=generator)
        return p.release(zeros, zeros, server_round=1)["w"]

    # Test-only API: the same generator state gives the same noise ...
    a, b = release(torch.Generator().manual_seed(7)), release(torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    # ... and without one (every run), same configuration and round give different noise.
    assert not torch.equal(release(None), release(None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_noise_follows_the_parameters_dtype_and_device(dtype: torch.dtype) -> None:
    before = {"w": torch.zeros(20_000, dtype=dtype), "b": torch.zeros(3, dtype=dtype)}
    released, _ = privatize(before, before, bound=1.0, std=0.5)
    for name, value in released.items():
        assert value.dtype == dtype and value.device == before[name].device, name
    assert float(released["w"].double().std()) == pytest.approx(0.5, rel=0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["round", "step"])
def test_noise_is_drawn_on_cuda_for_cuda_parameters(granularity: str) -> None:
    device = torch.device("cuda")
    p = client_privacy("adaptive", clip=1.0, noise_multiplier=0.1)
    before = {"w": torch.zeros(100_000, device=device)}
    after = {"w": torch.full((100_000,), 1e-4, device=device)}
    if granularity == "round":
        released = p.release(before, after, server_round=1)["w"]
    else:  # the per-step path writes the release into the parameters themselves
        param = torch.nn.Parameter(before["w"].clone())
        hook = StepPrivatizer(p, {"w": param}, server_round=1)
        with torch.no_grad():
            param.add_(after["w"])
        hook(None)
        released = param.detach()
    assert released.device.type == "cuda" and released.dtype == torch.float32
    assert float((released - after["w"]).std()) == pytest.approx(p.z_delta, rel=0.02)


def test_float64_sums_leave_only_a_device_without_float64() -> None:
    """MPS has no float64 (``.double()`` raises there): the sums that clipping rests on move to
    the CPU for it, and only for it; no device object is needed to say so."""
    assert float64_device(torch.device("mps")) == torch.device("cpu")
    assert float64_device(torch.device("mps:0")) == torch.device("cpu")
    assert float64_device(torch.device("cuda:1")) == torch.device("cuda:1")
    assert float64_device(torch.device("cpu")) == torch.device("cpu")
    x = torch.ones(3, dtype=torch.bfloat16)
    assert in_float64(x).dtype == torch.float64 and in_float64(x).device == x.device


@pytest.mark.mps
def test_clipping_and_local_dp_run_on_mps_strictly_within_the_bound() -> None:
    """On a Mac's GPU: per-example clipping and the local-DP release work on MPS tensors (their
    float64 sums on the CPU), keep the tensors on MPS, and clip strictly to the bound."""
    device = torch.device("mps")
    g = torch.Generator().manual_seed(0)
    grads = {
        "adapter.weight": (torch.randn(5, 8, 8, generator=g) * 10).to(device),
        "head.weight": (torch.randn(5, 3, 8, generator=g) * 10).to(device),
    }
    clipped, norms = clip_per_example(grads, 1.0, 0.3)
    assert all(v.device.type == "mps" and v.dtype == torch.float32 for v in clipped.values())
    assert float(norms.min()) > 1.0  # every example was clipped
    assert bool((per_example_norms(clipped) <= 1.0).all())
    before = {"w": torch.zeros(1000, device=device)}
    after = {"w": torch.ones(1000, device=device)}
    released, norm = privatize(before, after, bound=0.5, std=0.0)
    assert released["w"].device.type == "mps"
    assert norm == pytest.approx(math.sqrt(1000)) and flat_norm(released) <= 0.5


def test_z_delta_formula_and_its_domain() -> None:
    assert update_noise_multiplier(0.1, 0.1) == pytest.approx((0.1**-2 - 0.2**-2) ** -0.5)
    assert update_noise_multiplier(0.1, 0.15) == pytest.approx((0.1**-2 - 0.3**-2) ** -0.5)
    assert update_noise_multiplier(0.0, 0.1) == 0.0
    with pytest.raises(ValueError, match=r"z < 2·σ_b = 0.2, got z = 0.2"):
        update_noise_multiplier(0.2, 0.1)


def test_geometric_rule_moves_the_bound_by_the_noised_indicator() -> None:
    eta, gamma, sigma_b = 0.2, 0.9, 0.1  # σ_b = m/20 with m = 2
    zero = {"w": torch.zeros(4, dtype=torch.float64)}
    p = client_privacy("adaptive", clip=1.0, noise_multiplier=0.1, generator=torch.Generator())
    expected = 1.0
    reference = torch.Generator()
    for server_round, norm in enumerate([2.0, 0.5, 3.0, 0.01], start=1):
        seed = 100 + server_round
        p.generator.manual_seed(seed)  # type: ignore[union-attr]
        reference.manual_seed(seed)
        after = {"w": torch.tensor([norm, 0.0, 0.0, 0.0], dtype=torch.float64)}
        p.release(zero, after, server_round=server_round)
        torch.randn(4, generator=reference, dtype=torch.float64)  # the update's noise first
        noise = float(torch.randn(1, generator=reference, dtype=torch.float64)) * sigma_b
        b = 1.0 if norm <= expected else 0.0
        expected *= math.exp(-eta * (b + noise - gamma))
        assert p.state.clip == pytest.approx(expected, rel=1e-12)
    assert geometric_clip(2.0, 1.0, lr=0.5, target=0.5) == pytest.approx(2.0 * math.exp(-0.25))


# A noisier indicator keeps the unclipped fraction at γ but lets C wander further around the
# quantile (and above it: the fraction is flat there), hence the looser bound on C for σ_b = 0.5.
@pytest.mark.parametrize(("sigma_b", "c_tolerance"), [(0.1, 0.1), (0.5, 0.3)])
def test_geometric_bound_tracks_the_target_quantile(sigma_b: float, c_tolerance: float) -> None:
    # Log-normal update norms whose scale triples halfway: C must find γ's quantile both times.
    gamma, eta, steps = 0.9, 0.2, 3000
    g = torch.Generator().manual_seed(0)
    p = client_privacy(
        "adaptive",
        clip=0.05,
        noise_multiplier=0.1,
        count_noise=sigma_b,
        target_quantile=gamma,
        clip_lr=eta,
        generator=g,
    )
    zero = {"w": torch.zeros(1, dtype=torch.float64)}
    norms = torch.exp(0.5 * torch.randn(2 * steps, generator=g, dtype=torch.float64))
    norms[steps:] *= 3.0
    bounds, unclipped = [], []
    for r, norm in enumerate(norms.tolist(), start=1):
        bounds.append(p.state.clip)
        unclipped.append(norm <= p.state.clip)
        p.release(zero, {"w": torch.tensor([norm], dtype=torch.float64)}, server_round=r)
    quantile = math.exp(0.5 * 1.2815516)  # γ = 0.9 quantile of exp(N(0, 0.25))
    for start, scale in ((steps // 2, 1.0), (steps + steps // 2, 3.0)):
        window = slice(start, start + steps // 2)
        fraction = sum(unclipped[window]) / len(unclipped[window])
        typical = math.exp(sum(math.log(c) for c in bounds[window]) / len(bounds[window]))
        assert fraction == pytest.approx(gamma, abs=0.03)
        assert typical == pytest.approx(scale * quantile, rel=c_tolerance)


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_linear_rule_follows_the_paper_on_scripted_norms_and_is_not_private(
    decay: float, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    beta, gamma, c0 = 0.05, 0.9, 1.0
    p = client_privacy(
        "adaptive",
        clip=c0,
        noise_multiplier=0.1,
        adaptive_rule="linear",
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
    assert math.isinf(p.metrics()["dp-epsilon"])
    assert "adaptive_rule=linear" in caplog.text and "not differentially private" in caplog.text
    assert smoothed_norm(None, 2.0, 0.9) == 2.0
    assert linear_clip(1.0, 2.0, rate=0.5, target=1.0) == 1.5


def test_bound_noise_rule_is_the_papers_and_not_private() -> None:
    p = client_privacy("adaptive", clip=2.0, noise_multiplier=0.1, noise_rule="bound")
    assert p.z_delta is not None
    expected = math.sqrt(2 * p.z_delta**2 * (0.95**2 * 4.0 + 0.05**2 * 0.81 * 9.0))
    assert p.noise_std(3.0) == pytest.approx(expected)
    assert bound_noise_std(1.0, 1.0, 0.0, rate=0.0, target=1.0) == pytest.approx(math.sqrt(2))
    zero = {"w": torch.zeros(3)}
    p.release(zero, zero, server_round=1)
    assert math.isinf(p.metrics()["dp-epsilon"])


@pytest.mark.parametrize(("clients", "z", "releases"), [(2, 0.1, 5), (10, 0.5, 20), (20, 1.0, 3)])
def test_adaptive_epsilon_is_the_composition_of_update_and_indicator(
    clients: int, z: float, releases: int
) -> None:
    p = client_privacy("adaptive", clients=clients, clip=0.7, noise_multiplier=z)
    zero = {"w": torch.zeros(3)}
    for r in range(1, releases + 1):
        p.release(zero, zero, server_round=r)
    assert p.z_delta is not None
    sigma_b = clients / 20
    # Per round two Gaussian releases: the update (std z_Δ·C, sensitivity 2C) and the
    # clipped-indicator (std σ_b, sensitivity 1), composed explicitly by dp-accounting.
    one_round = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(p.z_delta / 2), dp_accounting.GaussianDpEvent(sigma_b)]
    )
    explicit = pld_epsilon(dp_accounting.SelfComposedDpEvent(one_round, releases))
    assert p.metrics()["dp-epsilon"] == pytest.approx(explicit, rel=1e-3)
    # ... which is what the z_Δ formula promises: one Gaussian of multiplier z/2.
    assert combined_multiplier(p.z_delta / 2, indicator_multiplier(sigma_b)) == pytest.approx(z / 2)
    assert p.metrics()["dp-epsilon"] == pytest.approx(epsilon({z / 2: releases}, 1e-5), rel=1e-6)


def test_huge_clip_and_zero_noise_give_back_the_update_exactly() -> None:
    before = {"w": torch.tensor([0.1, 0.2, 0.3])}
    after = {"w": torch.tensor([0.3, -0.7, 1e-8])}
    released, _ = privatize(before, after, bound=math.inf, std=0.0)
    assert torch.equal(released["w"], after["w"])


def pld_epsilon(event: dp_accounting.DpEvent) -> float:
    """dp-accounting's own PLD figure (client-level: add-or-remove, sensitivity 1), finely
    discretised as car-fl's own PLD: the exact analytic Gaussian is at most this, within 0.1 %."""
    from dp_accounting import pld

    accountant = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3
    )
    accountant.compose(event)
    return float(accountant.get_epsilon(1e-5))


def test_one_release_epsilon_matches_dp_accounting_and_grows() -> None:
    one = epsilon({0.5: 1}, 1e-5)
    assert one == pytest.approx(pld_epsilon(dp_accounting.GaussianDpEvent(0.5)), rel=1e-3)
    five = pld_epsilon(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 5))
    assert epsilon({0.5: 5}, 1e-5) == pytest.approx(five, rel=1e-3)
    # Flower 1.39's RDP test vector for the same releases (ε ≈ 30.127) is a looser bound.
    rdp = RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 5))
    assert rdp.get_epsilon(1e-5) == pytest.approx(30.127, abs=1e-3)
    assert epsilon({0.5: 5}, 1e-5) < 30.127
    eps = [epsilon({0.5: k}, 1e-5) for k in range(1, 6)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert release_multiplier(noise_std=0.3, clip_bound=1.5) == pytest.approx(0.1)
    assert epsilon({}, 1e-5) == 0.0 and math.isinf(epsilon({0.0: 1}, 1e-5))


@pytest.mark.parametrize(("target", "rounds"), [(1.0, 5), (8.0, 50)])
def test_calibrated_noise_multiplier_spends_the_target_epsilon(target: float, rounds: int) -> None:
    noise_multiplier_for = load_script("dp_noise_table").noise_multiplier_for
    sigma = noise_multiplier_for(target, releases=rounds, delta=1e-5)
    assert epsilon({sigma / 2: rounds}, 1e-5) == pytest.approx(target, rel=1e-4)
    assert epsilon({sigma / 2: rounds}, 1e-5) <= target
    assert epsilon({0.99 * sigma / 2: rounds}, 1e-5) > target


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dp=fixed dp.clip=0", r"dp.clip \(the clipping bound C\) must be > 0"),
        ("dp=fixed dp.clip=-1", r"dp.clip .* must be > 0"),
        ("dp=fixed dp.noise_multiplier=-0.1", r"dp.noise_multiplier must be >= 0"),
        ("dp=adaptive dp.update_rate=1.0", r"dp.update_rate \(β\) must be in \[0, 1\)"),
        ("dp=adaptive dp.update_rate=-0.1", r"dp.update_rate \(β\) must be in \[0, 1\)"),
        ("dp=adaptive dp.target_quantile=0", r"dp.target_quantile \(γ\) must be > 0"),
        ("dp=adaptive dp.noise_multiplier=0.2", r"z < 2·σ_b = 0.2 \(σ_b = m/20 with m = fl.c"),
        ("dp=adaptive fl.clients=3 dp.noise_multiplier=0.35", r"m = fl.clients = 3\), got z"),
        ("dp=adaptive dp.count_noise=0.1 dp.noise_multiplier=0.3", r"dp.count_noise above 0.15"),
        ("dp=adaptive dp.count_noise=0", r"dp.count_noise \(σ_b\) must be > 0"),
        ("dp=adaptive dp.clip_lr=0", r"dp.clip_lr \(η_C\) must be > 0"),
        ("dp=adaptive dp.adaptive_rule=quantile", r"dp.adaptive_rule='quantile' is not valid"),
        ("dp=adaptive dp.ema_decay=0.9", r"linear rule only; set dp.ema_decay=0"),
        ("dp=fixed dp.delta=0", r"dp.delta must be in \(0, 1\)"),
        ("dp=fixed dp.delta=1", r"dp.delta must be in \(0, 1\)"),
        ("dp=fixed dp.granularity=epoch", r"dp.granularity='epoch' is not valid"),
        ("dp=laplace", r"dp=laplace is not an option of dp;.*choose one of adaptive, fixed, none"),
    ],
)
def test_impossible_dp_parameters_are_rejected_at_start(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)


# ------------------------------------------------------------------ through the client's round
