"""car_fl.client.ledger: the node's lifetime ledger, its cap, its lock and its file."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from pathlib import Path

import pytest

from car_fl.client.failures import BudgetExhausted, LedgerError
from car_fl.client.ledger import (
    OLD_FORMAT,
    Ledger,
    data_key,
    record_keys,
)
from car_fl.privacy.accountant import Release, ReleaseKind
from car_fl.privacy.accountant import private_epsilon as epsilon

ONE = Release(ReleaseKind.GAUSSIAN, 1, noise_multiplier=1.0)
DELTA = 1e-5


RECORDS = frozenset({"a", "b"})


def spend(
    ledger: Ledger,
    *,
    run: str = "1",
    server_round: int = 1,
    cap: float | None = None,
    records: frozenset[str] = RECORDS,
):
    return ledger.spend(
        ONE,
        records=records,
        run=run,
        server_round=server_round,
        mode="fixed",
        delta=DELTA,
        cap=cap,
    )


def test_records_are_the_files_normalised_lines_whatever_their_order_or_place(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data.tsv"
    data.write_text("ham\thello  there\nspam\twin\n", encoding="utf-8")
    copy = Path(shutil.copy(data, tmp_path / "copy-elsewhere.tsv"))
    assert record_keys(data) == record_keys(copy) and len(record_keys(data)) == 2
    shuffled = tmp_path / "shuffled.tsv"
    shuffled.write_text("\nspam\twin\r\nham\thello there\n", encoding="utf-8")
    assert record_keys(shuffled) == record_keys(data)  # re-ordered, blank line, spaces
    data.write_text("ham\thello there\nspam\twin\nham\tone more\n", encoding="utf-8")
    assert record_keys(data) > record_keys(copy)  # grown: the old records are still there
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"text": "hi", "label": "ham"}\n', encoding="utf-8")
    other = tmp_path / "other.jsonl"
    other.write_text('{"label": "ham",  "text": "hi"}\n', encoding="utf-8")
    assert record_keys(jsonl) == record_keys(other)


def test_a_grown_shrunk_or_reordered_file_keeps_every_old_records_spend(
    tmp_path: Path,
) -> None:
    """The attacker's hole: keyed by the file's bytes, one appended row gave every old record
    a fresh lifetime budget."""
    ledger = Ledger.open(tmp_path)
    cap = epsilon([ONE] * 2, DELTA) * 1.001  # room for two releases per record
    old = frozenset({"a", "b", "c"})
    spend(ledger, cap=cap, records=old)
    spend(ledger, server_round=2, cap=cap, records=old)
    for changed in (old | {"d"}, frozenset({"a", "b"}), frozenset({"c", "e"})):
        with pytest.raises(BudgetExhausted, match="a record's lifetime ε"):
            spend(ledger, run="2", cap=cap, records=changed)
    # records never released have their whole budget: individual accounting
    spend(ledger, run="2", cap=cap, records=frozenset({"x", "y"}))
    spend(ledger, run="3", cap=cap, records=frozenset({"x", "y"}))
    assert ledger.epsilon(DELTA, {"d"}) == 0.0
    assert ledger.epsilon(DELTA, {"a", "x"}) == pytest.approx(epsilon([ONE] * 2, DELTA))
    assert len(ledger.entries()) == 4


def test_the_ledger_file_is_the_owners_only(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "ledger")
    spend(ledger)
    assert ledger.path.stat().st_mode & 0o777 == 0o600
    assert ledger.folder.stat().st_mode & 0o777 == 0o700


def _old_ledger(folder: Path, key: str) -> Path:
    entry = {
        "run": "1",
        "round": 1,
        "mode": "fixed",
        "release": ONE.to_dict(),
        "delta": DELTA,
        "epsilon": epsilon([ONE], DELTA),
        "time": "then",
    }
    path = folder / f"{key}.json"
    path.write_text(
        json.dumps({"format": OLD_FORMAT, "data_key": key, "entries": [entry]}), encoding="utf-8"
    )
    return path


def test_a_per_file_ledger_of_the_same_data_is_migrated_another_refuses_everything(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data.tsv"
    data.write_text("ham\thello\nspam\twin\n", encoding="utf-8")
    folder = tmp_path / "ledger"
    folder.mkdir()
    old = _old_ledger(folder, data_key(data))
    ledger = Ledger.open(folder)
    assert ledger.migrate(data_key(data), record_keys(data)) == 1
    assert not old.exists() and old.with_name(old.name + ".migrated").exists()
    assert [e.run for e in ledger.entries()] == ["1"]
    assert ledger.epsilon(DELTA, record_keys(data)) == pytest.approx(epsilon([ONE], DELTA))
    stale = _old_ledger(folder, "f" * 64)  # a data file the node no longer holds as it was
    with pytest.raises(LedgerError, match="cannot be tied to records"):
        spend(ledger, records=record_keys(data))
    assert stale.exists() and len(ledger.path.read_text(encoding="utf-8")) > 0


def test_every_release_is_listed_with_the_lifetime_epsilon_after_it(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "ledger")
    for r in (1, 2, 3):
        spend(ledger, server_round=r)
    entries = Ledger.open(tmp_path / "ledger").entries()  # read back from disk
    assert [(e.run, e.round, e.mode) for e in entries] == [
        ("1", 1, "fixed"),
        ("1", 2, "fixed"),
        ("1", 3, "fixed"),
    ]
    assert [e.epsilon for e in entries] == [
        pytest.approx(epsilon([ONE] * k, DELTA)) for k in (1, 2, 3)
    ]
    assert ledger.epsilon(DELTA) == entries[-1].epsilon


def test_the_cap_refuses_the_release_that_would_pass_it_and_records_nothing(
    tmp_path: Path,
) -> None:
    ledger = Ledger.open(tmp_path)
    cap = epsilon([ONE] * 2, DELTA) * 1.001
    spend(ledger, cap=cap)
    spend(ledger, server_round=2, cap=cap)
    with pytest.raises(BudgetExhausted, match=r"lifetime ε to .* > lifetime-epsilon"):
        spend(ledger, server_round=3, cap=cap)
    assert len(ledger.entries()) == 2


def test_a_check_under_the_lock_can_refuse_first(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)

    def refuse(entries: list) -> None:
        raise PermissionError(f"{len(entries)} entries")

    with pytest.raises(PermissionError, match="0 entries"):
        ledger.spend(
            ONE,
            records=RECORDS,
            run="1",
            server_round=1,
            mode="fixed",
            delta=DELTA,
            cap=None,
            check=refuse,
        )
    assert ledger.entries() == []


def test_an_unreadable_ledger_refuses_everything_and_is_never_reset(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    spend(ledger)
    ledger.path.write_text("{ half a file", encoding="utf-8")
    with pytest.raises(LedgerError, match=r"cannot be read.*never reset"):
        spend(ledger, server_round=2)
    assert ledger.path.read_text(encoding="utf-8") == "{ half a file"


def _spend_until_refused(folder: str, cap: float, start, results) -> None:  # a process
    ledger = Ledger.open(folder)
    start.wait()
    made = 0
    for r in range(1, 11):
        try:
            spend(ledger, run=f"{multiprocessing.current_process().name}", server_round=r, cap=cap)
            made += 1
        except BudgetExhausted:
            pass
    results.put(made)


@pytest.mark.slow
def test_two_processes_at_once_cannot_both_spend_the_same_budget(tmp_path: Path) -> None:
    cap = epsilon([ONE] * 6, DELTA) * 1.0001  # room for exactly 6 releases in all
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(3), context.Queue()
    workers = [
        context.Process(
            target=_spend_until_refused, args=(str(tmp_path), cap, start, results), name=f"run{i}"
        )
        for i in range(3)
    ]
    for worker in workers:
        worker.start()
    made = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert sum(made) == 6  # 30 attempts, 6 releases: never one more than the cap allows
    entries = Ledger.open(tmp_path).entries()
    assert len(entries) == 6 and entries[-1].epsilon <= cap
    # consistent: each entry's ε is the composition of it and every release before it
    assert [e.epsilon for e in entries] == [
        pytest.approx(epsilon([ONE] * k, DELTA)) for k in range(1, 7)
    ]


def _hold_the_check(entries: list) -> None:  # under the lock: widen the read-to-write window
    time.sleep(0.5)


def _spend_once(folder: str, cap: float, start, results) -> None:  # a process
    ledger = Ledger.open(folder)
    name = multiprocessing.current_process().name
    start.wait()
    try:
        ledger.spend(
            ONE,
            records=RECORDS,
            run=name,
            server_round=1,
            mode="fixed",
            delta=DELTA,
            cap=cap,
            check=_hold_the_check,
        )
        results.put((name, "spent"))
    except BudgetExhausted:
        results.put((name, "refused"))


@pytest.mark.slow
def test_of_two_runs_spending_at_once_only_one_gets_a_budget_that_allows_one(
    tmp_path: Path,
) -> None:
    """Two OS processes, released together, each read the ledger, wait half a second and
    write: without the lock both would see an empty ledger and both spend."""
    cap = epsilon([ONE], DELTA) * 1.0001  # room for exactly one release
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    runs = [
        context.Process(target=_spend_once, args=(str(tmp_path), cap, start, results), name=name)
        for name in ("run-a", "run-b")
    ]
    for run in runs:
        run.start()
    outcome = dict(results.get(timeout=120) for _ in runs)
    for run in runs:
        run.join(timeout=60)
    assert sorted(outcome.values()) == ["refused", "spent"]
    entries = Ledger.open(tmp_path).entries()
    assert [e.run for e in entries] == [run for run, said in outcome.items() if said == "spent"]
    assert entries[0].epsilon == pytest.approx(epsilon([ONE], DELTA))
