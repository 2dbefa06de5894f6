"""``car-fl run``'s SuperLink: a run executes in the environment and folder it was started
from, beside another checkout's local SuperLink; Flower's own local SuperLink is refused while
it installs dependencies; a stopped run leaves no process behind.

Every process a run starts inherits this test's marker in its environment; what still runs
with it after ``car-fl run`` exits is what the run left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from car_fl.common.stopping import carrying, end_processes
from car_fl.deploy.commands import flower_env, flwr_bin
from car_fl.deploy.connection import write_connection
from car_fl.deploy.local_superlink import NO_INSTALL_VARIABLE, listener_pid
from car_fl.deploy.ports import free_port
from car_fl.deploy.runs import COMPLETED

PROJECT = Path(__file__).resolve().parents[2]
MARK = "CAR_FL_TEST_MARK"
APP_FILES = ("pyproject.toml", "server_app.py", "client_app.py")
APP_FOLDERS = ("car_fl", "conf")  # what the FAB ships beside the apps (pyproject.toml)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc"),
]


def clone(folder: Path) -> Path:
    """Another checkout of the app: its own folder, the same Flower app and package files."""
    folder.mkdir(parents=True)
    for name in APP_FILES:
        shutil.copy(PROJECT / name, folder / name)
    for name in APP_FOLDERS:
        shutil.copytree(PROJECT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def run_config(tiny_llama: Path, synthetic_tsv: Path, *, rounds: int, adapter: bool) -> str:
    mode = ' mode="adapter"' if adapter else ""
    local = f"model.name_or_path={tiny_llama} progress=false device=cpu"
    tiny = f'model="local" dataset.path="{synthetic_tsv}"{mode}'
    return f'fl.rounds={rounds} {tiny} overrides="{local}"'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Offline, this test's own flwr configuration and local SuperLink port, and the marker."""
    return {
        **{k: v for k, v in os.environ.items() if k != NO_INSTALL_VARIABLE},
        "HF_HUB_OFFLINE": "1",
        "FLWR_HOME": str(tmp_path / "flwr"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        MARK: uuid.uuid4().hex,
    }


def left_behind(env: dict[str, str]) -> list[str]:
    """The command lines of what still runs with this test's marker."""
    found = []
    for proc in carrying(MARK, env[MARK]):
        try:
            found.append(" ".join(proc.cmdline())[:120])
        except psutil.Error:
            continue
    return found


@pytest.fixture
def ended(env: dict[str, str]) -> Iterator[None]:
    """Whatever a failing test left with the marker is ended after it, by PID."""
    yield
    end_processes(carrying(MARK, env[MARK]))


def car_fl_run(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "car_fl.cli", "run", *args]
    return subprocess.run(
        command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_second_checkout_runs_in_its_own_environment_and_folder_beside_the_first_ones(
    tmp_path: Path, env: dict[str, str], ended: None, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    # The first checkout's local SuperLink, as `flwr run . local` starts it there (its own
    # environment's flower-superlink, its folder, the shared local port)
    first, second = clone(tmp_path / "first"), clone(tmp_path / "second")
    bin_folder = first / ".venv" / "bin"
    bin_folder.mkdir(parents=True)
    shutil.copy(flwr_bin("flower-superlink"), bin_folder / "flower-superlink")
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    theirs = {**env, "FLWR_HOME": str(first / "flwr"), MARK: "the first checkout's"}
    command = [sys.executable, str(bin_folder / "flower-superlink"), "--insecure", "--simulation"]
    command += ["--host", "127.0.0.1", "--port", port, "--disable-runtime-dependency-installation"]
    link = subprocess.Popen(
        command,
        cwd=first,
        env=flower_env(theirs),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while listener_pid(int(port)) is None:
            assert link.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        config = run_config(tiny_llama, synthetic_tsv, rounds=1, adapter=False)
        # Told to use Flower's local SuperLink, the second checkout refuses it in one line
        flower = ["--app", str(second), "--superlink", "flower", "-c", config]
        refused = car_fl_run(*flower, env=env, timeout=120)
        assert refused.returncode == 1
        [line] = refused.stderr.strip().splitlines()
        where = f"(PID {link.pid}, 127.0.0.1:{port}) runs the environment {bin_folder} in {first}"
        assert where in line, line
        # By default it runs on a SuperLink of its own: its results under its own folder
        done = car_fl_run("--app", str(second), "-c", config, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].endswith(COMPLETED)
        found = set(re.findall(r"results: (/\S+)", done.stdout + done.stderr))
        assert len(found) == 1, found
        [results] = found
        assert Path(results).parent == second / "runs"
        assert json.loads((Path(results) / "metrics.json").read_text())["summary"]["complete"]
        assert not (first / "runs").exists()
        # the first checkout's SuperLink never saw the run
        write_connection(first / "flwr", "first", f"127.0.0.1:{port}")
        listed = subprocess.run(
            [flwr_bin("flwr"), "ls", "first", "--format", "json"],
            env=flower_env(theirs),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(listed.stdout[listed.stdout.index("{") :])["runs"] == []
        assert left_behind(env) == []  # and nothing of the second's run is left
    finally:
        link.terminate()
        link.wait(timeout=30)


def following(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``car-fl run`` as from a terminal: its own process group, SIGINT as the shell leaves it."""
    return subprocess.Popen(
        [sys.executable, "-m", "car_fl.cli", "run", *args],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_training(env: dict[str, str], proc: subprocess.Popen[str]) -> None:
    """Until Ray's ClientApp actors run (the run is well under way)."""
    deadline = time.monotonic() + 300
    while not any("ClientAppActor" in line for line in left_behind(env)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no ClientApp actor within 300 s"
        time.sleep(0.5)
    time.sleep(2)  # a round or so


def test_a_stopped_run_leaves_no_process_behind(
    env: dict[str, str], ended: None, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    """SIGTERM to ``car-fl run`` alone: it, not the signal, must end the run, its own
    SuperLink and Ray. Ctrl-C takes the same path (``KeyboardInterrupt`` for ``Stopped``;
    its exit code and its one line: test_run.py's ``test_ctrl_c_stops_the_run_...``)."""
    config = run_config(tiny_llama, synthetic_tsv, rounds=500, adapter=True)
    proc = following(["-c", config], env)
    wait_for_training(env, proc)
    assert any("raylet" in line for line in left_behind(env))
    tick = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    seconds = time.monotonic() - tick
    assert proc.returncode == 143, stderr[-3000:]
    assert re.search(r"car-fl run: run \d+ stopped", stderr), stderr[-3000:]
    assert left_behind(env) == [], f"left {seconds:.0f} s after the signal"
    assert seconds < 45, seconds  # 8 to 10 s on a quiet 2-core machine


def test_flowers_local_superlink_is_refused_while_it_installs_and_keeps_no_ray_of_a_stopped_run(
    env: dict[str, str], ended: None, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    """Any plain ``flwr`` command on the ``local`` connection (``flwr run . local`` as much as
    the ``flwr ls local`` here: both go through Flower's ``ensure_local_superlink``) starts
    Flower's local SuperLink with dependency installation on; ``car-fl run --superlink
    flower`` refuses it in one line naming its PID. Once it is stopped (the recovery the line
    names), car-fl starts it again without installation and runs there. Stopped, the run's
    own exit handler (car_fl.server.simulation_exit) ends Ray in Flower's simulation process:
    what ``flwr run . local`` users get too. The SuperLink stays, as Flower keeps it; its
    unreaped simulation process is a zombie, not a running one."""
    port = int(env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])
    env = {**env, "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    config = run_config(tiny_llama, synthetic_tsv, rounds=500, adapter=True)
    try:
        plain = [flwr_bin("flwr"), "ls", "local", "--format", "json"]
        subprocess.run(plain, env=env, capture_output=True, timeout=120, check=False)
        pid = listener_pid(port)
        assert pid is not None  # Flower's local SuperLink, started with installation on
        refused = car_fl_run("--superlink", "flower", "-c", config, env=env, timeout=120)
        assert refused.returncode == 1
        [line] = refused.stderr.strip().splitlines()
        assert line.startswith("car-fl run: Flower's local SuperLink (PID ") and (
            f"stop it with `kill {pid}`" in line
        ), line
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while listener_pid(port) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        proc = following(["--superlink", "flower", "-c", config], env)
        wait_for_training(env, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 143, stderr[-3000:]
        assert re.search(r"car-fl run: run \d+ stopped", stderr), stderr[-3000:]
        deadline = time.monotonic() + 30
        kept = ("flower-superlink", "flower-superexec")
        while [c for c in left_behind(env) if not any(k in c for k in kept)]:
            assert time.monotonic() < deadline, left_behind(env)
            time.sleep(0.5)
    finally:
        pid = listener_pid(port)
        if pid is not None:  # the local SuperLink this test's run started
            os.kill(pid, signal.SIGTERM)
