"""A SuperLink of one ``car-fl run``'s own: this environment, this folder, a free port, and
nothing left of it after the run.

Flower's local SuperLink is one per machine and outlives its runs (:mod:`.local_superlink`).
:func:`own_superlink` starts a simulation SuperLink for one run (its own ``FLWR_HOME``, no
dependency installation); every process it starts carries a token, and when the run ends any
process still carrying it (Ray's included) is ended by PID.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from car_fl.common.stopping import carrying, end_processes
from car_fl.deploy.commands import flower_env, flwr_bin
from car_fl.deploy.connection import write_connection
from car_fl.deploy.local_superlink import NO_INSTALL_FLAG, NO_INSTALL_VARIABLE
from car_fl.deploy.ports import LOOPBACK, free_port

log = logging.getLogger(__name__)

#: The environment variable every process of one own SuperLink carries (its value: a token).
TOKEN = "CAR_FL_SUPERLINK_TOKEN"
#: The connection name in the own ``FLWR_HOME``'s ``config.toml``.
CONNECTION = "car-fl-run"
#: Seconds a stopped run's simulation process is given to end by itself (Ray shut down by
#: its exit handler, :mod:`car_fl.server.simulation_exit`) before the SuperLink is stopped.
SIMULATION_GRACE = 15.0


@dataclass(frozen=True)
class OwnSuperLink:
    """A running own SuperLink: the ``flwr`` connection to use, and the environment for
    ``flwr`` commands (its ``FLWR_HOME``)."""

    connection: str
    address: str
    env: dict[str, str]
    pid: int
    token: str


def simulation_superlink_command(*, port: int, database: Path) -> list[str]:
    """``flower-superlink`` in simulation mode on ``127.0.0.1:port``, installing nothing."""
    return [
        flwr_bin("flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--database",
        str(database),
        NO_INSTALL_FLAG,
    ]


def healthy(address: str) -> bool:
    """Whether the SuperLink at ``address`` answers its health check."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def own_superlink(
    app: Path, *, env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> Iterator[OwnSuperLink]:
    """A simulation SuperLink for one run, started in ``app`` and ended, with every process it
    started, when the block is left (also by an exception or a signal)."""
    home = Path(tempfile.mkdtemp(prefix="car-fl-superlink-"))
    token = uuid.uuid4().hex
    port = free_port()
    address = f"{LOOPBACK}:{port}"
    child_env = flower_env(
        {**(os.environ if env is None else env), "FLWR_HOME": str(home), TOKEN: token}
    )
    child_env[NO_INSTALL_VARIABLE] = "1"
    write_connection(home, CONNECTION, address)
    logfile = home / "superlink.log"
    proc = None
    try:
        with logfile.open("ab") as out:
            proc = subprocess.Popen(
                simulation_superlink_command(port=port, database=home / "state.db"),
                cwd=app,
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches car-fl run, which stops it in order
            )
        wait_until_healthy(proc, address, timeout=timeout, logfile=logfile)
        yield OwnSuperLink(CONNECTION, address, child_env, proc.pid, token)
    finally:
        with signals_held():  # a second Ctrl-C must not cut the stop short
            if proc is not None:
                stop(proc, token)
            shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside the block (in the main thread; elsewhere as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_until_healthy(
    proc: subprocess.Popen[bytes], address: str, *, timeout: float, logfile: Path
) -> None:
    """Return once the SuperLink answers; ``RuntimeError`` with its last lines if it exits
    or does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not healthy(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "no answer"
            raise RuntimeError(
                f"the run's own SuperLink on {address} did not start ({why} after "
                f"{timeout:.0f} s at most); its log ends: {' | '.join(tail) or '(empty)'}"
            )
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], token: str) -> list[int]:
    """Stop the SuperLink ``proc`` once its simulation has ended (or after
    :data:`SIMULATION_GRACE` s), then end whatever still carries ``token``; the PIDs ended
    after the SuperLink."""
    deadline = time.monotonic() + SIMULATION_GRACE
    while time.monotonic() < deadline and simulating(token):
        time.sleep(0.2)
    if proc.poll() is None:
        proc.terminate()  # Flower's lifespan ends its SuperExec
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    ended = end_processes(carrying(TOKEN, token))
    if ended:
        log.info("ended %d process(es) the run's SuperLink left: PIDs %s", len(ended), ended)
    return ended


def simulating(token: str) -> bool:
    """Whether a ``flwr-simulation`` process carrying ``token`` still runs."""
    for proc in carrying(TOKEN, token):
        with contextlib.suppress(psutil.Error):
            if any(Path(arg).name == "flwr-simulation" for arg in proc.cmdline()):
                return True
    return False
