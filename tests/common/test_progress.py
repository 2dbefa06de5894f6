"""car_fl.common.progress: bars on a terminal only."""

from __future__ import annotations

import io
import sys

import pytest

from car_fl.common.progress import bar, on_terminal


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
