"""car_fl.deploy.local_superlink: a local SuperLink that installs dependencies is named by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from car_fl.deploy import local_superlink
from car_fl.deploy.local_superlink import (
    NO_INSTALL_FLAG,
    NO_INSTALL_VARIABLE,
    check_local_superlink,
    installs_dependencies,
    listener_pid,
)
from car_fl.deploy.ports import free_port

LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
time.sleep(120)
"""

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc")


@contextmanager
def listener(port: int, *args: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """A process of ours listening on ``port`` (its extra ``args`` in its command line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(port), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_the_listener_is_found_by_its_port_and_its_switches_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    assert listener_pid(port) is None
    plain = {k: v for k, v in os.environ.items() if k != NO_INSTALL_VARIABLE}
    with listener(port, env=plain) as pid:
        assert listener_pid(port) == pid
        assert installs_dependencies(pid)
        monkeypatch.setattr(local_superlink, "local_superlink_port", lambda: port)
        with pytest.raises(RuntimeError, match=rf"\(PID {pid}, 127.0.0.1:{port}\).* `kill {pid}`"):
            check_local_superlink()
    time.sleep(0.1)
    with listener(port, NO_INSTALL_FLAG, env=plain) as pid:
        assert not installs_dependencies(pid)
        check_local_superlink()  # says nothing
    with listener(port, env={**plain, NO_INSTALL_VARIABLE: "1"}) as pid:
        assert not installs_dependencies(pid)
