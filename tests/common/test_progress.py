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


def test_a_loop_without_a_bar_logs_a_heartbeat_at_doubling_gaps_and_when_it_is_done(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A headless adapter epoch is minutes long: its log says where it is 10 s in, then at
    doubling gaps up to HEARTBEAT_SECONDS (a fake clock: 10 s a step), and that it is done;
    a short loop says nothing."""
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        assert list(bar(range(40), desc="test features", unit="batch")) == list(range(40))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "test features: batch 1 of 40 in 10 s, about 390 s left",
        "test features: batch 3 of 40 in 30 s, about 370 s left",
        "test features: batch 7 of 40 in 70 s, about 330 s left",
        "test features: batch 15 of 40 in 150 s, about 250 s left",
        "test features: batch 27 of 40 in 270 s, about 130 s left",
        "test features: batch 39 of 40 in 390 s, about 10 s left",
        "test features: done, batch 40 of 40 in 410 s",
    ]
    caplog.clear()
    quick = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(quick))
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        list(heartbeat(iter(range(2)), desc="features", unit="batch"))
    assert caplog.records == []  # 3 s: nothing to say
