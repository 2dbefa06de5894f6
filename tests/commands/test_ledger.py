"""car_fl.commands.ledger: the owner reads every release of its data and the lifetime ε."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.cli import main
from car_fl.client.ledger import Ledger, record_keys
from car_fl.client.policy import NodePolicy
from car_fl.privacy.accountant import Release, ReleaseKind


def node(tmp_path: Path) -> tuple[Path, Path, Ledger]:
    policy, data = tmp_path / "policy.toml", tmp_path / "data.tsv"
    policy.write_text('modes = ["fixed"]\nlifetime-epsilon = 50\n', encoding="utf-8")
    data.write_text("ham\thello\nspam\twin now\n", encoding="utf-8")
    return policy, data, Ledger.open(NodePolicy.load(policy).ledger)


def test_the_ledger_lists_every_release_as_a_table_and_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy, data, ledger = node(tmp_path)
    for run, server_round in (("7", 1), ("7", 2), ("8", 1)):
        ledger.spend(
            Release(ReleaseKind.GAUSSIAN, 1, noise_multiplier=1.0),
            records=record_keys(data),
            run=run,
            server_round=server_round,
            mode="fixed",
            delta=1e-5,
            cap=50.0,
        )
    assert main(["ledger", str(policy), str(data), "--json"]) == 0
    content = json.loads(capsys.readouterr().out)
    assert [(e["run"], e["round"]) for e in content["entries"]] == [("7", 1), ("7", 2), ("8", 1)]
    assert content["lifetime_epsilon"] == pytest.approx(content["entries"][-1]["epsilon"])
    assert content["cap"] == 50.0
    assert main(["ledger", str(policy), str(data)]) == 0
    table = capsys.readouterr().out
    assert "3 rounds released" in table and "lifetime ε" in table and "cap 50" in table


def test_a_missing_data_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy, _, _ = node(tmp_path)
    assert main(["ledger", str(policy), str(tmp_path / "none.tsv")]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("car-fl ledger: ") and "none.tsv is not a file" in line
