"""car_fl.common.hub: with the Hub out of reach, ``car-fl ask`` fails in seconds, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from car_fl.common import hub
from car_fl.deploy.ports import free_port


def hubless_env(tmp_path: Path) -> dict[str, str]:
    """No offline switch set, an empty Hub cache, and a Hub address where nothing listens."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    return env


def test_an_unreachable_hub_turns_on_the_hubs_offline_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    tick = time.monotonic()
    why = hub.offline_unless_reachable(timeout=2.0)
    assert time.monotonic() - tick < 3
    assert why is not None and "could not be reached" in why
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE
    assert hub.offline_unless_reachable() == "HF_HUB_OFFLINE is set"  # no second probe


@pytest.mark.slow
def test_ask_without_the_hub_fails_in_seconds_in_one_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "car_fl.cli", "ask", "--checkpoint", str(tmp_path)]
    command += ["--generator", "someone/a-generator", "--device", "cpu", "a question"]
    tick = time.monotonic()
    done = subprocess.run(
        command, env=hubless_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    seconds = time.monotonic() - tick
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()  # no retry lines from the Hub's client
    assert line.startswith("car-fl ask: could not load the generator 'someone/a-generator'")
    # the Hub's client alone retries for about 25 s per file (51 s in all, unloaded); with the
    # probe it is the imports' time (about 9 s unloaded), with room for a loaded machine
    assert seconds < 45
