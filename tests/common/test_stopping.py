"""car_fl.common.stopping: processes found by a token in their environment, ended by PID
(also one that ignores SIGTERM, as Ray's agents do, and one whose parent has died)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from car_fl.common.stopping import carrying, end_processes, running

#: A child that ignores SIGTERM and starts an orphan grandchild that ignores it too.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
print("ready", flush=True)
time.sleep(60)
"""


def test_what_carries_the_token_is_found_and_ended_even_if_it_ignores_sigterm() -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, "TEST_TOKEN": token}
    child = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        found = carrying("TEST_TOKEN", token)
        assert child.pid in {p.pid for p in found} and len(found) == 2  # child and grandchild
        assert carrying("TEST_TOKEN", "another") == []
        ended = end_processes(found, grace=0.5)
        assert sorted(ended) == sorted(p.pid for p in found)
        child.wait(timeout=5)
        assert carrying("TEST_TOKEN", token) == []
        assert not any(running(p) for p in found)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
