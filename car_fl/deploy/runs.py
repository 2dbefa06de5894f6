"""Runs on a SuperLink through the ``flwr`` CLI: start one, read its status, wait for its end.

``flwr ... --format json`` may print other lines before its JSON reply; the parsers below read
from the first ``{``. ``flwr run`` can exit 0 for a run whose ServerApp failed, so the end of
a run is read from its status (``finished:completed``, ``finished:failed``, ...).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from car_fl.deploy.commands import flwr_bin

COMPLETED = "finished:completed"


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
    cmd = [
        flwr_bin("flwr"),
        "run",
        str(project),
        connection,
        "--format",
        "json",
        "--run-config",
        f"overrides={json.dumps(overrides)}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return run_id_from(out.stdout, out.stderr, out.returncode)


def run_status(
    connection: str, run_id: str, *, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The run's ``status`` and ``status-details`` from ``flwr ls``."""
    cmd = [flwr_bin("flwr"), "ls", connection, "--run-id", run_id, "--format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return status_from(out.stdout, out.stderr)


def wait_for_run(
    connection: str,
    run_id: str,
    *,
    timeout: float,
    poll: float = 3.0,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Poll until the run is finished (``flwr run`` may exit 0 for a run that failed)."""
    deadline = time.monotonic() + timeout
    while True:
        status = run_status(connection, run_id, env=env)
        if status["status"].startswith("finished") or time.monotonic() > deadline:
            return status
        time.sleep(poll)
