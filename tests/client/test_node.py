"""car_fl.client.node: one Node owns the data owner's side; no node state outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from car_fl.client.failures import BudgetExhausted, Refusal, RunTargetReached
from car_fl.client.node import Node
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import to_record
from car_fl.settings.compose import DATA_PATH, PRIVACY_POLICY

CLIENT = Path(__file__).resolve().parents[2] / "car_fl" / "client"
POLICY = 'modes = ["fixed"]\nmin-noise-multiplier = 1.0\nlifetime-epsilon = 100\n'


def module_level_mutables(path: Path) -> list[str]:
    """Names bound at a module's top level to a dict, list or set (literal or constructor)."""
    found = []
    for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        mutable = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            mutable = mutable or value.func.id in ("dict", "list", "set", "defaultdict")
        if mutable:
            found += [f"{path.name}: {ast.unparse(t)}" for t in targets]
    return found


def test_no_module_level_mutable_state_remains_on_the_nodes_side() -> None:
    """Node state lives in a Node (its settings, shards, policy and ledger), not in globals
    that outlive a run, a node config or a test."""
    modules = sorted(CLIENT.glob("*.py"))
    assert len(modules) > 10
    found = [name for path in modules for name in module_level_mutables(path)]
    assert found == []


def test_the_checker_finds_module_level_state(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("A = {}\nB: set[str] = set()\nC = (1, 2)\ndef f():\n    d = {}\n")
    assert module_level_mutables(module) == ["m.py: A", "m.py: B"]


def test_refusals_of_the_run_and_of_the_ledger_carry_their_own_fixed_code() -> None:
    assert Node.failure(RunTargetReached("run ε 8.1 > 8")) is Failure.RUN_TARGET_REACHED
    assert Node.failure(BudgetExhausted("record ε 101 > 100")) is Failure.BUDGET_EXHAUSTED
    assert Node.failure(Refusal(Failure.POLICY_REFUSED, "σ")) is Failure.POLICY_REFUSED
    assert Node.failure(KeyError("patient-4711")) is Failure.ROUND_FAILED


def test_a_long_lived_node_charges_the_records_a_grown_data_file_gained(tmp_path: Path) -> None:
    """The attacker's hope: a worker that opened the ledger's record set once would never
    charge the rows its owner appends later. The Node opens it again when the file changes."""
    policy, data = tmp_path / "policy.toml", tmp_path / "data.tsv"
    policy.write_text(POLICY, encoding="utf-8")
    data.write_text("ham\tfirst message\nspam\tsecond message\n", encoding="utf-8")
    node = Node({PRIVACY_POLICY: str(policy), DATA_PATH: str(data), "partition-id": 0})
    before = node._open_privacy()
    assert before is not None and node._open_privacy() is before  # unchanged files: kept
    with data.open("a", encoding="utf-8") as handle:
        handle.write("ham\ta third message, appended while the worker runs\n")
    after = node._open_privacy()
    assert after is not None and after is not before
    assert before.records < after.records and len(after.records) == len(before.records) + 1


def test_a_message_without_a_label_map_is_refused_before_the_node_reads_anything(
    tmp_path: Path,
) -> None:
    node = Node({"partition-id": 0, DATA_PATH: str(tmp_path / "missing.tsv")})
    head = {"head.classifier.weight": torch.zeros(3, 8), "head.classifier.bias": torch.zeros(3)}
    config = ConfigRecord({"server-round": 1, "fingerprint": "f"})
    content = RecordDict({"arrays": to_record(head), "config": config})
    with pytest.raises(Refusal) as err:
        node.answer(content, run_config={}, run="1")
    assert err.value.failure is Failure.CONFIG_MISMATCH
    assert node.shards == {} and node.settings_memory == {}
