"""Ending processes this program started, by PID: SIGTERM, a grace, then SIGKILL.

Processes are found as descendants of one process, or by a token in their environment (every
process a run starts inherits it, also after its parent has died and it was reparented).
Ray's agents ignore SIGTERM, so a grace is always followed by SIGKILL for what is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil

#: Seconds a process is given to end on SIGTERM before it is killed.
GRACE = 2.0


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie has ended: only its parent's wait is left)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_processes(procs: Iterable[psutil.Process], *, grace: float = GRACE) -> list[int]:
    """End ``procs`` (SIGTERM, SIGKILL after ``grace`` s); the PIDs of those still running."""
    alive = [p for p in procs if running(p)]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=grace)
    return [p.pid for p in alive]


def carrying(variable: str, value: str) -> list[psutil.Process]:
    """This user's running processes whose environment holds ``variable=value`` (not this)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == psutil.Process().pid:
            continue
        try:
            if proc.environ().get(variable) == value and running(proc):
                found.append(proc)
        except psutil.Error:  # another user's process, or one that just ended
            continue
    return found
