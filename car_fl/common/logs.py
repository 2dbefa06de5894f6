"""Logging for car-fl's own modules: one handler on the ``car_fl`` logger, INFO by default.

Entry points call :func:`setup_logging`; library code only uses ``logging.getLogger(__name__)``.
Other libraries' loggers are left as their owners configured them.
"""

from __future__ import annotations

import logging

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
