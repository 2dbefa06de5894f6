"""Runs on a SuperLink through the ``flwr`` CLI: start one, read its status, wait for its end.

``flwr ... --format json`` may print other lines first (parsed from the first ``{``); ``flwr
run`` can exit 0 for a failed run, so its end is read from its status. Every ``flwr`` child
runs in its own session, so that Ctrl-C reaches this program alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from car_fl.deploy.commands import flower_env, flwr_bin

COMPLETED = "finished:completed"
#: Flower starts runs with runtime dependency installation unless this is set (its local
#: SuperLink reads it when it starts; see docs/federation.md).
NO_INSTALL = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}


def json_reply(stdout: str) -> dict[str, Any] | None:
    """The JSON object ``flwr --format json`` printed, or None if there is none."""
    try:
        reply = json.loads(stdout[stdout.index("{") :])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def run_id_from(stdout: str, stderr: str = "", returncode: int = 0) -> str:
    """The run id in ``flwr run --format json``'s reply; ``RuntimeError`` if it failed."""
    reply = json_reply(stdout) or {}
    if returncode != 0 or not reply.get("success"):
        raise RuntimeError(f"flwr run failed ({returncode}): {stdout}\n{stderr}")
    return str(reply["run-id"])


def status_from(stdout: str, stderr: str = "") -> dict[str, str]:
    """``status`` and ``status-details`` of the one run in ``flwr ls --run-id`` JSON."""
    reply = json_reply(stdout)
    if reply is None or "runs" not in reply:
        return {"status": "unknown", "status-details": stdout + stderr}
    runs = reply["runs"]
    if not runs:
        return {"status": "unknown", "status-details": "no such run"}
    return {k: str(runs[0].get(k)) for k in ("status", "status-details")}


def start_run(
    project: str | Path, connection: str, overrides: str, *, env: dict[str, str] | None = None
) -> str:
    """``flwr run PROJECT CONNECTION --run-config overrides=...``; returns the run id."""
    return submit(project, connection, [f"overrides={json.dumps(overrides)}"], env=env)


def submit(
    project: str | Path,
    connection: str,
    run_config: Sequence[str],
    federation_config: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """``flwr run`` with these ``--run-config`` and ``--federation-config`` strings, from
    ``cwd`` (where a local SuperLink it starts runs and writes its results); the run id. Flower
    is given a copy of the app's files (:func:`fab_folder`)."""
    with fab_folder(Path(project)) as app:
        cmd = [flwr_bin("flwr"), "run", str(app), connection, "--format", "json"]
        for item in run_config:
            cmd += ["--run-config", item]
        for item in federation_config:
            cmd += ["--federation-config", item]
        out = _flwr(cmd, env, cwd=cwd)
    stdout, stderr = (text.replace(str(app), str(project)) for text in (out.stdout, out.stderr))
    return run_id_from(stdout, stderr, out.returncode)


@contextlib.contextmanager
def fab_folder(project: Path) -> Iterator[Path]:
    """A temporary copy of Flower's publish set of ``project`` (``filter_paths_for_publish``:
    what its FAB build starts from), where ``flwr run`` makes every check and choice itself
    without reading the folders that filter drops first, a checkout's ``.venv`` (why:
    docs/deployment.md, "Pinning the app a node runs"). The same FAB or the same refusal
    (``tests/deploy/test_runs.py``); the project itself where Flower refuses it or would
    migrate (edit) its legacy ``[tool.flwr.federations]``."""
    from flwr.cli.utils import filter_paths_for_publish
    from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS

    def dropped(pattern: str) -> set[str]:  # folder names in patterns such as ".venv/**"
        return {m[1] for m in map(re.compile(pattern).fullmatch, APP_PUBLISH_EXCLUDE_PATTERNS) if m}

    top, anywhere = dropped(r"([^*/]+)/\*\*"), dropped(r"\*\*/([^*/]+)/\*\*")
    root = project.expanduser().resolve()
    files: dict[str, bytes | Path] = {}
    for folder, subfolders, names in os.walk(root):
        skip = anywhere | (top if folder == str(root) else set())
        subfolders[:] = [name for name in subfolders if name not in skip]
        for name in names:
            path = Path(folder, name)
            if not path.is_symlink():  # as Flower: symbolic links are left out
                files[path.relative_to(root).as_posix()] = path
    try:
        with warnings.catch_warnings():  # pathspec deprecates Flower's patterns; flwr shows none
            warnings.simplefilter("ignore", DeprecationWarning)
            publish = filter_paths_for_publish(files)
        config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
        as_is = "federations" in config.get("tool", {}).get("flwr", {})
    except Exception:  # a path too deep, no or a broken pyproject.toml: flwr run says what
        publish, as_is = {}, True
    if as_is or "pyproject.toml" not in publish:
        yield project
        return
    with tempfile.TemporaryDirectory(prefix="car-fl-fab-") as staged:
        for name in publish:
            (Path(staged) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, Path(staged) / name)
        yield Path(staged)


def _flwr(
    cmd: list[str], env: dict[str, str] | None, *, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` (an ``flwr`` command line) run to its end, its output captured, in a session of
    its own, with Flower's folder first on PATH."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=flower_env(env),
        cwd=cwd,
        check=False,
        start_new_session=True,
    )


def stop_run(connection: str, run_id: str, *, env: dict[str, str] | None = None) -> None:
    """``flwr stop RUN_ID CONNECTION`` (a run this program started)."""
    cmd = [flwr_bin("flwr"), "stop", run_id, connection]
    _flwr(cmd, env)


def run_status(
    connection: str, run_id: str, *, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The run's ``status`` and ``status-details`` from ``flwr ls``."""
    cmd = [flwr_bin("flwr"), "ls", connection, "--run-id", run_id, "--format", "json"]
    out = _flwr(cmd, env)
    return status_from(out.stdout, out.stderr)


def log_stream(
    connection: str, run_id: str, *, env: dict[str, str] | None = None, show: bool = True
) -> subprocess.Popen[bytes]:
    """``flwr log RUN_ID CONNECTION --stream``, to stdout if ``show``; it ends with the run,
    so waiting for it replaces polling the status."""
    cmd = [flwr_bin("flwr"), "log", run_id, connection, "--stream"]
    out = None if show else subprocess.DEVNULL
    return subprocess.Popen(
        cmd,
        env=flower_env(env),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
    )


def follow_run(
    connection: str,
    run_id: str,
    *,
    timeout: float,
    poll: float = 3.0,
    env: dict[str, str] | None = None,
    status: Callable[[], dict[str, str]] | None = None,
    show: bool = True,
) -> dict[str, str]:
    """Wait until the run is finished, its log streamed to stdout if ``show``; its status.

    A stream that ends before the run is started again after ``poll`` seconds; after
    ``timeout`` seconds the run is stopped. ``status`` replaces :func:`run_status` (tests).
    """
    read = status or (lambda: run_status(connection, run_id, env=env))
    deadline = time.monotonic() + timeout
    stream = log_stream(connection, run_id, env=env, show=show)
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stream.wait(timeout=max(0.0, deadline - time.monotonic()))
            current = read()
            if current["status"].startswith("finished"):
                return current
            if time.monotonic() > deadline:
                stop_run(connection, run_id, env=env)
                return {
                    "status": "timed out",
                    "status-details": f"not finished after {timeout:g} s; stopped it",
                }
            time.sleep(poll)
            if stream.poll() is not None:
                stream = log_stream(connection, run_id, env=env, show=False)
    finally:
        if stream.poll() is None:
            stream.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                stream.wait(timeout=5)


def wait_for_run(
    connection: str,
    run_id: str,
    *,
    timeout: float,
    poll: float = 3.0,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Wait until the run is finished (``flwr run`` may exit 0 for a run that failed), its
    log not shown; its status. A run not finished after ``timeout`` seconds is stopped."""
    return follow_run(connection, run_id, timeout=timeout, poll=poll, env=env, show=False)
