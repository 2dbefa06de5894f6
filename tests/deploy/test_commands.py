"""car_fl.deploy.commands: Flower command lines and node-config strings (no processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from flwr.common.config import parse_config_args

from car_fl.client.worker_link import worker_folder
from car_fl.deploy import commands
from car_fl.deploy.certs import TLSFiles
from car_fl.deploy.cluster import LocalCluster
from car_fl.deploy.commands import (
    FLOWER_EXECUTABLES,
    FlowerNotFound,
    check_flower,
    exposure_warning,
    flower_env,
    flwr_bin,
    is_loopback,
    node_config_string,
    pinned,
    superexec_command,
    superlink_command,
    supernode_command,
    worker_command,
)
from car_fl.settings.compose import NODE_CONFIG, NodeInfo, apply_node_config, load_settings

#: The node-config keys that set a value on the node (paths, device, cache).
NODE_CONFIG_KEYS = [key for key, spec in NODE_CONFIG.items() if spec.setting is not None]


def flag(cmd: list[str], name: str) -> str:
    """The value after ``name`` in ``cmd`` (which must hold it once)."""
    assert cmd.count(name) == 1, cmd
    return cmd[cmd.index(name) + 1]


TLS = TLSFiles(Path("/c/ca.crt"), Path("/c/server.pem"), Path("/c/server.key"))


def test_superlink_command_insecure_by_default_with_state_database() -> None:
    cmd = superlink_command(
        fleet_address="127.0.0.1:7001", control_host="127.0.0.1", control_port=7002, database="s.db"
    )
    assert Path(cmd[0]).name == "flower-superlink"
    assert flag(cmd, "--fleet-api-address") == "127.0.0.1:7001"
    assert (flag(cmd, "--host"), flag(cmd, "--port")) == ("127.0.0.1", "7002")
    assert flag(cmd, "--database") == "s.db"
    assert flag(cmd, "--isolation") == "subprocess"
    assert "--insecure" in cmd and "--disable-runtime-dependency-installation" in cmd
    assert not any(arg.startswith("--ssl") for arg in cmd)


def test_superlink_command_with_tls_and_node_auth() -> None:
    cmd = superlink_command(tls=TLS, node_auth=True, isolation="process")
    assert flag(cmd, "--ssl-ca-certfile") == "/c/ca.crt"
    assert flag(cmd, "--ssl-certfile") == "/c/server.pem"
    assert flag(cmd, "--ssl-keyfile") == "/c/server.key"
    assert "--enable-supernode-auth" in cmd and "--insecure" not in cmd
    assert flag(cmd, "--isolation") == "process"


def test_node_auth_without_tls_is_refused() -> None:
    with pytest.raises(ValueError, match="needs TLS"):
        superlink_command(node_auth=True)


def test_superexec_command() -> None:
    insecure = superexec_command(runtime_address="127.0.0.1:7002")
    assert Path(insecure[0]).name == "flower-superexec"
    assert flag(insecure, "--runtime-api-address") == "127.0.0.1:7002" and "--insecure" in insecure
    secure = superexec_command(runtime_address="h:1", root_cert=Path("/c/ca.crt"))
    assert flag(secure, "--root-certificates") == "/c/ca.crt" and "--insecure" not in secure


def test_supernode_command_options() -> None:
    plain = supernode_command(superlink="h:9092", node_config="partition-id=0 num-partitions=1")
    assert Path(plain[0]).name == "flower-supernode"
    assert flag(plain, "--superlink") == "h:9092" and flag(plain, "--port") == "9094"
    assert flag(plain, "--node-config") == "partition-id=0 num-partitions=1"
    assert "--insecure" in plain
    assert not {
        "--max-retries",
        "--max-wait-time",
        "--auth-supernode-private-key",
        "--trusted-entities",
    } & set(plain)
    full = supernode_command(
        superlink="h:9092",
        node_config="",
        runtime_port=7010,
        root_cert=Path("/c/ca.crt"),
        private_key=Path("/k/node0.key"),
        max_retries=2,
        max_wait_time=30,
        trusted_entities=Path("/k/trusted.yaml"),
    )
    assert flag(full, "--trusted-entities") == "/k/trusted.yaml"
    assert flag(full, "--port") == "7010" and flag(full, "--root-certificates") == "/c/ca.crt"
    assert flag(full, "--auth-supernode-private-key") == "/k/node0.key"
    assert (flag(full, "--max-retries"), flag(full, "--max-wait-time")) == ("2", "30")
    assert "--insecure" not in full


def test_node_config_string_is_read_back_by_the_client(tmp_path: Path) -> None:
    """Parsed as flower-supernode parses it, the client finds its shard and local values."""
    text = node_config_string(
        partition_id=1,
        num_partitions=3,
        data_path=tmp_path / "my data.tsv",
        test_data_path=tmp_path / "test.tsv",
        model_path=tmp_path / "model",
        device="cpu",
        cache_dir=tmp_path / "cache",
        data_is_shard=True,
    )
    node_config = parse_config_args([text])
    settings = load_settings(["fl.clients=3"])
    assert NodeInfo.from_node_config(node_config, settings) == NodeInfo(1, 3, data_is_shard=True)
    local = apply_node_config(settings, node_config)
    assert local.dataset.path == str(tmp_path / "my data.tsv")
    assert local.dataset.test_path == str(tmp_path / "test.tsv")
    assert local.model.name_or_path == str(tmp_path / "model")
    assert local.device == "cpu"
    assert local.cache_dir == str(tmp_path / "cache")


def test_node_config_string_covers_every_key_the_client_applies() -> None:
    values: dict[str, Any] = {key.replace("-", "_"): "/x" for key in NODE_CONFIG_KEYS}
    node_config = parse_config_args(
        [node_config_string(partition_id=0, num_partitions=1, **values)]
    )
    assert set(node_config) == {"partition-id", "num-partitions", *NODE_CONFIG_KEYS}
    assert "data-is-shard" not in node_config


def test_node_config_string_leaves_out_none_and_makes_paths_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    text = node_config_string(partition_id=0, num_partitions=2, data_path="d.tsv", device=None)
    assert parse_config_args([text]) == {
        "partition-id": 0,
        "num-partitions": 2,
        "data-path": str(tmp_path / "d.tsv"),
    }


def test_a_nodes_worker_folder_travels_in_its_node_config_and_its_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    text = node_config_string(partition_id=0, num_partitions=2, worker="w0")
    node_config = parse_config_args([text])
    assert worker_folder(node_config) == tmp_path / "w0"
    # the worker gets the node's own config (without a worker key), restarted unless told
    mine = node_config_string(partition_id=0, num_partitions=2, data_path="d.tsv")
    cmd = worker_command(folder=Path("w0"), node_config=mine)
    assert cmd[1:5] == ["-m", "car_fl.cli", "worker", "--dir"]
    assert flag(cmd, "--dir") == str(tmp_path / "w0") and flag(cmd, "--node-config") == mine
    assert "--no-restart" not in cmd
    assert worker_command(folder=Path("w0"), node_config=mine, restart=False)[-1] == "--no-restart"


def test_a_nodes_privacy_policy_travels_in_its_node_config_to_the_node_privacy_guard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from car_fl.client.node_privacy import NodePrivacy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy.toml").write_text('modes = ["record"]\n', encoding="utf-8")
    (tmp_path / "d.tsv").write_text("ham\thello\n", encoding="utf-8")
    text = node_config_string(
        partition_id=0, num_partitions=2, data_path="d.tsv", privacy_policy="policy.toml"
    )
    guard = NodePrivacy.from_node_config(parse_config_args([text]))
    assert guard is not None and guard.policy.source == tmp_path / "policy.toml"


def test_node_config_string_rejects_unknown_values_and_quotes() -> None:
    with pytest.raises(ValueError, match=r"unknown node-config values \['data_file'\]"):
        node_config_string(partition_id=0, num_partitions=1, data_file="x")
    with pytest.raises(ValueError, match="cannot hold"):
        node_config_string(partition_id=0, num_partitions=1, device='c"pu')


def test_pinned() -> None:
    assert pinned(["python", "x.py"], None) == ["python", "x.py"]
    assert pinned(["python", "x.py"], 3) == ["taskset", "-c", "3", "python", "x.py"]


def test_a_superlink_listens_on_loopback_unless_told_otherwise() -> None:
    cmd = superlink_command()
    assert flag(cmd, "--fleet-api-address").startswith("127.0.0.1:")
    assert flag(cmd, "--host") == "127.0.0.1"
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.10", "aggregator.local"))


def test_a_network_address_without_tls_needs_insecure_and_then_warns() -> None:
    assert exposure_warning("127.0.0.1", tls=False, insecure=False) is None
    assert exposure_warning("0.0.0.0", tls=True, insecure=False) is None
    with pytest.raises(ValueError, match=r"--bind 0.0.0.0 without --certs .* --insecure"):
        exposure_warning("0.0.0.0", tls=False, insecure=False)
    warning = exposure_warning("192.168.1.10", tls=False, insecure=True)
    assert warning is not None and "without TLS" in warning


SUPERLINK_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "superlink.py"


@pytest.mark.parametrize(
    ("args", "code", "address", "stderr"),
    [
        ((), 0, "127.0.0.1", ""),
        (("--bind", "0.0.0.0"), 1, None, "superlink.py: --bind 0.0.0.0 without --certs"),
        (("--bind", "0.0.0.0", "--insecure"), 0, "0.0.0.0", "warning: the SuperLink listens"),
    ],
)
def test_the_superlink_script_defaults_to_loopback_and_refuses_an_open_insecure_address(
    args: tuple[str, ...], code: int, address: str | None, stderr: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(SUPERLINK_SCRIPT), *args, "--print"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == code, done.stderr
    if address is not None:
        cmd = done.stdout.split()
        assert flag(cmd, "--host") == address and flag(cmd, "--fleet-api-address").startswith(
            f"{address}:"
        )
    lines = done.stderr.strip().splitlines()
    assert (lines == []) if not stderr else (len(lines) == 1 and lines[0].startswith(stderr))


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def venv_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake venv's ``bin`` that ``sys.executable`` lives in, with an empty ``PATH``."""
    bin_dir = tmp_path / "venv" / "bin"
    monkeypatch.setattr(commands.sys, "executable", str(executable(bin_dir / "python")))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return bin_dir


def test_flower_executables_are_found_beside_the_running_python_before_path(
    venv_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = executable(tmp_path / "elsewhere" / "flwr")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert flwr_bin("flwr") == str(on_path)  # not beside the Python: from PATH
    for name in FLOWER_EXECUTABLES:
        executable(venv_python / name)
    assert flwr_bin("flwr") == str(venv_python / "flwr")  # beside it wins
    assert Path(superlink_command()[0]) == venv_python / "flower-superlink"
    check_flower()


def test_a_missing_flower_executable_fails_in_one_line_naming_it_and_where_it_looked(
    venv_python: Path, tmp_path: Path
) -> None:
    executable(venv_python / "flwr")
    with pytest.raises(FlowerNotFound) as err:
        check_flower()
    message = str(err.value)
    assert "'flower-superlink'" in message and str(venv_python) in message
    assert "\n" not in message
    # A cluster checks before it starts anything
    cluster = LocalCluster(tmp_path / "cluster", ports=None)
    with pytest.raises(FlowerNotFound, match="flower-superlink"):
        cluster.start(1, data=tmp_path / "data.tsv")
    assert cluster.processes.pids == {}


def test_flower_processes_get_the_running_pythons_folder_first_on_path(
    venv_python: Path,
) -> None:
    here = str(venv_python)
    env = flower_env({"PATH": f"/usr/bin{os.pathsep}{here}{os.pathsep}/bin", "X": "1"})
    assert env["PATH"].split(os.pathsep) == [here, "/usr/bin", "/bin"] and env["X"] == "1"
    assert flower_env({})["PATH"] == here
    # A cluster's processes (SuperLink, SuperNodes, flwr) all get it
    assert LocalCluster(venv_python / "c").env["PATH"].split(os.pathsep)[0] == here


def run_with_a_busy_port(script: Path, *args: str) -> tuple[int, subprocess.CompletedProcess]:
    """``script`` run with ``args`` and a port this test holds (``{port}`` in ``args``)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, str(script), *(a.format(port=port) for a in args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    return port, done


def assert_one_line_naming(done: subprocess.CompletedProcess, flag_name: str, port: int) -> None:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and flag_name in lines[0] and str(port) in lines[0], lines
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize("flag_name", ["--fleet-port", "--control-port"])
def test_a_busy_port_is_one_line_naming_the_flag_to_change(flag_name: str) -> None:
    """Issue 43: with 9092 taken the script exited 3 after a ~45-line uvicorn traceback that
    never named --fleet-port or --control-port."""
    from car_fl.deploy.ports import free_port

    other = "--control-port" if flag_name == "--fleet-port" else "--fleet-port"
    port, done = run_with_a_busy_port(
        SUPERLINK_SCRIPT, flag_name, "{port}", other, str(free_port())
    )
    assert_one_line_naming(done, flag_name, port)


def test_a_busy_runtime_port_of_the_supernode_script_names_its_flag() -> None:
    script = SUPERLINK_SCRIPT.parent / "supernode.py"
    args = ("--superlink", "127.0.0.1:9092", "--partition-id", "0", "--num-partitions", "1")
    port, done = run_with_a_busy_port(script, *args, "--port", "{port}")
    assert_one_line_naming(done, "--port", port)
