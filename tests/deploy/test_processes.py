"""car_fl.deploy.processes and .cluster: processes by PID, a cluster's command lines.

Fast: the processes here are ``sleep``, ``sh`` and short Python scripts, never Flower (the real
SuperLink and SuperNodes run in ``tests/deploy/test_deployment.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from car_fl.deploy.cluster import LocalCluster
from car_fl.deploy.processes import Processes

PRINT_ARGS = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_processes_are_recorded_and_stopped_by_pid_with_their_children(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    try:
        procs.start("superlink", ["sleep", "60"])
        # a node whose child (like a ClientApp) prints its PID, then both sleep
        procs.start("supernode-0", ["sh", "-c", "sleep 60 & echo $!; wait"])
        deadline = time.monotonic() + 10
        while not procs.log("supernode-0").strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(procs.log("supernode-0").split()[0])
        # another program (`local_cluster.py stop`) finds them in cluster.json
        other = Processes.load(tmp_path)
        assert other.pids == procs.pids and set(other.pids) == {"superlink", "supernode-0"}
        assert other.alive("superlink") and procs.alive("supernode-0")
        with pytest.raises(ValueError, match="already running"):
            procs.start("superlink", ["sleep", "1"])
        pids = dict(procs.pids)
        procs.stop()
        assert procs.pids == {} and Processes.load(tmp_path).pids == {}
        assert not procs.alive("superlink")
        for pid in (*pids.values(), child):
            deadline = time.monotonic() + 10
            while not gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gone(pid), f"PID {pid} survived stop()"
    finally:
        procs.stop()


def test_a_child_that_ignores_sigterm_is_killed_with_its_group(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    try:
        # the leader ends on SIGTERM; its child (like a stuck ClientApp) ignores it
        procs.start("supernode-0", ["sh", "-c", "sh -c 'trap \"\" TERM; sleep 60' & echo $!; wait"])
        deadline = time.monotonic() + 10
        while not procs.log("supernode-0").strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(procs.log("supernode-0").split()[0])
        time.sleep(0.3)  # the child has set its trap
        procs.kill("supernode-0", timeout=2.0)
        deadline = time.monotonic() + 10
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), f"PID {child} ignored SIGTERM and survived kill()"
    finally:
        procs.stop()


def test_exit_code_and_kill_with_a_signal(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    try:
        procs.start("fails", ["sh", "-c", "exit 3"])
        assert procs.exit_code("fails", timeout=10) == 3
        procs.start("sleeper", ["sleep", "60"])
        assert procs.exit_code("sleeper", timeout=0.5) is None
        procs.kill("sleeper", signal.SIGKILL)
        assert "sleeper" not in procs.pids
    finally:
        procs.stop()


def test_load_without_a_cluster_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no cluster was started"):
        Processes.load(tmp_path)


def test_cluster_ports_environment_and_node_command(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, connection="c", ports=7100, env={"EXTRA": "1"})
    assert (cluster.fleet, cluster.control) == ("127.0.0.1:7100", "127.0.0.1:7101")
    assert cluster.env["FLWR_HOME"] == str(tmp_path / "flwr") and cluster.env["EXTRA"] == "1"
    assert cluster.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    try:
        # PRINT_ARGS in front: the node's command line lands in its log instead of running
        first = cluster.start_node(2, 3, data=Path("d.tsv"), device="cpu", prefix=PRINT_ARGS)
        again = cluster.start_node(2, 3, data=Path("d.tsv"), prefix=PRINT_ARGS)
        assert (first, again) == ("supernode-2", "supernode-2-1")
        for name in (first, again):
            assert cluster.processes.exit_code(name, timeout=10) == 0
        cmd = json.loads(cluster.processes.log(first))
    finally:
        cluster.stop()
    assert Path(cmd[0]).name == "flower-supernode"
    assert cmd[cmd.index("--superlink") + 1] == "127.0.0.1:7100"
    assert cmd[cmd.index("--port") + 1] == "7112"  # ports + 10 + partition
    assert "--insecure" in cmd
    node_config = cmd[cmd.index("--node-config") + 1]
    assert node_config.startswith("partition-id=2 num-partitions=3 ")
    assert f'cache-dir="{tmp_path / "cache-2"}"' in node_config
    assert f'data-path="{Path("d.tsv").resolve()}"' in node_config
    assert 'device="cpu"' in node_config


def test_free_ports_differ_and_attach_finds_the_pids(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "a")
    assert cluster.fleet_port != cluster.control_port
    with pytest.raises(FileNotFoundError, match="no SuperLink was started in"):
        LocalCluster.attach(tmp_path / "a")
    try:
        cluster.save_network()
        cluster.processes.start("superlink", ["sleep", "60"])
        attached = LocalCluster.attach(tmp_path / "a")
        assert attached.processes.pids == cluster.processes.pids
        assert attached.env["FLWR_HOME"] == str(tmp_path / "a" / "flwr")
        attached.stop()
        assert LocalCluster.attach(tmp_path / "a").processes.pids == {}
    finally:
        cluster.stop()


def test_a_superlink_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"^superlink exited: .*flower-superlink[^\n]*$"):
            cluster.start_superlink(prefix=PRINT_ARGS, timeout=30)
    finally:
        cluster.stop()


def test_start_on_a_busy_port_names_it_and_leaves_nothing_running(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        cluster = LocalCluster(tmp_path, ports=port)
        with pytest.raises(RuntimeError, match=rf"^port {port} on 127.0.0.1 \(Fleet API\) is"):
            cluster.start(2, data=tmp_path / "d.tsv")
    assert cluster.processes.pids == {} and not (tmp_path / "cluster.json").exists()


class NodesFail(LocalCluster):
    """A cluster whose SuperLink (a stand-in) starts and whose first SuperNode fails."""

    superlink_pid = 0

    def start_superlink(self, **kwargs: Any) -> None:
        self.superlink_pid = self.processes.start("superlink", ["sleep", "60"])

    def start_node(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("supernode-0 exited: ERROR something went wrong")


def test_a_cluster_that_fails_half_way_stops_what_it_started(tmp_path: Path) -> None:
    cluster = NodesFail(tmp_path)
    with pytest.raises(RuntimeError, match="supernode-0 exited"):
        cluster.start(1, data=tmp_path / "d.tsv")
    assert cluster.processes.pids == {} and gone(cluster.superlink_pid)


def test_start_superlink_waits_until_both_apis_listen(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    # a stand-in SuperLink: listens on the fleet port at once, on the control port 1 s later
    script = (
        "import socket, time\n"
        f"a = socket.create_server(('127.0.0.1', {cluster.fleet_port}))\n"
        "time.sleep(1)\n"
        f"b = socket.create_server(('127.0.0.1', {cluster.control_port}))\n"
        "time.sleep(60)\n"
    )
    try:
        tick = time.monotonic()
        cluster.start_superlink(prefix=[sys.executable, "-c", script], timeout=30)
        assert time.monotonic() - tick >= 1.0
        with socket.create_connection(("127.0.0.1", cluster.control_port), timeout=1):
            pass
        assert (tmp_path / "flwr" / "config.toml").is_file()
        # another program attaching to this folder reaches the same SuperLink
        attached = LocalCluster.attach(tmp_path)
        assert (attached.fleet, attached.control) == (cluster.fleet, cluster.control)
        assert attached.processes.pids == cluster.processes.pids
    finally:
        cluster.stop()
    assert cluster.processes.pids == {}


def test_local_cluster_script_on_a_busy_port_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "local_cluster.py"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                *[sys.executable, str(script), "start", "--dir", str(tmp_path / "c")],
                *["--nodes", "1", "--data", str(tmp_path / "d.tsv"), "--port", str(port)],
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"local_cluster.py start: port {port} on 127.0.0.1 (Fleet API) is already in use; stop "
        "what holds it or start the cluster on other ports (--port)"
    ]
    assert not (tmp_path / "c" / "cluster.json").exists()  # nothing was started


def test_local_cluster_run_writes_its_results_where_it_says(tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "scripts" / "local_cluster.py"
    spec = importlib.util.spec_from_file_location("local_cluster", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overrides, out = module.results_folder(tmp_path, "model=minilm fl.clients=3")
    assert out.parent == tmp_path / "runs"  # absolute: not the SuperLink's own folder
    assert overrides == f"model=minilm fl.clients=3 output_dir={out}"
    given = module.results_folder(tmp_path, f"output_dir={tmp_path / 'mine'} model=minilm")
    assert given == (f"output_dir={tmp_path / 'mine'} model=minilm", tmp_path / "mine")
