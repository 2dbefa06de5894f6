"""A car-fl serving command (``serve``, ``serve-blocks``) in a subprocess, as the slow tests run it.

It listens on 127.0.0.1 on a free port with a token file, and is started once it has written
its ready file; :meth:`ServingProcess.stop` sends SIGTERM and returns what of its process tree
is still alive, so a test can assert that a stop leaves nothing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from car_fl.deploy.ports import free_port

#: Seconds a service may take to answer (a Ray start costs ~25 s on 2 cores, more under load).
START_S = 180


class ServingProcess:
    """``car-fl <command> <args> --port P --token-file T --ready-file R`` in ``tmp``."""

    def __init__(self, command: Sequence[str], tmp: Path, *, token: str, route: str = "") -> None:
        self.command, self.tmp, self.token = list(command), tmp, token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{route}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until its ready file names :attr:`url` (or fail with its log)."""
        ready = self.tmp / f"ready-{time.monotonic_ns()}"
        token = self.tmp / "token"
        token.write_text(self.token)
        flags = ["--port", str(self.port), "--token-file", str(token), "--ready-file", str(ready)]
        self.log = (self.tmp / "service.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "car_fl.cli", *self.command, *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
        )
        deadline = time.monotonic() + START_S
        while not ready.exists():
            assert self.proc.poll() is None, (self.tmp / "service.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"car-fl {self.command[0]} did not start"
            time.sleep(0.5)
        assert ready.read_text().strip() == self.url

    def stop(self) -> list[psutil.Process]:
        """SIGTERM, wait; the processes of its tree still alive afterwards."""
        tree = self.terminate()
        return self.wait(tree)

    def terminate(self) -> list[psutil.Process]:
        """Send SIGTERM; the processes of its tree as they were just before."""
        assert self.proc is not None
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        return tree

    def wait(self, tree: list[psutil.Process]) -> list[psutil.Process]:
        """Wait for it to end; the processes of ``tree`` still alive afterwards."""
        assert self.proc is not None
        self.proc.wait(timeout=90)
        _, alive = psutil.wait_procs(tree, timeout=30)
        self.log.close()
        return alive

    def end(self) -> None:
        """Stop it if it still runs, killing (by PID) what of its tree outlived the stop."""
        if self.proc is not None and self.proc.poll() is None:
            for process in self.stop():
                process.kill()
