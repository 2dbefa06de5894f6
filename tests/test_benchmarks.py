"""Every benchmark script that the docs name runs to the end, in its smoke mode (tiny models).

The numbers of a smoke run mean nothing; what is checked is that each script reaches its
report and writes every figure, so that a change elsewhere cannot break one unnoticed. Marked
``bench`` (about 10 minutes of the two cores): the default run leaves them out, so that CI
answers sooner; ``python -m pytest -m bench`` runs them, as before a benchmark's figures are
quoted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]

ROOT = Path(__file__).resolve().parents[1]


def script_command(name: str, out: Path, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / name), *args, "--smoke", "--json", str(out)]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_to_the_end(command: list[str], cwd: Path) -> str:
    """``command``'s stdout, once it has exited 0 (else its output's tail, failing)."""
    done = subprocess.run(
        command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def run_script(name: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert f"results: {out}" in run_to_the_end(script_command(name, out, *args), tmp_path)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_parts_side_by_side(name: str, tmp_path: Path, parts: list[str]) -> dict[str, Any]:
    """Each part of ``name`` in its own process, all at once (a smoke run waits on Flower's
    polling more than it computes); the parts' results in one dict, as ``all`` writes them."""
    running = {}
    for part in parts:
        out = tmp_path / f"{part}.json"
        log = (tmp_path / f"{part}.log").open("w")
        proc = subprocess.Popen(
            script_command(name, out, part),
            cwd=tmp_path,
            env=ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        running[part] = (proc, out, log)
    result: dict[str, Any] = {}
    try:
        for part, (proc, out, log) in running.items():
            code = proc.wait(timeout=900)
            log.close()
            text = (tmp_path / f"{part}.log").read_text()
            assert code == 0, f"{part}: exit {code}\n{text[-5000:]}"
            assert f"results: {out}" in text
            result |= json.loads(out.read_text())
    finally:
        for proc, _, log in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return result


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_bench_runs_every_figure(tmp_path: Path) -> None:
    r = run_script("bench.py", tmp_path)
    assert positive(r["1_bucketing"]["speedup"])
    assert positive(r["2_fl_vs_extraction"]["ratio"])
    assert len(r["3_step_vs_forward"]) == 2
    # figure 4: the empty ClientApp's replies are accepted (every round has a floor time)
    assert r["4_round_overhead"]["rounds_compared"] >= 1
    assert positive(r["4_round_overhead"]["empty_clientapp_round_seconds"])
    assert [x["mode"] for x in r["5_client_rss"]] == ["classifier", "adapter"]
    assert positive(r["6_bytes"]["classifier_ratio"])
    assert positive(r["7_comm_dtype"]["bytes_ratio"])


def test_bench_deploy_runs_every_part(tmp_path: Path) -> None:
    r = run_parts_side_by_side("bench_deploy.py", tmp_path, ["overhead", "speedup", "first-update"])
    overhead = r["overhead"]
    for run in ("car_fl", "floor", "car_fl_no_worker"):
        assert overhead[run]["rounds"] >= 1
        assert isinstance(overhead[run]["load"], float)
    assert positive(overhead["ratio"])
    (workload,) = r["speedup"].values()
    assert positive(workload["federated"]["2"]["speedup"])
    first = r["first_update"]
    assert len(first["with_worker"]["round_seconds"]) == 2
    assert positive(first["ratio_last_round"])


def test_scale_benchmark_compares_the_dense_head_with_the_mixture(tmp_path: Path) -> None:
    r = run_script("scale_benchmark.py", tmp_path, "--out", str(tmp_path / "scale"))
    dense, moe = r["rows"]
    assert (dense["variant"], moe["variant"]) == ("dense", "moe")
    for row in (dense, moe):
        for key in ("seconds_per_epoch", "peak_rss_mib", "head_macs_per_query"):
            assert positive(row[key]), (row["variant"], key)
        assert 0 <= row["recall@10"] <= 1 and row["recall@1"] <= row["recall@10"]
    assert dense["head_macs_per_query"] == dense["documents"] * dense["dim"]
    # the mixture scores fewer documents and a client is sent one block of experts
    assert moe["head_macs_per_query"] < dense["head_macs_per_query"]
    assert moe["bytes_per_client_round"] < dense["bytes_per_client_round"]
    assert r["ratios"]["bytes_ratio"] == pytest.approx(
        dense["bytes_per_client_round"] / moe["bytes_per_client_round"]
    )
    assert (tmp_path / "scale" / "table.md").read_text().count("\n") == 4


def test_bench_serve_answers_every_request_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench-serve.json"
    command = [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--smoke"]
    run_to_the_end([*command, "--json", str(out), "--work", str(tmp_path / "work")], tmp_path)
    (model,) = json.loads(out.read_text())["models"].values()
    assert positive(model["in_process"]["qps"])
    assert [served["queries_per_request"] for served in model["served"]] == [1, 16]
    for served in model["served"]:
        assert served["answered"] == served["requests"] and not served["not_2xx"]
        assert positive(served["p99_ms"]) and positive(served["cpu_s"]["replica"])
        same = served["in_process_same_requests"]
        assert same["queries_per_request"] == served["queries_per_request"]
        assert served["ratio_to_same_requests"] == pytest.approx(served["qps"] / same["qps"])


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_rag_example_retrieves_and_answers_through_each_framework(
    tmp_path: Path, framework: str
) -> None:
    if framework == "llamaindex":
        pytest.importorskip("llama_index.core", reason='pip install -e ".[llamaindex]"')
    command = [sys.executable, str(ROOT / "scripts" / "rag_example.py"), "--smoke"]
    stdout = run_to_the_end([*command, "--framework", framework, "--work", str(tmp_path)], tmp_path)
    lines = stdout.splitlines()
    assert f"question: w5 w25 ({framework})" in lines
    assert any(line.startswith("  1. d5\t") for line in lines)  # the document the query names
    assert any(line.startswith("answer: ") for line in lines)


def test_adapter_study_runs_every_plan_and_reports_each_row(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """scripts/adapter_study.py on the tiny Llama and a synthetic arXiv file: the grid's rows
    over two seeds, a federated and a private row, and a report with every row, its seeds and
    the bytes of its reply (the low-rank adapter's below the full one's)."""
    from car_fl.testing.tiny import synthetic_examples

    codes = {"topic0": "hep-th", "topic1": "math.AG", "topic2": "cs.LG", "topic3": "astro-ph.GA"}
    data = tmp_path / "arxiv.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"x{i}", "title": t, "abstract": t, "categories": codes[label]})
            + "\n"
            for i, (t, label) in enumerate(synthetic_examples(300))
        )
    )
    out = tmp_path / "study"
    common = [
        *("--model", str(tiny_llama), "--data", str(data), "--out", str(out), "--epochs", "2"),
        *("--set", "dataset.min_examples_per_label=5", f"cache_dir={tmp_path / 'cache'}"),
        "adapter.rank=4",
    ]
    script = [sys.executable, str(ROOT / "scripts" / "adapter_study.py"), "run"]
    run_to_the_end(
        [*script, "--only", "car", "full", "lowrank4+anchor", "--seeds", "0", "1", *common],
        tmp_path,
    )
    run_to_the_end(
        [*script, "--plan", "federated", "--only", "fl-lowrank16", "--seeds", "0", *common],
        tmp_path,
    )
    run_to_the_end(
        [*script, "--plan", "private", "--only", "dpsgd-lowrank16", "--seeds", "0", *common],
        tmp_path,
    )
    rows = {(r["plan"], r["row"]): r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {
        ("grid", "car"),
        ("grid", "full"),
        ("grid", "lowrank4+anchor"),
        ("federated", "fl-lowrank16"),
        ("private", "dpsgd-lowrank16"),
    }
    assert all(rows["grid", r]["seeds"] == [0, 1] for r in ("car", "full", "lowrank4+anchor"))
    assert rows["grid", "lowrank4+anchor"]["reply_bytes"] < rows["grid", "full"]["reply_bytes"]
    assert rows["private", "dpsgd-lowrank16"]["epsilon"] == pytest.approx(3.0, rel=0.01)
    assert (out / "results.png").is_file() and "| car |" in (out / "results.md").read_text()
