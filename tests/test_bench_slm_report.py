"""``scripts/bench.py --slm``'s printed table: the bf16 goals are judged only where ``auto``
picked a faster dtype than float32."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import load_script


def slm_row(auto_dtype: str, speedup: float) -> dict[str, Any]:
    side = {
        "frozen_parameters": 135e6,
        "device": "cpu",
        "batch": [16, 51],
        "extract_texts": 256,
        "epoch_texts": 64,
        **{f"{k}_seconds": 1.0 for k in ("forward", "step", "extract", "epoch")},
        **{f"{k}_cpu_seconds": 2.0 for k in ("forward", "step", "extract", "epoch")},
    }
    keys = ("forward", "step", "extract", "epoch")
    return {
        "model": "smollm2",
        "auto_dtype": auto_dtype,
        "auto_reason": "why",
        "torch_threads": 2,
        "peak_rss_bytes": 2**30,
        "load_after": [1.0, 1.0, 1.0],
        "float32": side,
        "auto": side,
        "speedup_wall": dict.fromkeys(keys, speedup),
        "speedup_cpu": dict.fromkeys(keys, speedup),
    }


def test_float32_against_float32_judges_no_goal(capsys: pytest.CaptureFixture[str]) -> None:
    load_script("bench").print_slm([slm_row("float32", 0.97)])
    out = capsys.readouterr().out
    assert out.count("float32 against float32, no goal") == 4
    assert "MISSED" not in out and "met" not in out


def test_a_faster_dtype_is_judged_against_each_goal(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench")
    bench.print_slm([slm_row("bfloat16", 2.5)])
    out = capsys.readouterr().out
    assert "(goal >= 2.0x: met)" in out and "(goal >= 3.0x: MISSED)" in out
    assert "no goal" not in out
