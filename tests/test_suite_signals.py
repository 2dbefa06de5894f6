"""The test suite itself: SIGTERM to pytest tears fixtures down (tests/conftest.py), so the
SuperLinks and SuperNodes a deployment test started are stopped, not left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

A_LONG_TEST = """
import time
from pathlib import Path

import pytest

MARKS = Path(__file__).parent


@pytest.fixture
def started_child():
    (MARKS / "set-up").write_text("")
    yield
    (MARKS / "torn-down").write_text("")


def test_waits(started_child):
    time.sleep(120)
"""


@pytest.mark.slow  # a child pytest imports the suite's conftest: about 7 s
def test_sigterm_to_pytest_tears_the_running_tests_fixtures_down(tmp_path: Path) -> None:
    (tmp_path / "test_long.py").write_text(A_LONG_TEST, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            str(tmp_path / "test_long.py"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "set-up").exists():
            assert child.poll() is None, child.communicate()[0]
            assert time.monotonic() < deadline, "the inner test never started"
            time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert (tmp_path / "torn-down").exists(), out  # the default handler ended pytest at once
    assert child.returncode == 2, out  # pytest's "interrupted"
    assert "KeyboardInterrupt: signal 15" in out or "signal 15" in out, out
