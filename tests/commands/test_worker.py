"""``car-fl worker``: a wrong node config or a folder another worker serves ends it at once,
in one line ``car-fl worker: <reason>`` and exit code 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from car_fl.cli import main as cli_main
from car_fl.client.worker import listening


def test_a_node_config_without_the_nodes_place_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "w"
    code = cli_main(["worker", "--dir", str(folder), "--node-config", 'data-path="/d.tsv"'])
    assert code == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl worker: --node-config") and "partition-id=<integer>" in line
    assert not folder.exists()


def test_an_unknown_supernode_group_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "w"
    node = "partition-id=0 num-partitions=1"
    args = ["--supernode-group", "car-fl-no-such-group", "--node-config", node]
    assert cli_main(["worker", "--dir", str(folder), *args]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl worker: --supernode-group 'car-fl-no-such-group': no such")
    assert not folder.exists()


@pytest.mark.slow
def test_a_second_worker_for_the_same_folder_exits_in_one_line_saying_which_holds_it(
    short_dir: Path,
) -> None:
    node = "partition-id=0 num-partitions=1"
    cmd = [sys.executable, "-m", "car_fl.cli", "worker", "--dir", str(short_dir)]
    with listening(short_dir):  # a worker (this process) holds the folder
        for extra in ([], ["--no-restart"]):  # under a supervisor, or alone
            result = subprocess.run(
                [*cmd, "--node-config", node, *extra],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert result.returncode == 1, result.stderr
            [line] = result.stderr.strip().splitlines()
            assert line.startswith("car-fl worker: another car-fl worker"), line
