"""car_fl.common.progress: car-fl's lines are shown once, and a host's logging is respected."""

from __future__ import annotations

import logging

import pytest

from car_fl.common.progress import setup_logging


def car_fl_logger(
    monkeypatch: pytest.MonkeyPatch, *, root: list[logging.Handler]
) -> logging.Logger:
    """The car_fl logger without handlers, under a root logger with ``root`` handlers."""
    monkeypatch.setattr(logging.getLogger(), "handlers", root)
    ours = logging.getLogger("car_fl")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", ours.level)
    return ours


def test_one_handler_however_often_it_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = car_fl_logger(monkeypatch, root=[])
    setup_logging()
    setup_logging()
    assert len(ours.handlers) == 1
    assert ours.level == logging.INFO


def test_a_process_whose_root_logger_prints_gets_no_second_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours = car_fl_logger(monkeypatch, root=[logging.NullHandler()])
    setup_logging(logging.DEBUG)
    assert ours.handlers == [] and ours.level == logging.DEBUG
