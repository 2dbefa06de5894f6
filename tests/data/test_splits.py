"""Numbers you can trust: no text in two splits, validation for model selection, random shards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from car_fl.data.dedupe import dedupe, normalize_text
from car_fl.data.partition import iid_indices, partition
from car_fl.data.readers import Example
from car_fl.data.splits import load_splits
from car_fl.settings.schema import DatasetConfig
from car_fl.testing.tiny import write_tsv


def test_normalisation_folds_unicode_forms_and_whitespace() -> None:
    # NFKC: full-width letters, the "ﬁ" ligature and a non-breaking space fold to ASCII.
    assert normalize_text("  Ｆree\u00a0 ﬁsh\t\ncall  ") == "Free fish call"
    assert normalize_text("Free fish") != normalize_text("free fish")  # case is kept


def test_dedupe_collapses_copies_and_drops_conflicting_labels() -> None:
    examples = [
        Example("win a prize", "spam"),
        Example("hello", "ham"),
        Example("win  a prize ", "spam"),  # same text after whitespace normalisation
        Example("ok", "ham"),
        Example("ok", "spam"),  # conflicting: both copies go
        Example("hello", "ham"),
    ]
    kept, stats = dedupe(examples)
    assert kept == [Example("win a prize", "spam"), Example("hello", "ham")]
    assert stats.duplicates_removed == 2 and stats.conflicting_removed == 2


def _table(path: Path, rows: list[tuple[str, str]]) -> Path:
    return write_tsv(path, [(text, label) for text, label in rows])


def test_texts_of_a_given_test_file_are_removed_from_train(tmp_path: Path) -> None:
    train = _table(
        tmp_path / "train.tsv",
        [(f"text {i}", f"l{i % 2}") for i in range(20)] + [("shared text", "l0")] * 2,
    )
    test = _table(tmp_path / "test.tsv", [("shared  text", "l0"), ("other", "l1")])
    cfg = DatasetConfig(name="t", hub_id=None, path=str(train), test_path=str(test))
    splits = load_splits(cfg, seed=0)
    in_train = {normalize_text(t) for t in [*splits.train["text"], *splits.validation["text"]]}
    assert "shared text" not in in_train
    assert splits.stats["duplicates_removed"] == 1
    assert splits.stats["test_overlap_removed"] == 1
    assert splits.stats["train_examples"] + splits.stats["validation_examples"] == 20
    off = load_splits(DatasetConfig(**{**cfg.__dict__, "dedupe": False}), seed=0)
    assert len(off.train) + len(off.validation) == 22


def test_validation_is_carved_from_train_stratified_and_seeded(tmp_path: Path) -> None:
    rows = [(f"msg {i}", "spam" if i % 5 == 0 else "ham") for i in range(500)]
    rows += rows[:50]  # 50 exact copies, which must not end up in two splits
    cfg = DatasetConfig(name="t", hub_id=None, path=str(_table(tmp_path / "d.tsv", rows)))
    splits = load_splits(cfg, seed=7)
    sizes = {k: len(getattr(splits, k)) for k in ("train", "validation", "test")}
    assert sizes == {"train": 360, "validation": 40, "test": 100}
    assert Counter(splits.validation["label"]) == {0: 32, 1: 8}  # 80 % ham, 20 % spam
    again = load_splits(cfg, seed=7)
    assert again.validation["text"] == splits.validation["text"]
    assert load_splits(cfg, seed=8).validation["text"] != splits.validation["text"]
    parts = [set(getattr(splits, k)["text"]) for k in ("train", "validation", "test")]
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == 500
    none = load_splits(DatasetConfig(**{**cfg.__dict__, "val_fraction": 0.0}), seed=7)
    assert len(none.validation) == 0 and len(none.train) == 400


def test_val_fraction_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dataset.val_fraction must be in \[0, 1\)"):
        DatasetConfig(name="t", hub_id=None, path="x", val_fraction=1.0)


def test_iid_shards_are_a_seeded_permutation_not_contiguous_slices() -> None:
    n, parts = 90, 3
    shards = [iid_indices(n, partition_id=i, num_partitions=parts, seed=5) for i in range(parts)]
    assert sorted(i for s in shards for i in s) == list(range(n))  # every example exactly once
    for shard in shards:
        assert len(shard) == n // parts
        assert shard != list(range(shard[0], shard[0] + len(shard)))  # not a contiguous slice
    again = [iid_indices(n, partition_id=i, num_partitions=parts, seed=5) for i in range(parts)]
    assert again == shards
    assert iid_indices(n, partition_id=0, num_partitions=parts, seed=6) != shards[0]
    # One shard is the whole split, in its order (one client reproduces centralised training).
    assert iid_indices(n, partition_id=0, num_partitions=1, seed=5) == list(range(n))


def test_iid_shards_of_a_label_sorted_file_are_not_label_skewed(synthetic_tsv: Path) -> None:
    cfg = DatasetConfig(name="s", hub_id=None, path=str(synthetic_tsv))
    splits = load_splits(cfg, seed=0)
    by_label = sorted(range(len(splits.train)), key=lambda i: splits.train[i]["label"])
    ordered = splits.train.select(by_label)  # a file sorted by label
    for i in range(4):
        shard = partition(ordered, partition_id=i, num_partitions=4, seed=0)
        counts = Counter(shard["label"])
        assert len(counts) == 4 and max(counts.values()) < 0.5 * len(shard)
