"""Every adapter kind through a real federation: what travels, and its bytes measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from car_fl.model.retriever import build_retriever
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


def test_a_hostile_clients_reply_of_another_adapter_kind_or_rank_is_refused(make_settings) -> None:
    """The server's spec is its own global state: a client that answers a low-rank run with a
    full d×d adapter (d² numbers where 2·d·r were asked: a wider channel, or just a lie) or with
    a larger rank is refused, naming the tensor, before anything is aggregated."""
    import numpy as np

    from car_fl.protocol.messages import to_record
    from car_fl.server.strategy import spec_of, validate_reply
    from tests.helpers import reply

    settings = make_settings("approach=adapter_car", "adapter.kind=lowrank", "adapter.rank=4")
    state = build_retriever(settings, 4).trainable_state_dict()
    spec = spec_of(to_record(state))
    honest = {k: v.numpy() for k, v in state.items()}
    assert validate_reply(reply(1, honest, 10).content, spec) is None
    full = {k: v for k, v in honest.items() if not k.startswith("adapter.")}
    full["adapter.weight"] = np.eye(64, dtype=np.float32)
    why = validate_reply(reply(2, full, 10).content, spec)
    assert (
        why is not None
        and "missing ['adapter.down', 'adapter.up'], extra ['adapter.weight']" in why
    )
    wider = {**honest, "adapter.up": np.zeros((64, 8), dtype=np.float32)}
    why = validate_reply(reply(3, wider, 10).content, spec)
    assert why == "tensor 'adapter.up' has shape (64, 8), expected (64, 4)"


def test_a_servers_state_of_another_kind_is_refused_by_the_node_before_training(
    make_settings,
) -> None:
    """The node builds the adapter its run's settings name; a global state of another kind or
    rank fails to load, naming what differs, before any record is read."""
    lowrank = make_settings("approach=adapter_car", "adapter.kind=lowrank", "adapter.rank=4")
    full = make_settings("approach=adapter_car", "adapter.kind=full")
    node_model = build_retriever(lowrank, 4)
    with pytest.raises(ValueError, match=r"missing \['adapter.down', 'adapter.up'\]"):
        node_model.load_trainable_state_dict(build_retriever(full, 4).trainable_state_dict())
    wider = make_settings("approach=adapter_car", "adapter.kind=lowrank", "adapter.rank=8")
    with pytest.raises(ValueError, match=r"'adapter\.(up|down)' has shape \(64, 8\), expected"):
        node_model.load_trainable_state_dict(build_retriever(wider, 4).trainable_state_dict())
