"""scripts/tune_dpsgd.py: its clients run the client's own round (``train_shard``), with each
client's DP state kept across rounds, and FedAvg over them (tiny model, synthetic data)."""

from __future__ import annotations

import math

import pytest
import torch

from car_fl.client.record_dp import load_record_state
from car_fl.settings.dp_plan import record_plan
from tests.helpers import load_script


@pytest.mark.slow
def test_each_client_round_is_train_shard_with_its_dp_state_across_rounds(
    make_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = load_script("tune_dpsgd")
    settings = make_settings(
        "dp=record", "dp.target_epsilon=3", "fl.rounds=2", "fl.local_epochs=1", "fl.clients=2"
    )
    features, val, label_map, origin = script.train_validation(settings)
    assert "validation" in origin and len(val) > 0
    parts = script.shards(features, label_map, settings, 2)
    assert sum(p.examples for p in parts) == len(features)
    calls: list[tuple[int, int, int]] = []  # (client, round, DP-SGD steps taken before it)
    real = script.train_shard

    def spy(settings, node, shard, global_state, server_round, node_state, **kw):
        calls.append((node.partition_id, server_round, load_record_state(node_state).steps))
        return real(settings, node, shard, global_state, server_round, node_state, **kw)

    monkeypatch.setattr(script, "train_shard", spy)
    result = script.fedavg(settings, parts, val)
    per_round = record_plan(settings).steps_per_round
    assert calls == [(0, 1, 0), (1, 1, 0), (0, 2, per_round), (1, 2, per_round)]
    assert 0.0 <= result["top1"] <= 1.0
    assert result["sigma"] == record_plan(settings).noise_multiplier > 0
    assert 0 < result["epsilon"] <= 3.0 + 1e-9 and math.isfinite(result["epsilon"])
    # The non-private reference (paper settings) takes the same path with dp=none
    calls.clear()
    plain = make_settings("fl.rounds=1", "fl.local_epochs=1", "fl.clients=2")
    reference = script.fedavg(plain, parts, val)
    assert [c[:2] for c in calls] == [(0, 1), (1, 1)]
    assert reference["sigma"] == 0.0 and reference["epsilon"] == math.inf


def test_draws_rerun_a_setting_with_the_same_shuffles_and_report_their_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--draws: every draw starts from seed 0 (the same shuffles; the DP noise is OS entropy,
    fresh each time: tests/privacy) and the setting's top-1 is the draws' mean, not their best."""
    script = load_script("tune_dpsgd")
    scores = iter([0.9, 0.7, 0.8])
    seen: list[float] = []

    def fake_fedavg(settings, parts, val):
        seen.append(float(torch.rand(1)))  # what the run's shuffles would draw first
        return {"top1": next(scores), "macro_f1": 0.5, "sigma": 1.0, "epsilon": 3.0}

    monkeypatch.setattr(script, "fedavg", fake_fedavg)
    row = script.mean_of_draws(None, [], None, 3)
    assert row["top1_draws"] == [0.9, 0.7, 0.8]
    assert row["top1"] == pytest.approx(0.8) and row["macro_f1"] == pytest.approx(0.5)
    assert len(seen) == 3 and len(set(seen)) == 1  # each draw from the same seed
    assert script.spread(row["top1_draws"]) == " [0.7000-0.9000]"  # printed beside the mean
    assert script.spread([0.9]) == ""  # one draw: no range to show
