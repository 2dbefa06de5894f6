"""A stopped simulation ends the Ray processes it started: none outlive it.

Flower's ``flwr-simulation`` forces ``os._exit`` 5 s after a stop signal, so Ray's agents can
outlive it, orphaned. :func:`end_ray_on_exit` registers an exit handler that notes this
process's descendants, turns off Ray's auto-init, shuts Ray down and ends what is left by PID.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import psutil

from car_fl.common.stopping import end_processes

log = logging.getLogger(__name__)


def shut_down_ray() -> None:
    """Ray shut down from this process, then whatever it started and left, ended by PID."""
    try:
        started = psutil.Process().children(recursive=True)  # while Ray's agents are ours
    except psutil.Error:
        started = []
    try:
        import ray
        from ray._private import auto_init_hook

        auto_init_hook.enable_auto_connect = False  # no new cluster for Flower's threads
        if ray.is_initialized():
            ray.shutdown()
    except Exception as err:  # a stopped run: shut down what can be, then end the rest
        log.warning("Ray's shutdown failed (%s); ending its processes by PID", err)
    ended = end_processes(started)
    if ended:
        log.info("ended %d process(es) Ray left behind: PIDs %s", len(ended), ended)


_registered = False


def end_ray_on_exit(argv0: str | None = None) -> bool:
    """In Flower's ``flwr-simulation`` process, register :func:`shut_down_ray` with Flower's
    exit handlers; anywhere else do nothing. Whether it is registered."""
    global _registered
    from flwr.supercore.exit import add_exit_handler

    if Path(argv0 if argv0 is not None else sys.argv[0]).name != "flwr-simulation":
        return False
    if not _registered:
        add_exit_handler(shut_down_ray, run_before_force_exit=True)
        _registered = True
    return True
