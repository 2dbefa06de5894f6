"""car_fl.client.ledger: the node's lifetime ledger, its cap, its lock and its file."""

from __future__ import annotations

import multiprocessing
import shutil
import time
from pathlib import Path

import pytest

from car_fl.client.ledger import (
    BudgetExhausted,
    Ledger,
    LedgerError,
    data_key,
)
from car_fl.privacy.composition import Release, ReleaseKind, epsilon

ONE = Release(ReleaseKind.GAUSSIAN, 1, noise_multiplier=1.0)
DELTA = 1e-5


def spend(ledger: Ledger, *, run: str = "1", server_round: int = 1, cap: float | None = None):
    return ledger.spend(ONE, run=run, server_round=server_round, mode="fixed", delta=DELTA, cap=cap)


def test_the_key_is_the_data_files_content_not_its_name(tmp_path: Path) -> None:
    data = tmp_path / "data.tsv"
    data.write_text("ham\thello\n", encoding="utf-8")
    copy = Path(shutil.copy(data, tmp_path / "copy-elsewhere.tsv"))
    assert data_key(data) == data_key(copy)
    data.write_text("ham\thello\nspam\twin\n", encoding="utf-8")
    assert data_key(data) != data_key(copy)


def test_every_release_is_listed_with_the_lifetime_epsilon_after_it(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path / "ledger", "k")
    for r in (1, 2, 3):
        spend(ledger, server_round=r)
    entries = Ledger.open(tmp_path / "ledger", "k").entries()  # read back from disk
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
    ledger = Ledger.open(tmp_path, "k")
    cap = epsilon([ONE] * 2, DELTA) * 1.001
    spend(ledger, cap=cap)
    spend(ledger, server_round=2, cap=cap)
    with pytest.raises(BudgetExhausted, match=r"lifetime ε to .* > lifetime-epsilon"):
        spend(ledger, server_round=3, cap=cap)
    assert len(ledger.entries()) == 2


def test_a_check_under_the_lock_can_refuse_first(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, "k")

    def refuse(entries: list) -> None:
        raise PermissionError(f"{len(entries)} entries")

    with pytest.raises(PermissionError, match="0 entries"):
        ledger.spend(
            ONE, run="1", server_round=1, mode="fixed", delta=DELTA, cap=None, check=refuse
        )
    assert ledger.entries() == []


def test_an_unreadable_ledger_refuses_everything_and_is_never_reset(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, "k")
    spend(ledger)
    ledger.path.write_text("{ half a file", encoding="utf-8")
    with pytest.raises(LedgerError, match=r"cannot be read.*never reset"):
        spend(ledger, server_round=2)
    assert ledger.path.read_text(encoding="utf-8") == "{ half a file"


def _spend_until_refused(folder: str, cap: float, start, results) -> None:  # a process
    ledger = Ledger.open(folder, "shared")
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
    entries = Ledger.open(tmp_path, "shared").entries()
    assert len(entries) == 6 and entries[-1].epsilon <= cap
    # consistent: each entry's ε is the composition of it and every release before it
    assert [e.epsilon for e in entries] == [
        pytest.approx(epsilon([ONE] * k, DELTA)) for k in range(1, 7)
    ]


def _hold_the_check(entries: list) -> None:  # under the lock: widen the read-to-write window
    time.sleep(0.5)


def _spend_once(folder: str, cap: float, start, results) -> None:  # a process
    ledger = Ledger.open(folder, "shared")
    name = multiprocessing.current_process().name
    start.wait()
    try:
        ledger.spend(
            ONE, run=name, server_round=1, mode="fixed", delta=DELTA, cap=cap, check=_hold_the_check
        )
        results.put((name, "spent"))
    except BudgetExhausted:
        results.put((name, "refused"))


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
    entries = Ledger.open(tmp_path, "shared").entries()
    assert [e.run for e in entries] == [run for run, said in outcome.items() if said == "spent"]
    assert entries[0].epsilon == pytest.approx(epsilon([ONE], DELTA))
