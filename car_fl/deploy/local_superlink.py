"""Flower's local SuperLink (``flwr run . local``): found by its port, checked by its PID.

Flower 1.39 starts that SuperLink once per machine and reuses it for every checkout, with the
environment and folder it first started in, and (started by a plain ``flwr run``) installs the
app's dependencies before every run. :func:`check_local_superlink` finds the process on its
port and refuses, in one line naming its PID, one that installs or runs another environment or
folder. ``car-fl run`` without ``--superlink flower`` uses :mod:`car_fl.deploy.own_superlink`.
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
    """The PID of this user's process listening on ``port``, or None (none, or not Linux); of
    those holding the socket, a ``flower-superlink`` first, then the lowest PID."""
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


def environment(pid: int, proc: Path = Path("/proc")) -> tuple[Path, Path] | None:
    """The folder of the ``flower-superlink`` that ``pid`` runs (an environment's ``bin``) and
    its working folder (where its runs write their results), or None if unreadable."""
    try:
        args = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        folder = Path(os.readlink(proc / str(pid) / "cwd"))
    except OSError:
        return None
    names = [os.fsdecode(a) for a in args if a] or [""]
    script = next((a for a in names if Path(a).name == "flower-superlink"), names[0])
    return Path(script).absolute().parent, folder


def check_local_superlink(
    app: Path | None = None, bin_folder: Path | None = None, proc: Path = Path("/proc")
) -> None:
    """``RuntimeError`` naming the PID of Flower's local SuperLink if it installs dependencies,
    or runs another environment than ``bin_folder`` or in another folder than ``app``."""
    port = local_superlink_port()
    pid = listener_pid(port, proc)
    if pid is None:
        return
    if installs_dependencies(pid, proc):
        raise RuntimeError(
            f"Flower's local SuperLink (PID {pid}, 127.0.0.1:{port}) was started by a plain "
            f"`flwr run` with runtime dependency installation on: each of its runs installs "
            f"the app's dependencies anew (another torch, GBs of CUDA wheels) and can fail; "
            f"run without --superlink flower (car-fl run starts a SuperLink of its own), or "
            f"stop it with `kill {pid}` and run this again"
        )
    found = environment(pid, proc)
    if found is None or app is None or bin_folder is None:
        return
    theirs, folder = found
    if (theirs.resolve(), folder.resolve()) != (bin_folder.resolve(), app.resolve()):
        raise RuntimeError(
            f"Flower's local SuperLink (PID {pid}, 127.0.0.1:{port}) runs the environment "
            f"{theirs} in {folder}, not this one ({bin_folder} in {app}): this run would "
            f"execute with its Python and packages and write its results under {folder}; "
            f"run without --superlink flower (car-fl run starts a SuperLink of its own), or "
            f"stop that one with `kill {pid}`"
        )
