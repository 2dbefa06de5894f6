"""Process control: the processes one cluster started, by name and PID, stopped by PID only.

Each runs in its own session and logs to ``<folder>/<name>.log``; the PIDs are kept in
``<folder>/cluster.json`` so that another process can stop them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from car_fl.common.io import atomic_write_json


@dataclass
class Processes:
    """Named processes started by this program, recorded in ``<folder>/cluster.json``."""

    folder: Path
    pids: dict[str, int] = field(default_factory=dict)
    #: Our own children: waited for through Popen (which may reap them when another starts).
    children: dict[str, subprocess.Popen[bytes]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def state_file(self) -> Path:
        return self.folder / "cluster.json"

    def start(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None) -> int:
        """Start ``cmd`` in its own session, logging to ``<folder>/<name>.log``."""
        if name in self.pids:
            raise ValueError(f"a process named {name!r} is already running (PID {self.pids[name]})")
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.pids[name], self.children[name] = proc.pid, proc
        self.save()
        return proc.pid

    def save(self) -> None:
        state = {"folder": str(self.folder), "processes": self.pids}
        atomic_write_json(self.state_file, state)

    @classmethod
    def load(cls, folder: str | Path) -> Processes:
        folder = Path(folder)
        state = folder / "cluster.json"
        if not state.is_file():
            raise FileNotFoundError(f"{state} not found: no cluster was started in {folder}")
        data = json.loads(state.read_text())
        return cls(folder=folder, pids={k: int(v) for k, v in data["processes"].items()})

    def log(self, name: str) -> str:
        """What ``name`` has written so far (its log file), or ``""``."""
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def alive(self, name: str) -> bool:
        pid = self.pids.get(name)
        if pid is None:
            return False
        if name in self.children:
            return self.children[name].poll() is None
        try:  # loaded from cluster.json: our child (reap it if it ended), or probe
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
        return waited == 0

    def exit_code(self, name: str, *, timeout: float) -> int | None:
        """Wait for our child ``name`` to exit; its exit code (-N: signal N), or None if it runs."""
        try:
            return self.children[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, name: str, sig: int = signal.SIGTERM, *, timeout: float = 15.0) -> None:
        """Signal the process group we started for ``name`` and wait for it to end."""
        pid = self.pids.get(name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while self.alive(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Whatever of the group is left (the leader, or a child that ignored ``sig``) is killed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while self.alive(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.pids.pop(name, None)
        self.children.pop(name, None)
        self.save()

    def stop(self) -> None:
        """Stop SuperNodes (and anything else) first, then the SuperLink."""
        for name in sorted(self.pids, key=lambda n: n == "superlink"):
            self.kill(name)
