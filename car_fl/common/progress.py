"""Progress bars that draw on a terminal only: a log file of a long run stays readable.

tqdm with ``disable=None`` turns itself off when its stream is not a terminal; the per-round
and per-epoch log lines say where a run is instead. Hugging Face's own bars (loading weights,
writing shards) follow the same rule through :func:`quiet_hub_bars`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def on_terminal() -> bool:
    """Whether progress bars would reach a terminal (stderr is one)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(iterable: Iterable[T], *, desc: str, unit: str, enabled: bool = True) -> Iterable[T]:
    """``iterable`` with a progress bar when ``enabled`` and stderr is a terminal."""
    return tqdm(iterable, desc=desc, unit=unit, leave=False, disable=None if enabled else True)


def quiet_hub_bars() -> None:
    """Turn Hugging Face's progress bars off unless stderr is a terminal."""
    if on_terminal():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
