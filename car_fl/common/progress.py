"""Progress bars that draw on a terminal only: a log file of a long run stays readable.

Without a terminal a long loop logs where it is instead (:func:`heartbeat`, at doubling gaps);
Hugging Face's bars follow the same rule (:func:`quiet_hub_bars`).

Logging for car-fl's own modules (:func:`setup_logging`): one handler on the ``car_fl``
logger, INFO by default. Entry points call it; library code only uses
``logging.getLogger(__name__)``; other libraries' loggers are left as their owners configured
them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import TypeVar

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Show car-fl's log lines once, whether or not the host process configured logging."""
    logger = logging.getLogger("car_fl")
    logger.setLevel(level)
    if logging.getLogger().handlers:  # e.g. Hydra: the root logger already prints
        return
    if not any(getattr(h, "car_fl", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.car_fl = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


T = TypeVar("T")

log = logging.getLogger(__name__)

#: Seconds after which a loop that draws no bar says where it is, the most between two such
#: lines (the gaps double from the first), and how long a loop takes to say it is done.
FIRST_HEARTBEAT_SECONDS = 10.0
HEARTBEAT_SECONDS = 120.0
DONE_SECONDS = 5.0


def on_terminal() -> bool:
    """Whether progress bars would reach a terminal (stderr is one)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(iterable: Iterable[T], *, desc: str, unit: str, enabled: bool = True) -> Iterable[T]:
    """``iterable`` with a bar when ``enabled`` and stderr is a terminal, else a heartbeat."""
    if enabled and on_terminal():
        from tqdm.auto import tqdm  # here: an entry point that only logs loads no tqdm

        return tqdm(iterable, desc=desc, unit=unit, leave=False)
    return heartbeat(iterable, desc=desc, unit=unit)


def heartbeat(
    iterable: Iterable[T],
    *,
    desc: str,
    unit: str,
    every: float = HEARTBEAT_SECONDS,
    first: float = FIRST_HEARTBEAT_SECONDS,
) -> Iterator[T]:
    """``iterable``, logging where it is ``first`` seconds after the start, then at twice the
    last gap (at most ``every``), and that it is done after :data:`DONE_SECONDS` or more."""
    total = len(iterable) if isinstance(iterable, Sized) else None
    start = last = time.monotonic()
    gap = min(first, every)
    done = 0
    for done, item in enumerate(iterable, start=1):
        yield item
        now = time.monotonic()
        if now - last < gap:
            continue
        last, gap = now, min(2 * gap, every)
        spent = now - start
        where = f"{unit} {done}" + (f" of {total}" if total else "") + f" in {spent:.0f} s"
        if total:
            where += f", about {spent / done * (total - done):.0f} s left"
        log.info("%s: %s", desc, where)
    spent = time.monotonic() - start
    if spent >= DONE_SECONDS:
        count = f"{unit} {done}" + (f" of {total}" if total else "")
        log.info("%s: done, %s in %.0f s", desc, count, spent)


def quiet_hub_bars() -> None:
    """Turn Hugging Face's progress bars off unless stderr is a terminal."""
    if on_terminal():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
