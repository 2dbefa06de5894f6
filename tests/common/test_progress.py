"""car_fl.common.progress: bars on a terminal only, a heartbeat in the log otherwise."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from car_fl.common import progress
from car_fl.common.progress import bar, heartbeat, on_terminal


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_no_bar_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert not on_terminal()
    assert list(bar(range(50), desc="epoch 1", unit="step")) == list(range(50))
    assert log.getvalue() == ""


def test_a_terminal_gets_its_bar_unless_progress_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert on_terminal()
    list(bar(range(5), desc="epoch 1", unit="step"))
    assert "epoch 1" in terminal.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    list(bar(range(5), desc="epoch 1", unit="step", enabled=False))
    assert quiet.getvalue() == ""


def test_a_loop_without_a_bar_logs_a_heartbeat_once_every_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A headless adapter epoch is minutes long: its log says where it is every
    HEARTBEAT_SECONDS (a fake clock: 50 s a step), and a short loop says nothing."""
    clock = iter(range(0, 10_000, 50))
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        assert list(bar(range(10), desc="client 0 round 2 epoch 1", unit="step")) == list(range(10))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "client 0 round 2 epoch 1: step 3 of 10 in 150 s, about 350 s left",
        "client 0 round 2 epoch 1: step 6 of 10 in 300 s, about 200 s left",
        "client 0 round 2 epoch 1: step 9 of 10 in 450 s, about 50 s left",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        list(heartbeat(iter(range(2)), desc="features", unit="batch", every=1e9))
        list(heartbeat(iter(range(4)), desc="eval", unit="batch", every=100))
    assert [r.getMessage() for r in caplog.records] == [
        "eval: batch 2 in 100 s",
        "eval: batch 4 in 200 s",
    ]
