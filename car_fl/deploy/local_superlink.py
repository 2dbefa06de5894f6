"""Flower's local SuperLink (``flwr run . local``): found by its port, checked by its PID.

Flower 1.39 starts that SuperLink once per machine and reuses it for every checkout, with the
environment and folder it first started in, and (started by a plain ``flwr run``) installs the
app's dependencies before every run. :func:`check_local_superlink` finds the process on its
port and refuses, in one line naming its PID, one that installs or runs another environment or
folder. ``car-fl run`` without ``--superlink flower`` uses :mod:`car_fl.deploy.own_superlink`.
"""

from __future__ import annotations

from pathlib import Path

#: What turns installation off: a command-line flag, or the variable in its environment.
NO_INSTALL_FLAG = "--disable-runtime-dependency-installation"
NO_INSTALL_VARIABLE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"


def local_superlink_port() -> int:
    """The port of Flower's local SuperLink, as ``flwr`` reads it."""
    from flwr.cli.constant import LOCAL_SUPERLINK_HTTP_API_PORT

    return int(LOCAL_SUPERLINK_HTTP_API_PORT)


def listener_pid(port: int) -> int | None:
    """The PID of this user's process listening on ``port``, or None (none, or not ours to
    see); of those holding the socket, a ``flower-superlink`` first, then the lowest PID."""
    import psutil

    try:
        holders = {
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
    except (psutil.Error, OSError):  # macOS lists sockets to root only
        return None

    def rank(pid: int) -> tuple[bool, int]:
        try:
            superlink = any("flower-superlink" in a for a in psutil.Process(pid).cmdline())
        except psutil.Error:  # another user's process, or one that just ended
            superlink = False
        return (not superlink, pid)

    return min(holders, key=rank, default=None)


def installs_dependencies(pid: int) -> bool:
    """Whether the SuperLink ``pid`` installs each run's dependencies (neither switch set)."""
    import psutil

    try:
        process = psutil.Process(pid)
        args, environ = process.cmdline(), process.environ()
    except psutil.Error:
        return False  # gone, or not ours to read: nothing to say
    return NO_INSTALL_FLAG not in args and environ.get(NO_INSTALL_VARIABLE) != "1"


def environment(pid: int) -> tuple[Path, Path] | None:
    """The folder of the ``flower-superlink`` that ``pid`` runs (an environment's ``bin``) and
    its working folder (where its runs write their results), or None if unreadable."""
    import psutil

    try:
        process = psutil.Process(pid)
        names, folder = [a for a in process.cmdline() if a] or [""], Path(process.cwd())
    except psutil.Error:
        return None
    script = next((a for a in names if Path(a).name == "flower-superlink"), names[0])
    return Path(script).absolute().parent, folder


def check_local_superlink(app: Path | None = None, bin_folder: Path | None = None) -> None:
    """``RuntimeError`` naming the PID of Flower's local SuperLink if it installs dependencies,
    or runs another environment than ``bin_folder`` or in another folder than ``app``."""
    port = local_superlink_port()
    pid = listener_pid(port)
    if pid is None:
        return
    if installs_dependencies(pid):
        raise RuntimeError(
            f"Flower's local SuperLink (PID {pid}, 127.0.0.1:{port}) was started by a plain "
            f"`flwr run` with runtime dependency installation on: each of its runs installs "
            f"the app's dependencies anew (another torch, GBs of CUDA wheels) and can fail; "
            f"run without --superlink flower (car-fl run starts a SuperLink of its own), or "
            f"stop it with `kill {pid}` and run this again"
        )
    found = environment(pid)
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
