"""Every adapter kind through a real federation: what travels, and its bytes measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from car_fl.simulation.in_process import run_local


@pytest.mark.slow
def test_a_lowrank_round_sends_a_fraction_of_the_full_adapters_bytes(
    make_settings, tmp_path: Path
) -> None:
    """The server's own count of each reply's bytes: the low-rank adapter (r = 4 on the tiny
    model's d = 64) adds 2·d·r floats to what CaR's head sends, the full one d², the diagonal
    2·d; each federation completes and trains its kind."""
    common = ("fl.clients=2", "fl.rounds=1", "fl.local_epochs=1", "train.lr=0.01")
    per_reply = {}
    for name, overrides in {
        "car": ("approach=car",),
        "full": ("approach=adapter_car", "adapter.kind=full"),
        "lowrank": ("approach=adapter_car", "adapter.kind=lowrank", "adapter.rank=4"),
        "diagonal": ("approach=adapter_car", "adapter.kind=diagonal", "adapter.anchor=0.1"),
    }.items():
        settings = make_settings(*common, *overrides, f"output_dir={tmp_path / name}")
        result = run_local(settings)
        assert result["summary"]["complete"]
        row = result["history"][-1]
        assert row["clients_ok"] == 2
        per_reply[name] = row["bytes_received"] / row["clients_ok"]
    adapter = {k: per_reply[k] - per_reply["car"] for k in ("full", "lowrank", "diagonal")}
    # float32 tensors plus a fixed framing per tensor: within 2 % of the numbers' bytes
    assert adapter["full"] == pytest.approx(4 * 64 * 64, rel=0.02)
    assert adapter["lowrank"] == pytest.approx(4 * 2 * 64 * 4, rel=0.02)
    assert adapter["diagonal"] == pytest.approx(4 * 2 * 64, rel=0.05)
    assert adapter["lowrank"] <= 0.13 * adapter["full"]
