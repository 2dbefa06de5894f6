"""Numbers you can trust: no text in two splits, validation for model selection, random shards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from car_fl.data.dedupe import dedupe, duplicate_key, normalize_text
from car_fl.data.partition import iid_indices, partition
from car_fl.data.readers import Example
from car_fl.data.splits import load_splits
from car_fl.settings.schema import DatasetConfig, Partitioning, Split
from car_fl.testing.tiny import synthetic_examples, write_tsv


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
        Example("Hello", "ham"),  # a copy in another case (SMS has one) is a copy too
        Example("Hello...", "ham"),  # and with other marks around its words (SMS has 47)
        Example("win a prize!", "spam"),
        Example("?!", "ham"),  # a text of marks alone is its own text,
        Example("...", "spam"),  # not a copy of another such text
        Example("thanks :)", "ham"),  # emoticons' brackets are kept: no conflict
        Example("thanks :(", "spam"),
    ]
    kept, stats = dedupe(examples)
    assert kept == [
        Example("win a prize", "spam"),
        Example("hello", "ham"),
        Example("?!", "ham"),
        Example("...", "spam"),
        Example("thanks :)", "ham"),
        Example("thanks :(", "spam"),
    ]
    assert stats.duplicates_removed == 5 and stats.conflicting_removed == 2


def test_marks_inside_a_word_and_signs_are_part_of_the_text() -> None:
    assert duplicate_key("Sorry, I'll call later.") == duplicate_key("sorry i'll call later")
    for one, other in [("I'll", "Ill"), ("1.5", "15"), ("e-mail", "email"), ("-5", "5")]:
        assert duplicate_key(one) != duplicate_key(other)
    assert duplicate_key("#win 50%") != duplicate_key("win 50")


def _table(path: Path, rows: list[tuple[str, str]]) -> Path:
    return write_tsv(path, [(text, label) for text, label in rows])


def test_texts_of_a_given_test_file_are_removed_from_train(tmp_path: Path) -> None:
    train = _table(
        tmp_path / "train.tsv",
        [(f"text {i}", f"l{i % 2}") for i in range(20)] + [("shared text", "l0")] * 2,
    )
    test = _table(tmp_path / "test.tsv", [("Shared  Text", "l0"), ("other", "l1")])
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


def _placement(cfg: DatasetConfig, scheme: Partitioning) -> dict[str, str]:
    """Where each text lands: its split, and for training texts its shard of 3."""
    splits = load_splits(cfg, seed=7)
    where = {t: "validation" for t in splits.validation["text"]}
    where.update({t: "test" for t in splits.test["text"]})
    for pid in range(3):
        shard = partition(splits.train, partition_id=pid, num_partitions=3, scheme=scheme, seed=7)
        where.update({t: f"shard {pid}" for t in shard["text"]})
    assert len(where) == len(splits.train) + len(splits.validation) + len(splits.test)
    return where


@pytest.mark.parametrize(
    ("split", "scheme"), [("seeded", Partitioning.IID), ("hash", Partitioning.HASH)]
)
def test_one_record_added_moves_no_other_record_only_under_the_hash_placement(
    tmp_path: Path, split: str, scheme: Partitioning
) -> None:
    """Record-level DP's neighbour differs in one record. A seeded permutation places a record
    by its rank among all of them, so one record added to the file moves others across splits
    and shards (the charged ε assumed a neighbour the split did not keep); the keyed hash
    places each by its own text and moves none."""
    rows = synthetic_examples(1000, num_labels=2, seed=3)
    before = _table(tmp_path / "before.tsv", rows)
    after = _table(
        tmp_path / "after.tsv", [*rows[:500], ("one added record", "topic0"), *rows[500:]]
    )
    placed = {}
    for name, path in (("before", before), ("after", after)):
        cfg = DatasetConfig(name="t", hub_id=None, path=str(path), split=Split(split))
        placed[name] = _placement(cfg, scheme)
    assert set(placed["after"]) - set(placed["before"]) == {"one added record"}
    moved = sum(placed["after"][t] != where for t, where in placed["before"].items())
    if split == "hash":
        assert moved == 0
    else:
        assert moved > 100  # of 1,000: the guarantee's unit was not one record


def test_the_hash_split_keeps_its_fractions_and_no_text_in_two_splits(tmp_path: Path) -> None:
    rows = synthetic_examples(4000, num_labels=3, seed=5)
    cased = [(f"Call Me Later {i}", "label0") for i in range(30)]  # copies in another case
    path = _table(tmp_path / "d.tsv", [*rows, *cased, *((t.lower(), y) for t, y in cased)])
    cfg = DatasetConfig(name="t", hub_id=None, path=str(path), split=Split.HASH)
    splits = load_splits(cfg, seed=0)
    texts = [set(part["text"]) for part in (splits.train, splits.validation, splits.test)]
    keys = [{duplicate_key(t) for t in part} for part in texts]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    n = sum(len(t) for t in texts)
    assert abs(len(texts[2]) / n - cfg.test_fraction) < 0.03
    assert abs(len(texts[1]) / (n - len(texts[2])) - cfg.val_fraction) < 0.03
    other = load_splits(cfg, seed=1)  # the seed keys the hash: another seed, another split
    assert set(other.test["text"]) != texts[2]
    shards = [
        len(partition(splits.train, partition_id=p, num_partitions=4, scheme=Partitioning.HASH))
        for p in range(4)
    ]
    assert sum(shards) == len(splits.train) and min(shards) > 0.2 * len(splits.train)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"max_examples": 100}, "dataset.max_examples"),
        ({"min_examples_per_label": 5}, "dataset.min_examples_per_label"),
    ],
)
def test_the_hash_split_refuses_what_places_a_record_by_the_others(
    override: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=rf"dataset.split=hash .*{named}"):
        DatasetConfig(**{"name": "t", "hub_id": None, "path": "x.tsv", "split": "hash", **override})


def _entries(path: Path) -> Counter[tuple[str, str, str]]:
    """(text, label, where) of every example the hash placement keeps: split or shard of 3."""
    cfg = DatasetConfig(name="t", hub_id=None, path=str(path), split=Split.HASH)
    splits = load_splits(cfg, seed=7)
    names = splits.label_map.names
    found: Counter[tuple[str, str, str]] = Counter()
    for where, part in (("validation", splits.validation), ("test", splits.test)):
        found.update((t, names[y], where) for t, y in zip(part["text"], part["label"], strict=True))
    for pid in range(3):
        shard = partition(
            splits.train, partition_id=pid, num_partitions=3, scheme=Partitioning.HASH, seed=7
        )
        found.update(
            (t, names[y], f"shard {pid}")
            for t, y in zip(shard["text"], shard["label"], strict=True)
        )
    return found


@pytest.mark.parametrize("kind", ["new text", "copy with another label", "copy with spaces"])
def test_under_the_hash_placement_one_added_record_changes_only_itself(
    tmp_path: Path, kind: str
) -> None:
    """Duplicates are found on normalised text: a copy put before a record used to replace it
    with its own spelling (placed elsewhere), and a copy with another label used to remove
    the record it conflicts with. Under the hash placement a copy is kept once as its
    normalised text and conflicting copies are all kept, so one record added changes what
    is trained and evaluated by that record at most."""
    rows = synthetic_examples(1000, num_labels=2, seed=3)
    text, label = rows[10]
    added = {
        "new text": ("one added record", "topic0"),
        "copy with another label": (text, "topic1" if label == "topic0" else "topic0"),
        "copy with spaces": (f"  {text} ", label),
    }[kind]
    before = _entries(_table(tmp_path / "before.tsv", rows))
    after = _entries(_table(tmp_path / "after.tsv", [added, *rows]))
    assert not before - after  # nothing lost, nothing moved
    gained = after - before
    assert sum(gained.values()) == (0 if kind == "copy with spaces" else 1)


def test_label_texts_of_another_data_set_are_named_and_a_tsv_of_its_own_labels_has_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sms_spam preset describes ham and spam; a label<TAB>text file of other labels gets
    a warning that names the fix, and dataset=tsv describes nothing it was not told."""
    from car_fl.settings.compose import load_settings

    path = tmp_path / "mine.tsv"
    path.write_text("".join(f"{'ab'[i % 2]}\ttext number {i}\n" for i in range(40)))
    sms = load_settings(["model=local", "model.name_or_path=/m", f"dataset.path={path}"])
    with caplog.at_level("WARNING", logger="car_fl.data.splits"):
        load_splits(sms.dataset, seed=0)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "dataset.label_texts describe ham, spam, none of which" in warning
    assert "(a, b): they are not used; for a label<TAB>text file" in warning
    assert "use dataset=tsv" in warning
    caplog.clear()
    tsv = load_settings(
        ["model=local", "model.name_or_path=/m", "dataset=tsv", f"dataset.path={path}"]
    )
    assert tsv.dataset.label_texts == {} and tsv.dataset.hub_id is None
    with caplog.at_level("WARNING", logger="car_fl.data.splits"):
        splits = load_splits(tsv.dataset, seed=0)
    assert caplog.records == [] and list(splits.label_map.names) == ["a", "b"]
