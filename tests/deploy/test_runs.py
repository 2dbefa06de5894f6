"""car_fl.deploy.runs: reading ``flwr run`` / ``flwr ls`` JSON output."""

from __future__ import annotations

import json

import pytest

from car_fl.deploy.runs import json_reply, run_id_from, status_from


def test_json_reply_skips_lines_before_the_object() -> None:
    stdout = 'Loading project configuration...\n{"success": true, "run-id": 42}\n'
    assert json_reply(stdout) == {"success": True, "run-id": 42}
    assert json_reply("no json here") is None
    assert json_reply("{broken") is None


def test_run_id_from_a_successful_run() -> None:
    assert run_id_from('🎊 Successfully built\n{"success": true, "run-id": 1234}') == "1234"


@pytest.mark.parametrize(
    ("stdout", "returncode"),
    [
        ('{"success": false, "error-message": "no connection"}', 0),
        ('{"success": true, "run-id": 1}', 1),
        ("Traceback ...", 1),
    ],
)
def test_run_id_from_a_failed_run_raises_with_the_output(stdout: str, returncode: int) -> None:
    with pytest.raises(RuntimeError, match=f"flwr run failed \\({returncode}\\)"):
        run_id_from(stdout, "stderr text", returncode)


def test_status_from_flwr_ls() -> None:
    reply = {
        "success": True,
        "runs": [{"run-id": "7", "status": "finished:failed", "status-details": "ValueError"}],
    }
    assert status_from(json.dumps(reply)) == {
        "status": "finished:failed",
        "status-details": "ValueError",
    }
    assert status_from('{"success": true, "runs": []}') == {
        "status": "unknown",
        "status-details": "no such run",
    }
    assert status_from("connection refused", "err") == {
        "status": "unknown",
        "status-details": "connection refusederr",
    }
