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
    environment,
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
def listener(
    port: int, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[int]:
    """A process of ours listening on ``port`` (its extra ``args`` in its command line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(port), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
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


def test_a_superlink_of_another_environment_or_folder_is_refused_by_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkouts: Flower's local SuperLink started by the first would run the second's
    runs with the first's Python and packages, and write their results under the first."""
    port = free_port()
    monkeypatch.setattr(local_superlink, "local_superlink_port", lambda: port)
    first, second = tmp_path / "first", tmp_path / "second"
    for clone in (first, second):
        (clone / ".venv" / "bin").mkdir(parents=True)
    script = str(first / ".venv" / "bin" / "flower-superlink")  # as a console script runs
    env = {**os.environ, NO_INSTALL_VARIABLE: "1"}
    with listener(port, script, NO_INSTALL_FLAG, env=env, cwd=first) as pid:
        assert environment(pid) == (first / ".venv" / "bin", first)
        check_local_superlink(first, first / ".venv" / "bin")  # the first checkout's own
        with pytest.raises(RuntimeError) as refused:
            check_local_superlink(second, second / ".venv" / "bin")
        message = str(refused.value)
        assert f"(PID {pid}, 127.0.0.1:{port}) runs the environment {first / '.venv'}" in message
        assert f"in {first}, not this one" in message and "without --superlink flower" in message
        with pytest.raises(RuntimeError, match=r"write its results under"):
            check_local_superlink(first, second / ".venv" / "bin")  # another Python, same folder
