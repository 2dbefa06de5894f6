"""Flower's local SuperLink (``flwr run . local``): found by its port, checked by its PID.

Own code because Flower 1.39 starts that SuperLink detached the first time any ``flwr run``
needs it and reuses it afterwards, with the environment it first started with. Started by a
plain ``flwr run``, it installs the app's dependencies into a fresh environment before every
run (``uv sync``: another torch, GBs of CUDA wheels; offline it fails), and Flower has no
switch for that other than the SuperLink's own environment or command line. Before
``car-fl run`` submits to it, :func:`check_local_superlink` finds the process listening on the
SuperLink's port (``/proc/net/tcp``, then the socket among a process's open files), reads its
command line and environment, and, if it installs, says in one line how to stop it, by PID.
"""

from __future__ import annotations

import os
from pathlib import Path

#: What turns installation off: a command-line flag, or the variable in its environment.
NO_INSTALL_FLAG = "--disable-runtime-dependency-installation"
NO_INSTALL_VARIABLE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"
LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp


def local_superlink_port() -> int:
    """The port of Flower's local SuperLink, as ``flwr`` reads it."""
    from flwr.cli.constant import LOCAL_SUPERLINK_HTTP_API_PORT

    return int(LOCAL_SUPERLINK_HTTP_API_PORT)


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        path = proc / "net" / table
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].split(":")[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listener_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The PID of this user's process listening on ``port``, or None (none, or not Linux).

    A child that inherited the socket holds it too: a ``flower-superlink`` process is
    preferred, then the lowest PID.
    """
    inodes = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not inodes:
        return None
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                holders.append(int(entry.name))
        except OSError:  # another user's process, or one that just ended
            continue

    def rank(pid: int) -> tuple[bool, int]:
        try:
            superlink = b"flower-superlink" in (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            superlink = False
        return (not superlink, pid)

    return min(holders, key=rank, default=None)


def installs_dependencies(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether the SuperLink ``pid`` installs each run's dependencies (neither switch set)."""
    try:
        args = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        environ = (proc / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone, or not ours to read: nothing to say
    off = f"{NO_INSTALL_VARIABLE}=1".encode()
    return NO_INSTALL_FLAG.encode() not in args and off not in environ


def check_local_superlink(proc: Path = Path("/proc")) -> None:
    """``RuntimeError`` naming the PID to stop if the local SuperLink installs dependencies."""
    port = local_superlink_port()
    pid = listener_pid(port, proc)
    if pid is None or not installs_dependencies(pid, proc):
        return
    raise RuntimeError(
        f"Flower's local SuperLink (PID {pid}, 127.0.0.1:{port}) was started by a plain "
        f"`flwr run` with runtime dependency installation on: each of its runs installs the "
        f"app's dependencies anew (another torch, GBs of CUDA wheels) and can fail; stop it "
        f"with `kill {pid}` and run this again (car-fl run starts one without installation)"
    )
