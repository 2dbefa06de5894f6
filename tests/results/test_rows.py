"""Typed results (car_fl.results.rows): rows and summaries write and read the files' format."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from car_fl.results.rows import (
    CLIENTS_CSV,
    METRICS_CSV,
    METRICS_JSON,
    ClientDP,
    ClientRow,
    MetricsFile,
    RoundRow,
    RunSummary,
    wire_key,
)
from car_fl.server.privacy_check import client_rows_of
from car_fl.server.strategy import RoundStats
from car_fl.settings.schema import Mode

#: Files written by car-fl before the typed rows (a 2-round federation with dp=record, a
#: 2-epoch centralised run, a kNN run that trains nothing): the format to keep.
FORMAT = Path(__file__).parent / "fixtures" / "results-format"
RUNS = ("federated", "centralized", "untrained")


@pytest.mark.parametrize("run", RUNS)
def test_files_of_the_previous_format_read_back_and_write_byte_for_byte(
    run: str, tmp_path: Path
) -> None:
    metrics = MetricsFile.read(FORMAT / run)
    metrics.write(tmp_path)
    for name in (METRICS_JSON, METRICS_CSV):
        assert (tmp_path / name).read_text() == (FORMAT / run / name).read_text(), name
    if (FORMAT / run / CLIENTS_CSV).is_file():
        ClientRow.write_csv(tmp_path / CLIENTS_CSV, ClientRow.read_csv(FORMAT / run / CLIENTS_CSV))
        old = list(csv.DictReader((FORMAT / run / CLIENTS_CSV).open()))
        new = list(csv.DictReader((tmp_path / CLIENTS_CSV).open()))
        # The columns since added (the server's ε check) come last, empty for old rows.
        added = ["server_epsilon", "claim_mismatch"]
        assert [list(row) for row in new] == [[*row, *added] for row in old]
        assert all(row[column] == "" for row in new for column in added)
        for before, after in zip(old, new, strict=True):
            for column, cell in before.items():
                if column in ClientRow.INTEGER_COLUMNS and cell:  # 144.0 is now written 144
                    assert after[column] == str(int(float(cell))), column
                else:
                    assert after[column] == cell, column


def test_a_federated_metrics_file_reads_as_typed_rows() -> None:
    metrics = MetricsFile.read(FORMAT / "federated")
    summary = metrics.summary
    assert summary.kind == "federated" and summary.complete is True
    assert [row.round for row in metrics.history] == [1, 2]
    assert summary.final == metrics.history[-1]
    assert summary.final.metrics["test_top1"] == pytest.approx(0.1375, abs=1e-6)
    assert summary.final.clients_ok == 2 and summary.final.dp_active == 1
    # Under DP no train metric reaches the server: NaN, not missing.
    assert math.isnan(metrics.history[0].train_loss or 0.0)
    assert summary.initial is not None and "test_top1" in summary.initial
    assert set(summary.dp_clients) == {0, 1}  # partition ids, JSON strings read back as ints
    assert summary.dp_clients[0] == ClientDP(
        noise_multiplier=0.91796875, sample_rate=0.05, steps=40.0, epsilon=summary.epsilon or 0.0
    )
    rows = ClientRow.read_csv(FORMAT / "federated" / CLIENTS_CSV)
    assert rows[0].partition_id == 0.0 and rows[0].dp_releases is None
    assert rows[0].train_loss is None  # an empty cell


def test_centralised_summaries_carry_no_federation_fields() -> None:
    summary = MetricsFile.read(FORMAT / "centralized").summary
    written = summary.to_dict()
    assert summary.kind == "centralized" and summary.epochs == 2
    for key in ("rounds", "initial", "skipped_rounds", "epsilon", "dp_clients"):
        assert key not in written
    assert "complete" not in written  # written before centralised runs said so (resume=)
    row = MetricsFile.read(FORMAT / "untrained").history[0]
    assert row.train_loss is None and "train_loss" not in row.to_dict()  # nothing trained
    assert list(row.to_dict())[:2] == ["round", "epochs"]


def test_round_rows_keep_columns_they_do_not_know() -> None:
    raw = {"round": 3, "epochs": 6, "test_top1": 0.5, "seconds": 1.0, "new_column": "x"}
    row = RoundRow.from_dict(raw)
    assert row.metrics == {"test_top1": 0.5} and row.extra == {"new_column": "x"}
    assert row.to_dict() == {
        "round": 3,
        "epochs": 6,
        "test_top1": 0.5,
        "seconds": 1.0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "new_column": "x",
    }


def test_client_rows_map_wire_keys_to_file_columns(tmp_path: Path) -> None:
    stats = RoundStats(round=4, started=0.0, asked=[7, 8, 9])
    stats.bytes_sent = {7: 100, 8: 100, 9: 100}
    stats.bytes_received = {7: 100}
    stats.update_norms = {7: 0.5}
    stats.client_metrics = {
        7: {
            "num-examples": 30.0,
            "partition-id": 2.0,
            "train-loss": 0.7,
            "dp-noise-multiplier": 1.1,
            "dp-epsilon": 3.0,
        }
    }
    stats.rejected = {8: "too big"}
    stats.failed = {9: "lost"}
    rows = client_rows_of(stats)
    assert [(r.node, r.status, r.reason) for r in rows] == [
        (7, "ok", ""),
        (8, "rejected", "too big"),
        (9, "failed", "lost"),
    ]
    ok = rows[0]
    assert (ok.num_examples, ok.partition_id, ok.train_loss) == (30.0, 2.0, 0.7)
    assert (ok.dp_noise_multiplier, ok.dp_epsilon, ok.update_norm) == (1.1, 3.0, 0.5)
    assert ok.train_accuracy is None and rows[1].bytes_received == 0
    ClientRow.write_csv(tmp_path / CLIENTS_CSV, rows)
    with (tmp_path / CLIENTS_CSV).open() as handle:
        header = next(csv.reader(handle))
    with (FORMAT / "federated" / CLIENTS_CSV).open() as handle:
        # The same columns in the same order, then those of the server's ε check.
        assert header == [*next(csv.reader(handle)), "server_epsilon", "claim_mismatch"]
    assert ClientRow.read_csv(tmp_path / CLIENTS_CSV) == rows
    # Counts and ids are integers in the file (partition 2, not 2.0), and read back as such.
    line = (tmp_path / CLIENTS_CSV).read_text().splitlines()[1]
    ok_line = dict(zip(header, line.split(","), strict=True))
    assert (ok_line["partition_id"], ok_line["num_examples"]) == ("2", "30")
    read = ClientRow.read_csv(tmp_path / CLIENTS_CSV)[0]
    assert isinstance(read.partition_id, int) and isinstance(read.num_examples, int)
    # ... while a value a client sent that is not integral stays what it was.
    assert ClientRow(round=1, node=1, status="ok", partition_id=1.5).partition_id == 1.5
    # One mapping: every column sent by the client is its wire key in snake_case.
    assert wire_key("dp_noise_multiplier") == "dp-noise-multiplier"
    assert all(wire_key(c).replace("-", "_") == c for c in ClientRow.FROM_WIRE)


def test_client_dp_is_read_only_from_record_level_dp_replies() -> None:
    assert ClientDP.from_wire({"dp-epsilon": 1.0, "num-examples": 3.0}) is None
    dp = ClientDP.from_wire(
        {"dp-noise-multiplier": 0.9, "dp-sample-rate": 0.1, "dp-steps": 5.0, "dp-epsilon": 2.0}
    )
    assert dp == ClientDP(noise_multiplier=0.9, sample_rate=0.1, steps=5.0, epsilon=2.0)


def test_summary_round_trip_keeps_final_and_best_even_when_missing(tmp_path: Path) -> None:
    summary = RunSummary(
        kind="federated",
        clients=2,
        mode=Mode.CLASSIFIER,
        head="classifier",
        num_labels=4,
        rounds=3,
        local_epochs=1,
        initial={},
        final=None,
        best=None,
        total_seconds=1.5,
        test_examples=10,
        selection="validation",
        data={"train_examples": 20},
        skipped_rounds=[],
        dp="none",
        delta=1e-5,
        epsilon=0.0,
        complete=False,
    )
    written = summary.to_dict()
    assert written["final"] is None and written["best"] is None
    assert "dp_clients" not in written  # only when some client ran record-level DP
    assert RunSummary.from_dict(json.loads(json.dumps(written))) == summary


def test_a_file_that_is_not_a_metrics_file_is_refused(tmp_path: Path) -> None:
    shutil.copy(FORMAT / "federated" / CLIENTS_CSV, tmp_path / CLIENTS_CSV)
    (tmp_path / METRICS_JSON).write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a car-fl metrics file"):
        MetricsFile.read(tmp_path)
