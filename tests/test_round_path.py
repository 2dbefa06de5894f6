"""The modules one federated round passes through, traced on the real server and ClientApp in
process, are the ones docs/architecture.md lists (and no more than it says)."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from car_fl.server.federation import RoundRecorder
from car_fl.simulation.in_process import run_local

ROOT = Path(__file__).resolve().parents[1]
#: What a round is traced in: adapter + CaR (CaR's round is a subset), under local DP.
RUN = ("mode=adapter", "eval.background=false", "dp=fixed")


def round_modules(make_settings, out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str):
    """car-fl's modules whose code runs from the end of round 1 to the end of round 2."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("car_fl."):
            seen.add(name.removeprefix("car_fl."))

    real = RoundRecorder.__call__

    def call(self: RoundRecorder, server_round: int, arrays: Any) -> Any:
        try:
            return real(self, server_round, arrays)
        finally:
            if server_round == 1:
                sys.setprofile(profile)
                threading.setprofile(profile)
            elif server_round == 2:
                sys.setprofile(None)
                threading.setprofile(None)

    with monkeypatch.context() as patch:
        patch.setattr(RoundRecorder, "__call__", call)
        overrides = ("fl.clients=2", "fl.rounds=2", "fl.local_epochs=1", f"output_dir={out}")
        run_local(make_settings(*overrides, *extra))
    seen.discard("simulation.in_process")  # the test's grid, not the product's path
    return seen


def documented() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("<!-- round-modules:begin -->")[1].split("<!-- round-modules:end -->")[0]
    return re.findall(r"`([a-z_]+\.[a-z_.]+)`", block)


@pytest.mark.slow
def test_a_round_passes_through_the_modules_the_architecture_lists(
    make_settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = round_modules(make_settings, tmp_path, monkeypatch, *RUN)
    listed = documented()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(traced) == sorted(listed), "docs/architecture.md round modules are stale"
