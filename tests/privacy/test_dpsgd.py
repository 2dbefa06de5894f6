"""Record-level DP (DP-SGD): clipping, reference equality, noise, sampling, accounting, budget."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import pld
from hypothesis import given, settings
from hypothesis import strategies as st

from car_fl.data.splits import load_splits
from car_fl.model.features import LocalData
from car_fl.model.retriever import build_retriever
from car_fl.privacy.accountant import VALUE_DISCRETIZATION
from car_fl.privacy.dpsgd import (
    clipped_gradient_sum,
    dpsgd_step,
    noisy_gradient,
    per_example_gradients,
    poisson_sample,
)
from car_fl.privacy.mechanism import clip_per_example, per_example_norms, record_part_bounds
from car_fl.privacy.record_accounting import (
    calibrate_noise_multiplier,
    epsilon,
    steps_per_epoch,
    trained_cap,
)
from car_fl.settings.compose import load_settings
from car_fl.settings.dp_plan import record_plan
from car_fl.training.train import epoch_order, make_optimizer, train_epoch, train_epoch_dpsgd
from tests.reference import token_gradients


def dp_accounting_epsilon(
    q: float, sigma: float, steps: int, delta: float, accountant: object
) -> float:
    """ε straight from dp-accounting: the reference the module must agree with."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    accountant.compose(event)  # type: ignore[attr-defined]
    return float(accountant.get_epsilon(delta))  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ clipping


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(0, 12),
    shapes=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=3),
    scale=st.floats(1e-6, 1e6),
    bound=st.floats(1e-4, 1e4),
    seed=st.integers(0, 2**31),
)
def test_every_clipped_per_example_gradient_has_norm_at_most_c(
    batch: int, shapes: list[list[int]], scale: float, bound: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    grads = {
        f"t{i}": torch.randn((batch, *s), generator=g, dtype=torch.float64) * scale
        for i, s in enumerate(shapes)
    }
    clipped, norms = clip_per_example(grads, bound)
    after = per_example_norms(clipped)
    assert after.shape == (batch,)
    assert bool((after <= bound).all())  # strictly: SHRINK covers the rounding
    small = norms <= bound  # examples within the bound are left exactly as they were
    for name, tensor in grads.items():
        assert torch.equal(clipped[name][small], tensor[small])


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(0, 12),
    scale=st.floats(1e-6, 1e6),
    share=st.floats(1e-3, 0.999),
    bound=st.floats(1e-4, 1e4),
    seed=st.integers(0, 2**31),
)
def test_per_part_clipping_keeps_each_part_and_the_whole_within_their_bounds(
    batch: int, scale: float, share: float, bound: float, seed: int
) -> None:
    """dp.adapter_clip under dp=record: the adapter's part ≤ C_a, the head's ≤ √(C² − C_a²),
    so the whole ≤ C, the sensitivity the noise and ε are computed for."""
    g = torch.Generator().manual_seed(seed)
    grads = {
        "adapter.weight": torch.randn((batch, 4, 4), generator=g, dtype=torch.float64) * scale,
        "head.weight": torch.randn((batch, 3, 4), generator=g, dtype=torch.float64) * scale,
        "head.bias": torch.randn((batch, 3), generator=g, dtype=torch.float64) * scale,
    }
    adapter_bound = bound * share
    clipped, norms = clip_per_example(grads, bound, adapter_bound)
    adapter = clipped["adapter.weight"].flatten(1).norm(dim=1)
    head = torch.cat([clipped["head.weight"].flatten(1), clipped["head.bias"]], dim=1).norm(dim=1)
    assert bool((adapter <= adapter_bound).all())
    assert bool((head <= record_part_bounds(bound, adapter_bound)[1]).all())
    assert bool((per_example_norms(clipped) <= bound).all())
    torch.testing.assert_close(norms, per_example_norms(grads))  # the norms before clipping
    small = grads["adapter.weight"].flatten(1).norm(dim=1) <= adapter_bound
    assert torch.equal(clipped["adapter.weight"][small], grads["adapter.weight"][small])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_gradients_are_clipped_to_at_most_c_not_about_c(dtype: torch.dtype) -> None:
    """The sensitivity is C, not C plus rounding: a bf16 row scaled in bf16 lands up to ~0.5 %
    above C, so rows are scaled in float32 and to C·SHRINK."""
    g = torch.Generator().manual_seed(3)
    grads = {
        "adapter.weight": (torch.randn((400, 8, 8), generator=g) * 3).to(dtype),
        "head.weight": (torch.randn((400, 5, 8), generator=g) * 3).to(dtype),
    }
    for adapter_bound in (None, 0.3):
        clipped, norms = clip_per_example(grads, 1.0, adapter_bound)
        assert bool((norms > 1.0).all())  # every row was clipped
        assert all(t.dtype in (torch.float32, torch.float64) for t in clipped.values())
        assert float(per_example_norms(clipped).max()) <= 1.0
        assert float(per_example_norms(clipped).min()) > 1.0 - 1e-3  # clipped, not shrunk
        if adapter_bound is not None:
            adapter = clipped["adapter.weight"].double().flatten(1).norm(dim=1)
            assert float(adapter.max()) <= adapter_bound


def test_per_part_clipping_gives_the_head_its_own_bound() -> None:
    """Why it exists: a large adapter gradient no longer scales the head's down with it."""
    grads = {
        "adapter.weight": torch.tensor([[[30.0, 40.0]]], dtype=torch.float64),  # norm 50
        "head.weight": torch.tensor([[0.6, 0.0]], dtype=torch.float64),  # norm 0.6
    }
    joint, _ = clip_per_example(grads, 1.0)
    parts, _ = clip_per_example(grads, 1.0, 0.1)
    assert float(joint["head.weight"].norm()) == pytest.approx(0.6 / math.hypot(50, 0.6))
    torch.testing.assert_close(parts["head.weight"], grads["head.weight"])  # 0.6 < √0.99
    assert float(parts["adapter.weight"].norm()) == pytest.approx(0.1)


def test_part_bounds_share_c_without_overflow() -> None:
    assert record_part_bounds(1.0, 0.6) == pytest.approx((0.6, 0.8))
    big = record_part_bounds(1e200, 6e199)  # C² would overflow to inf
    assert big[1] == pytest.approx(8e199) and math.isfinite(big[1])
    with pytest.raises(ValueError, match="not in"):
        record_part_bounds(1.0, 1.0)


def test_without_an_adapter_the_adapter_bound_leaves_joint_clipping(make_settings) -> None:
    """Classifier mode has no adapter tensor: one bound C over the head, as local DP does."""
    model = build_retriever(make_settings(), 3, hidden_size=6).double()
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    features, labels = torch.randn(5, 6, dtype=torch.float64) * 50, torch.tensor([0, 1, 2, 0, 1])
    joint, _, _ = clipped_gradient_sum(model, params, labels, clip=0.5, features=features)
    split, _, _ = clipped_gradient_sum(
        model, params, labels, clip=0.5, adapter_clip=0.05, features=features
    )
    for name in joint:
        assert torch.equal(split[name], joint[name])


def test_clipping_real_per_example_gradients_of_the_head(make_settings) -> None:
    s = make_settings("head.pre_classifier_dim=8")
    model = build_retriever(s, 4, hidden_size=16)
    features = torch.randn(32, 16) * 50
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    grads, _, _ = per_example_gradients(
        model, params, torch.randint(0, 4, (32,)), features=features
    )
    clipped, norms = clip_per_example(grads, 0.1)
    assert bool((norms > 0.1).any())
    assert bool((per_example_norms(clipped) <= 0.1 * (1 + 1e-6)).all())


@pytest.mark.parametrize("loop", [False, True])
def test_an_example_with_a_non_finite_gradient_adds_zero_on_either_path(
    make_settings, monkeypatch: pytest.MonkeyPatch, loop: bool
) -> None:
    # A server can craft global weights so that chosen inputs overflow; that one example
    # must neither poison the clipped sum nor make the round fail (both tell the server)
    model = build_retriever(make_settings(), 3, hidden_size=6).double()
    if loop:  # the one-example-at-a-time path (adapter mode, routed mixtures)
        monkeypatch.setattr(type(model), "per_example_loop", property(lambda _self: True))
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    features = torch.randn(4, 6, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0])
    clean, _, _ = clipped_gradient_sum(model, params, labels[1:], clip=0.5, features=features[1:])
    features[0, 0] = math.nan
    total, _, _ = clipped_gradient_sum(model, params, labels, clip=0.5, features=features)
    for name, value in clean.items():
        assert torch.isfinite(total[name]).all(), name
        torch.testing.assert_close(total[name], value)


# ------------------------------------------------------------- per-example gradients are right


def test_vmap_per_example_gradients_equal_one_backward_per_example(make_settings) -> None:
    model = build_retriever(make_settings("head.pre_classifier_dim=8"), 3, hidden_size=10)
    model.double()
    x, y = torch.randn(6, 10, dtype=torch.float64), torch.tensor([0, 1, 2, 2, 1, 0])
    params = dict(model.trainable_parameters())
    grads, losses, _ = per_example_gradients(
        model, {k: p.detach() for k, p in params.items()}, y, features=x
    )
    for i in range(6):
        loss = F.cross_entropy(model.score(x[i : i + 1]), y[i : i + 1])
        reference = torch.autograd.grad(loss, list(params.values()))
        assert float(losses[i]) == pytest.approx(float(loss.detach()))
        for name, ref in zip(params, reference, strict=True):
            torch.testing.assert_close(grads[name][i], ref, rtol=1e-12, atol=1e-12)


def test_the_reference_token_gradients_through_the_frozen_encoder(make_settings) -> None:
    # The definition test_ghost.py checks DP-SGD's batched paths against.
    s = make_settings("mode=adapter")
    splits = load_splits(s.dataset, seed=s.seed)
    model = build_retriever(s, len(splits.label_map))
    texts, labels = splits.train["text"][:3], torch.tensor(splits.train["label"][:3])
    ids = [torch.tensor(t) for t in model.encoder.tokenize(texts).input_ids]
    params = dict(model.trainable_parameters())
    grads, _, _ = token_gradients(model, {k: p.detach() for k, p in params.items()}, labels, ids)
    assert set(grads) == set(params) and "adapter.weight" in grads
    for i in range(3):
        one = ids[i][None]
        _, loss = model(one, torch.ones_like(one), labels=labels[i : i + 1])
        assert loss is not None
        reference = torch.autograd.grad(loss, list(params.values()))
        for name, ref in zip(params, reference, strict=True):
            torch.testing.assert_close(grads[name][i], ref)
    assert not any(p.requires_grad for p in model.encoder.model.parameters())


# ------------------------------------------------- C = ∞ and σ = 0 is non-private training


def test_infinite_clip_and_zero_noise_equal_non_private_training(make_settings) -> None:
    """Same batches, same optimiser: DP-SGD with C = ∞, σ = 0 is plain mini-batch training."""
    s = make_settings("head.pre_classifier_dim=8", "train.optimizer=adamw", "train.lr=0.01")
    n, batch = 96, 8
    g = torch.Generator().manual_seed(3)
    data = LocalData(
        labels=torch.randint(0, 4, (n,), generator=g),
        features=torch.randn(n, 12, generator=g, dtype=torch.float64),
    )
    plain = build_retriever(s, 4, hidden_size=12).double()
    private = build_retriever(s, 4, hidden_size=12).double()
    opt_plain, opt_private = make_optimizer(plain, s.train), make_optimizer(private, s.train)
    for epoch in range(3):
        train_epoch(plain, data, opt_plain, batch_size=batch, seed=1, epoch=epoch, progress=False)
        order = epoch_order(n, seed=1, epoch=epoch)
        train_epoch_dpsgd(
            private,
            data,
            opt_private,
            sample_rate=batch / n,  # q·n = the fixed batch size: the same normalisation
            clip=math.inf,
            noise_multiplier=0.0,
            steps=n // batch,
            seed=1,
            epoch=epoch,
            batches=[order[i : i + batch] for i in range(0, n, batch)],
            progress=False,
        )
    for name, value in plain.trainable_state_dict().items():
        torch.testing.assert_close(
            private.trainable_state_dict()[name], value, rtol=1e-12, atol=1e-12
        )


# ------------------------------------------------------------------- noise and sampling


def test_noise_has_std_sigma_c_over_expected_batch_and_is_not_reproducible() -> None:
    zeros = {"w": torch.zeros(200_000), "b": torch.zeros(3)}
    noisy = noisy_gradient(zeros, noise_std=1.5 * 2.0, expected_batch_size=10.0)
    assert float(noisy["w"].std()) == pytest.approx(1.5 * 2.0 / 10.0, rel=0.02)
    again = noisy_gradient(zeros, noise_std=3.0, expected_batch_size=10.0)
    assert not torch.equal(noisy["w"], again["w"])  # OS entropy: no seed can regenerate it


def test_a_dpsgd_step_adds_exactly_the_seeded_noise_to_the_clipped_sum(make_settings) -> None:
    model = build_retriever(make_settings(), 3, hidden_size=5).double()
    params = model.trainable_parameters()
    before = {k: p.detach().clone() for k, p in params.items()}
    x, y = torch.randn(4, 5, dtype=torch.float64) * 100, torch.tensor([0, 1, 2, 0])
    grads, _, _ = per_example_gradients(model, before, y, features=x)
    clipped, _ = clip_per_example(grads, 0.5)
    expected = noisy_gradient(
        {k: v.sum(0) for k, v in clipped.items()},
        noise_std=0.5 * 0.7,
        expected_batch_size=4.0,
        generator=torch.Generator().manual_seed(9),
    )
    optimizer = torch.optim.SGD(list(params.values()), lr=1.0)
    dpsgd_step(
        model,
        params,
        optimizer,
        y,
        clip=0.5,
        noise_multiplier=0.7,
        expected_batch_size=4.0,
        features=x,
        generator=torch.Generator().manual_seed(9),
    )
    for name, param in params.items():
        torch.testing.assert_close(param.detach(), before[name] - expected[name])


def test_poisson_sampling_rate_and_empty_batches() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [len(poisson_sample(1000, 0.05, generator=g)) for _ in range(400)]
    mean = sum(sizes) / len(sizes)
    assert mean == pytest.approx(50, abs=3 * math.sqrt(1000 * 0.05 * 0.95 / 400) + 0.5)
    assert len(poisson_sample(1000, 1.0, generator=g)) == 1000
    assert len(poisson_sample(3, 1e-9, generator=g)) == 0
    a, b = poisson_sample(2000, 0.5), poisson_sample(2000, 0.5)
    assert not torch.equal(a, b)  # OS entropy by default


def test_an_empty_sampled_batch_still_makes_a_noisy_step(make_settings) -> None:
    model = build_retriever(make_settings(), 3, hidden_size=5)
    params = model.trainable_parameters()
    before = {k: p.detach().clone() for k, p in params.items()}
    optimizer = torch.optim.SGD(list(params.values()), lr=1.0)
    result = dpsgd_step(
        model,
        params,
        optimizer,
        torch.zeros(0, dtype=torch.long),
        clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        features=torch.zeros(0, 5),
    )
    assert result.examples == 0
    assert all(not torch.equal(p.detach(), before[k]) for k, p in params.items())


# ------------------------------------------------------------------------------ accounting


@pytest.mark.slow
def test_epsilon_of_a_known_configuration_equals_dp_accounting() -> None:
    q, sigma, steps, delta = 64 / 2000, 1.0, 625, 1e-5
    replace_one = dp_accounting.NeighboringRelation.REPLACE_ONE
    ours = epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta)
    same = dp_accounting_epsilon(
        q,
        sigma,
        steps,
        delta,
        pld.PLDAccountant(replace_one, value_discretization_interval=VALUE_DISCRETIZATION),
    )
    assert ours == same
    default_pld = dp_accounting_epsilon(q, sigma, steps, delta, pld.PLDAccountant(replace_one))
    assert ours == pytest.approx(default_pld, rel=1e-3)
    assert ours == pytest.approx(8.19, abs=0.01)
    # n travels un-noised, so the relation is replace-one: larger than add-or-remove's 5.15
    add_or_remove = dp_accounting_epsilon(q, sigma, steps, delta, pld.PLDAccountant())
    assert add_or_remove == pytest.approx(5.15, abs=0.01)  # docs/notes value, add-or-remove
    assert ours > 1.5 * add_or_remove


@pytest.mark.parametrize(
    ("target", "q", "steps"), [(1.0, 0.05, 200), (3.0, 0.1, 100), (8.0, 0.1, 100)]
)
@pytest.mark.slow
def test_calibrated_sigma_reaches_the_target_within_one_percent(
    target: float, q: float, steps: int
) -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, sample_rate=q, steps=steps, delta=1e-5
    )
    replace_one = dp_accounting.NeighboringRelation.REPLACE_ONE
    reached = dp_accounting_epsilon(q, sigma, steps, 1e-5, pld.PLDAccountant(replace_one))
    assert target * 0.99 <= reached <= target * 1.001
    assert epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=1e-5) <= target


def test_plan_calibrates_for_rounds_times_epochs_times_steps_per_epoch() -> None:
    s = load_settings(
        "dp=record dp.target_epsilon=2 dp.sample_rate=0.1 fl.rounds=3 fl.local_epochs=2"
    )
    plan = record_plan(s)
    assert steps_per_epoch(0.1) == 10 and steps_per_epoch(0.3) == 4 and steps_per_epoch(1) == 1
    assert plan.steps_per_round == 20 and plan.planned_steps == 60
    assert plan.noise_multiplier == calibrate_noise_multiplier(
        target_epsilon=2.0, sample_rate=0.1, steps=60, delta=1e-5
    )
    fixed = load_settings("dp=record dp.target_epsilon=null dp.noise_multiplier=1.3")
    assert record_plan(fixed).noise_multiplier == 1.3


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dp=record dp.sample_rate=0", r"dp.sample_rate \(q.*\) must be in \(0, 1\], got 0.*0.05"),
        ("dp=record dp.sample_rate=1.5", r"dp.sample_rate .* got 1.5"),
        (
            "dp=record dp.target_epsilon=null dp.noise_multiplier=0",
            r"dp=record needs dp.noise_multiplier \(σ\) > 0, got 0.0; set e.g. dp.noise_multip",
        ),
        ("dp=record dp.target_epsilon=null dp.noise_multiplier=-1", r"noise_multiplier"),
        ("dp=record dp.warmup_rounds=1", r"dp.warmup_rounds must be 0"),
        (  # a server cannot raise a record's sensitivity above dp.clip through the adapter
            "dp=record dp.clip=1 dp.adapter_clip=1",
            r"dp.adapter_clip=1 under dp=record must be below dp.clip=1.*dp.adapter_clip=0.1",
        ),
        ("dp=record dp.clip=0.5 dp.adapter_clip=3", r"dp.adapter_clip=3 .* below dp.clip=0.5"),
        (  # local DP's noise split: under dp=record it would be silently ignored
            "dp=record dp.adapter_clip=0.1 dp.adapter_share=0.1",
            r"dp.adapter_share=0.1 splits local DP's noise .* remove dp.adapter_share",
        ),
        (
            "dp=record dp.target_epsilon=0.01 dp.sample_rate=1 fl.rounds=50",
            r"dp.target_epsilon=0.01 cannot be reached in 100 planned DP-SGD steps.*"
            r"set dp.target_epsilon=",
        ),
    ],
)
def test_bad_record_parameters_fail_at_configuration_time(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)


def test_the_suggested_reachable_epsilon_works() -> None:
    with pytest.raises(ValueError) as err:
        load_settings("dp=record dp.target_epsilon=0.01 dp.sample_rate=1 fl.rounds=50")
    suggested = str(err.value).split("set dp.target_epsilon=")[1].split()[0]
    s = load_settings(f"dp=record dp.target_epsilon={suggested} dp.sample_rate=1 fl.rounds=50")
    assert record_plan(s).noise_multiplier <= 100


def test_the_trained_cap_keeps_delta_below_one_over_the_trained_n() -> None:
    assert trained_cap(1e-3) == 999 and trained_cap(1e-5) == 99_999 and trained_cap(0.7) == 1
    for delta in (1e-3, 3e-4, 0.01, 0.3):
        assert delta < 1 / trained_cap(delta) and not delta < 1 / (trained_cap(delta) + 1)
    with pytest.raises(ValueError, match=r"dp\.delta"):
        trained_cap(1.0)


# ------------------------------------------------------------------- through a client's round
