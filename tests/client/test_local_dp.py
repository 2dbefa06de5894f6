"""car_fl.client.local_dp: a client's local DP: releases, ε, target, state, warm-up."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import RecordDict

from car_fl.client.failures import RunTargetReached
from car_fl.client.local_dp import (
    ClientPrivacy,
    DPState,
    load_privacy,
)
from car_fl.client.node import Node
from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.privacy.accountant import (
    Accountant,
    Release,
    ReleaseKind,
    combined_multiplier,
    epsilon,
)
from car_fl.privacy.mechanism import flat_norm, privatize
from car_fl.settings.compose import NodeInfo, load_settings
from car_fl.settings.schema import Settings
from tests.helpers import client_privacy


def test_client_reports_epsilon_of_its_releases() -> None:
    p = client_privacy("fixed", clip=1.0, noise_multiplier=1.0)  # multiplier 1 / 2 = 0.5
    zero = {"w": torch.zeros(3)}
    for r in range(1, 4):
        p.release(zero, zero, server_round=r)
    assert p.metrics()["dp-epsilon"] == pytest.approx(epsilon({0.5: 3}, 1e-5))
    assert p.metrics()["dp-releases"] == 3


def test_target_epsilon_stops_a_client_before_it_overspends() -> None:
    p = client_privacy(
        "fixed", clip=1.0, noise_multiplier=1.0, target_epsilon=epsilon({0.5: 2}, 1e-5) + 1e-9
    )
    zero = {"w": torch.zeros(3)}
    p.release(zero, zero, server_round=1)
    p.release(zero, zero, server_round=2)
    with pytest.raises(RunTargetReached, match=r"client 0 stops contributing.*target"):
        p.release(zero, zero, server_round=3)
    assert sum(p.state.releases.values()) == 2


def test_a_non_finite_update_is_released_as_a_zero_update_not_a_failure() -> None:
    # Failing the round would tell the server something about the data: under DP the client
    # releases θ plus noise instead (a zero update is within any bound), and says so in its log.
    p = client_privacy(
        "fixed", clip=1.0, noise_multiplier=0.1, generator=torch.Generator().manual_seed(7)
    )
    before = {"head.classifier.weight": torch.zeros(2), "head.classifier.bias": torch.zeros(1)}
    after = {
        "head.classifier.weight": torch.tensor([1.0, float("nan")]),
        "head.classifier.bias": torch.zeros(1),
    }
    released = p.release(before, after, server_round=1)
    expected, _ = privatize(
        before, before, bound=1.0, std=0.1, generator=torch.Generator().manual_seed(7)
    )
    assert all(torch.equal(released[k], expected[k]) for k in before)
    assert all(bool(torch.isfinite(v).all()) for v in released.values())
    assert p.state.releases == {0.05: 1}  # σ₀/2: it is a release like any other


def test_dp_state_round_trips_through_a_flower_record() -> None:
    history = [Release(ReleaseKind.GAUSSIAN, 3, 0.05), Release(ReleaseKind.GAUSSIAN, 2, 0.1)]
    state = DPState(clip=0.7, ema=1.25, accountant=Accountant(history))
    assert state.releases == {0.05: 3, 0.1: 2}
    assert DPState.from_record(state.to_record()) == state
    assert DPState.from_record(DPState(clip=1.0).to_record()) == DPState(clip=1.0)


@pytest.fixture
def round_inputs(make_settings):
    def make(*overrides: str):
        s = make_settings("fl.local_epochs=1", *overrides)
        splits = load_splits(s.dataset, seed=s.seed)
        initial = build_retriever(s, len(splits.label_map)).trainable_state_dict()
        return s, NodeInfo(0, 2), initial

    return make


@pytest.mark.slow
@pytest.mark.parametrize("dp", ["fixed", "adaptive"])
@pytest.mark.parametrize("granularity", ["round", "step"])
def test_infinite_clip_and_zero_noise_reproduce_the_non_dp_round(
    round_inputs, dp: str, granularity: str
) -> None:
    s_none, node, initial = round_inputs("dp=none")
    s_dp, _, _ = round_inputs(
        f"dp={dp}", f"dp.granularity={granularity}", "dp.clip=inf", "dp.noise_multiplier=0"
    )
    plain, _ = Node(config={}).train(s_none, node, initial, 1, RecordDict())
    private, metrics = Node(config={}).train(s_dp, node, initial, 1, RecordDict())
    assert metrics["dp-active"] == 1 and math.isinf(metrics["dp-epsilon"])
    for name in plain:
        assert torch.equal(plain[name], private[name]), name


def test_warmup_rounds_add_no_noise_and_later_rounds_do(round_inputs) -> None:
    s_none, node, initial = round_inputs("dp=none")
    s_dp, _, _ = round_inputs("dp=adaptive", "dp.warmup_rounds=1", "dp.clip=1e30")
    state = RecordDict()
    for server_round in (1, 2):
        plain, _ = Node(config={}).train(s_none, node, initial, server_round, RecordDict())
        private, metrics = Node(config={}).train(s_dp, node, initial, server_round, state)
        same = all(torch.equal(plain[k], private[k]) for k in plain)
        assert same == (server_round == 1)
        assert metrics["dp-active"] == int(server_round == 2)
        assert (metrics["dp-epsilon"] > 0) == (server_round == 2)
        # Warm-up rounds send the raw parameters anyway; their train metrics add nothing.
        assert ("train-loss" in metrics) == (server_round == 1)


def test_adaptive_state_persists_in_the_node_state(round_inputs) -> None:
    s, node, initial = round_inputs("dp=adaptive")
    state = RecordDict()
    _, first = Node(config={}).train(s, node, initial, 1, state)
    after_first = load_privacy(s, node, state).state
    assert after_first.clip != s.dp.clip and sum(after_first.releases.values()) == 1
    _, second = Node(config={}).train(s, node, initial, 2, state)
    after_second = load_privacy(s, node, state).state
    assert after_second.clip != after_first.clip
    assert second["dp-releases"] == 2 and second["dp-epsilon"] > first["dp-epsilon"]


def test_step_granularity_clips_every_step(round_inputs) -> None:
    s, node, initial = round_inputs(
        "dp=fixed",
        "dp.granularity=step",
        "dp.clip=1e-3",
        "dp.noise_multiplier=0",
        "train.lr=0.5",
        "fl.max_examples_per_client=60",  # public: the round trains and accounts for 60
    )
    state, metrics = Node(config={}).train(s, node, initial, 1, RecordDict())
    assert metrics["num-examples"] == 60  # the public count, not the node's n
    steps = math.ceil(60 / s.train.batch_size)
    assert metrics["dp-releases"] == steps
    moved = flat_norm({k: state[k] - initial[k] for k in state})
    assert moved <= steps * 1e-3 * (1 + 1e-5)


def test_step_granularity_with_adaptive_clipping_adapts_every_step(round_inputs) -> None:
    s, node, initial = round_inputs(
        "dp=adaptive", "dp.granularity=step", "dp.clip=0.01", "fl.max_examples_per_client=60"
    )
    state = RecordDict()
    _, metrics = Node(config={}).train(s, node, initial, 1, state)
    steps = math.ceil(60 / s.train.batch_size)
    assert metrics["dp-releases"] == steps
    assert metrics["dp-epsilon"] == pytest.approx(epsilon({0.05: steps}, s.dp.delta), rel=1e-6)
    assert load_privacy(s, node, state).state.clip != pytest.approx(0.01)


def test_fixed_dp_clips_at_this_runs_clip_whatever_bound_an_earlier_state_kept() -> None:
    # A worker keeps a run's DP state on disk by run id; a server that reuses the id with a
    # tiny dp.clip must not get an update clipped at the old bound and noised at the new one
    p = client_privacy("fixed", clip=0.001, noise_multiplier=1e-6)
    p.state = DPState(clip=100.0)
    before = {"w": torch.zeros(1000)}
    after = {"w": torch.ones(1000)}  # norm 31.6
    released = p.release(before, after, server_round=1)
    assert float(flat_norm(released)) <= 0.001 * (1 + 1e-2)


# ----------------------------------------------------------------- the adapter's own bound
def _adapter_and_head(scale: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    before = {
        "adapter.weight": torch.eye(40),
        "head.classifier.weight": torch.zeros(2, 500),
        "head.classifier.bias": torch.zeros(2),
    }
    after = {k: v.clone() for k, v in before.items()}
    after["adapter.weight"] += scale  # a large adapter change
    after["head.classifier.weight"][0, 0] = 0.3  # a head change within its bound
    return before, after


def test_an_adapter_bound_clips_the_adapter_apart_from_the_head() -> None:
    p = client_privacy("fixed", clip=1.0, noise_multiplier=0.0, adapter_clip=0.01)
    before, after = _adapter_and_head(scale=1.0)
    released = p.release(before, after, server_round=1)
    adapter_change = released["adapter.weight"] - before["adapter.weight"]
    assert adapter_change.norm() == pytest.approx(0.01, rel=1e-5)  # clipped to its own bound
    # the head keeps its whole update: one joint bound would have scaled it by 1/40
    assert torch.equal(released["head.classifier.weight"], after["head.classifier.weight"])
    joint = client_privacy("fixed", clip=1.0, noise_multiplier=0.0)
    shrunk = joint.release(before, after, server_round=1)["head.classifier.weight"][0, 0]
    assert float(shrunk) < 0.3 / 30


def test_a_lowrank_adapters_two_tensors_are_clipped_together_as_the_adapters_part() -> None:
    """adapter.kind=lowrank sends U and V: dp.adapter_clip bounds them as one part (their joint
    norm), apart from the head, as it bounds the full adapter's one tensor."""
    p = client_privacy("fixed", clip=1.0, noise_multiplier=0.0, adapter_clip=0.01)
    before = {
        "adapter.up": torch.zeros(40, 4),
        "adapter.down": torch.ones(40, 4),
        "head.classifier.weight": torch.zeros(2, 500),
        "head.classifier.bias": torch.zeros(2),
    }
    after = {k: v.clone() for k, v in before.items()}
    after["adapter.up"] += 1.0
    after["adapter.down"] -= 1.0
    after["head.classifier.weight"][0, 0] = 0.3
    released = p.release(before, after, server_round=1)
    change = torch.cat(
        [(released[k] - before[k]).flatten() for k in ("adapter.up", "adapter.down")]
    )
    # clipped to 0.01 as one part (θ + Δ then rounds at V's 1.0: float32's ulp, rel ~1e-5)
    assert float(change.norm()) == pytest.approx(0.01, rel=1e-4)
    up = released["adapter.up"] - before["adapter.up"]
    down = released["adapter.down"] - before["adapter.down"]
    # one factor for the part: the direction is kept (θ + Δ rounds at 1 − f: float32's ulp)
    torch.testing.assert_close(up, -down, rtol=1e-3, atol=0)
    assert torch.equal(released["head.classifier.weight"], after["head.classifier.weight"])


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_each_part_gets_its_share_of_the_noise_and_epsilon_is_that_of_one_joint_release(
    mode: str,
) -> None:
    sigma, share, c_adapter = 0.4, 0.25, 0.02
    count_noise = 5.0 if mode == "adaptive" else None
    p = client_privacy(
        mode,
        clip=1.0,
        noise_multiplier=sigma,
        adapter_clip=c_adapter,
        adapter_share=share,
        generator=torch.Generator().manual_seed(3),
        count_noise=count_noise,
    )
    joint = client_privacy(mode, clip=1.0, noise_multiplier=sigma, count_noise=count_noise)
    before, _ = _adapter_and_head(scale=0.0)
    released = p.release(before, before, server_round=1)  # a zero update: noise alone
    z = sigma if mode == "fixed" else p.z_delta
    assert z is not None
    adapter_noise = (released["adapter.weight"] - before["adapter.weight"]).std()
    head_noise = (released["head.classifier.weight"] - before["head.classifier.weight"]).std()
    assert float(adapter_noise) == pytest.approx(z * c_adapter / math.sqrt(share), rel=0.05)
    assert float(head_noise) == pytest.approx(z * 1.0 / math.sqrt(1 - share), rel=0.05)
    # the two parts compose to the joint release's multiplier: the same ε, client and server
    parts = combined_multiplier(
        z / math.sqrt(share) / 2, z / math.sqrt(1 - share) / 2, *p_indicator(p, mode)
    )
    assert parts == pytest.approx(joint.release_multiplier, rel=1e-9)
    assert p.release_multiplier == joint.release_multiplier
    assert p.metrics()["dp-epsilon"] == pytest.approx(epsilon({joint.release_multiplier: 1}, 1e-5))


def p_indicator(p: ClientPrivacy, mode: str) -> tuple[float, ...]:
    """The adaptive rule's clipped-indicator release, composed with the update's parts."""
    from car_fl.privacy.accountant import indicator_multiplier

    return (indicator_multiplier(p.sigma_b),) if mode == "adaptive" else ()


def test_a_policy_caps_the_adapter_bound_as_it_caps_dp_clip() -> None:
    from car_fl.client.policy import NodePolicy
    from car_fl.settings.schema import DPMode

    policy = NodePolicy(modes=frozenset({DPMode.FIXED}), max_clip=0.5)
    settings = make_settings_for_policy("dp.adapter_clip=0.9")
    assert any(
        "dp.adapter_clip=0.9 is above max-clip 0.5" in f for f in policy.violations(settings)
    )
    assert not any("adapter_clip" in f for f in policy.violations(make_settings_for_policy()))


def make_settings_for_policy(*extra: str) -> Settings:

    return load_settings(["dp=fixed", "dp.noise_multiplier=1.0", "dp.clip=0.4", *extra])


def test_an_adapter_sent_alone_is_clipped_to_its_own_bound_with_the_whole_budget() -> None:
    p = client_privacy(
        "fixed",
        clip=1.0,
        noise_multiplier=0.5,
        adapter_clip=0.05,
        generator=torch.Generator().manual_seed(5),
    )
    before = {"adapter.weight": torch.eye(60)}
    released = p.release(before, {"adapter.weight": torch.eye(60) * 3}, server_round=1)
    noise = released["adapter.weight"] - before["adapter.weight"]
    assert float(noise.std()) == pytest.approx(0.5 * 0.05, rel=0.05)  # z·C_A, not z·dp.clip


@pytest.mark.slow
def test_per_step_dp_noises_every_accounted_step_so_the_update_size_does_not_tell_n(
    round_inputs,
) -> None:
    """The attacker's probe (issue 41, finding 3): per-step local DP with a public bound of
    1,000 examples and batch 1 accounts 1,000 releases whatever the shard holds. Before, only
    the steps made were noised, so ‖Δ‖²/(σ²C²d) estimated n (5.4, 28.3, 71.5, 138.8 for 6, 29,
    73 and 144 examples). Now every accounted step adds its noise: shards of 0, 1, 50 and all
    of them send updates of one scale and the same metrics."""
    from car_fl.client.round import Shard, shard_data, train_shard

    s, node, initial = round_inputs(
        "dp=fixed",
        "dp.granularity=step",
        "dp.clip=0.5",
        "dp.noise_multiplier=1.0",
        "fl.max_examples_per_client=1000",
        "train.batch_size=1",
    )
    whole = shard_data(s, node)
    dims = sum(t.numel() for t in initial.values())
    estimates, replies = [], []
    for size in (0, 1, 50, whole.examples):
        shard = Shard(whole.data.select(range(size)), whole.label_map, examples=size)
        state, metrics = train_shard(s, node, shard, initial, 1, RecordDict())
        squared = sum(float(((state[k] - initial[k]) ** 2).sum()) for k in initial)
        estimates.append(squared / (1.0**2 * 0.5**2 * dims))
        replies.append(metrics)
    assert all(reply == replies[0] for reply in replies), replies
    assert replies[0]["dp-releases"] == 1000
    # every shard's estimate is the accounted count (noise of 1,000 steps), not its size
    assert all(600 < e < 1600 for e in estimates), estimates  # chi-squared spread: few dims


def test_a_stored_bound_above_the_policys_ceiling_is_never_used() -> None:
    """Issue 41: an adaptive bound of 10⁶ read from a state file was used for one release
    before the rule clamped it to max-clip. It is clamped before the first release now."""
    from car_fl.settings.schema import DPConfig

    cfg = DPConfig(mode="adaptive", clip=0.5, noise_multiplier=0.1, count_noise=5.0)  # type: ignore[arg-type]
    for stored in (1e6, float("nan"), -1.0):
        p = ClientPrivacy(cfg, num_clients=2, client=0, state=DPState(clip=stored), max_clip=1.0)
        assert p.state.clip == (1.0 if stored == 1e6 else 0.5)
        assert p.noise_std(0.0) == pytest.approx(p.z_delta * p.state.clip)  # type: ignore[operator]
