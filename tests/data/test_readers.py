"""Dataset readers in their real formats, the label map, the split and client shards."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.readers import DataFormatError, read_ag_news, read_arxiv, read_sms_spam, read_table
from car_fl.data.splits import load_splits, stratified_split
from car_fl.settings.schema import DatasetConfig, Partitioning, Reader


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_sms_spam_reader_keeps_text_after_the_first_tab(tmp_path: Path) -> None:
    path = write(tmp_path / "sms.tsv", "ham\tGo until jurong\tpoint\nspam\tFree entry \x92 now\n")
    examples = read_sms_spam(path)
    assert [(e.label, e.text) for e in examples] == [
        ("ham", "Go until jurong\tpoint"),
        ("spam", "Free entry \x92 now"),
    ]


def test_sms_spam_reader_names_file_and_line_of_a_bad_row(tmp_path: Path) -> None:
    path = write(tmp_path / "sms.tsv", "ham\tok\nno tab here\n")
    with pytest.raises(DataFormatError, match=r"sms.tsv, line 2: expected 'label<TAB>text'"):
        read_sms_spam(path)


def test_missing_file_is_reported_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"absent.tsv: file not found"):
        read_sms_spam(tmp_path / "absent.tsv")


def test_ag_news_reader_original_csv_format(tmp_path: Path) -> None:
    path = write(
        tmp_path / "train.csv",
        '"3","Wall St. Bears Claw Back","Reuters - Short-sellers, Wall Street\'s dwindling"\n'
        '"2","Phelps wins","ATHENS - Michael Phelps won \\ gold"\n',
    )
    examples = read_ag_news(path)
    assert examples[0].label == "Business" and examples[1].label == "Sports"
    assert examples[0].text.startswith("Wall St. Bears Claw Back Reuters - Short-sellers")


def test_ag_news_reader_rejects_bad_class(tmp_path: Path) -> None:
    path = write(tmp_path / "train.csv", '"1","a","b"\n"7","c","d"\n')
    with pytest.raises(DataFormatError, match=r"line 2: class index must be 1-4, found '7'"):
        read_ag_news(path)


def test_arxiv_reader_uses_the_primary_category(tmp_path: Path) -> None:
    rows = [
        {
            "id": "0704.0001",
            "title": "Calculation of  prompt\n diphoton",
            "abstract": " A study.",
            "categories": "hep-ph hep-th",
        },
        {"id": "0704.0002", "title": "Sparsity", "abstract": "Graphs.", "categories": "math.CO"},
    ]
    path = write(tmp_path / "arxiv.json", "\n".join(json.dumps(r) for r in rows) + "\n")
    examples = read_arxiv(path)
    assert [e.label for e in examples] == ["hep-ph", "math.CO"]
    assert examples[0].text == "Calculation of prompt diphoton. A study."


def test_arxiv_reader_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path / "a.json", '{"title": "x", "abstract": "y", "categories": "cs.LG"}\n{oops\n'
    )
    with pytest.raises(DataFormatError, match=r"a.json, line 2: invalid JSON"):
        read_arxiv(path)
    path = write(tmp_path / "b.json", '{"title": "x", "abstract": "y"}\n')
    with pytest.raises(DataFormatError, match=r"line 1: missing field\(s\) categories"):
        read_arxiv(path)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_table_reader_formats(tmp_path: Path, suffix: str) -> None:
    rows = [
        {"q": "how do I reset", "doc": "faq-1", "extra": 1},
        {"q": "price?", "doc": "faq-2", "extra": 2},
    ]
    path = tmp_path / f"t{suffix}"
    if suffix in (".csv", ".tsv"):
        sep = "," if suffix == ".csv" else "\t"
        write(
            path,
            f"q{sep}doc{sep}extra\n"
            + "".join(f"{r['q']}{sep}{r['doc']}{sep}{r['extra']}\n" for r in rows),
        )
    elif suffix == ".jsonl":
        write(path, "".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    examples = read_table(path, text_column="q", label_column="doc")
    assert [(e.text, e.label) for e in examples] == [
        ("how do I reset", "faq-1"),
        ("price?", "faq-2"),
    ]


def test_table_reader_names_the_missing_column(tmp_path: Path) -> None:
    path = write(tmp_path / "t.csv", "question,doc\nhi,a\n")
    with pytest.raises(DataFormatError, match=r"t.csv, line 2: no column 'text'.*text_column"):
        read_table(path, text_column="text", label_column="doc")


def test_split_is_seeded_stratified_and_covers_everything() -> None:
    labels = [0] * 80 + [1] * 20
    train, test = stratified_split(labels, test_fraction=0.2, seed=3)
    again = stratified_split(labels, test_fraction=0.2, seed=3)
    assert (train == again[0]).all() and (test == again[1]).all()
    assert sorted([*train, *test]) == list(range(100))
    assert Counter(labels[i] for i in test) == {0: 16, 1: 4}
    other = stratified_split(labels, test_fraction=0.2, seed=4)
    assert set(other[1]) != set(test)


def test_load_splits_uses_the_given_test_file_and_one_label_map(tmp_path: Path) -> None:
    train = write(tmp_path / "train.csv", '"1","a","b"\n"2","c","d"\n"2","e","f"\n')
    test = write(tmp_path / "test.csv", '"3","g","h"\n"1","i","j"\n')
    cfg = DatasetConfig(
        name="ag", reader=Reader.AG_NEWS, hub_id=None, path=str(train), test_path=str(test)
    )
    splits = load_splits(cfg, seed=0)
    assert splits.label_map.to_list() == ["Business", "Sports", "World"]
    assert len(splits.train) + len(splits.validation) == 3 and len(splits.test) == 2


def test_hub_dataset_offline_error_says_how_to_use_a_local_file() -> None:
    cfg = DatasetConfig(name="sms_spam", hub_id="no-such-org/no-such-dataset-xyz")
    with pytest.raises(RuntimeError, match=r"no-such-dataset-xyz.*dataset.path="):
        load_splits(cfg, seed=0)


def test_min_examples_per_label_drops_rare_labels(tmp_path: Path) -> None:
    rows = [f"a\tx{i}" for i in range(5)] + [f"b\ty{i}" for i in range(5)] + ["c\tz"]
    path = write(tmp_path / "d.tsv", "\n".join(rows) + "\n")
    cfg = DatasetConfig(name="d", hub_id=None, path=str(path), min_examples_per_label=2)
    assert load_splits(cfg, seed=0).label_map.to_list() == ["a", "b"]


@pytest.fixture
def splits(synthetic_tsv: Path):
    cfg = DatasetConfig(name="synthetic", hub_id=None, path=str(synthetic_tsv))
    return load_splits(cfg, seed=0)


def test_iid_shards_cover_the_data_exactly_once(splits) -> None:
    shards = [partition(splits.train, partition_id=i, num_partitions=3) for i in range(3)]
    texts = [t for s in shards for t in s["text"]]
    assert sorted(texts) == sorted(splits.train["text"])


def test_dirichlet_shards_are_non_iid_and_cover_the_data_once(splits) -> None:
    shards = [
        partition(
            splits.train,
            partition_id=i,
            num_partitions=3,
            scheme=Partitioning.DIRICHLET,
            alpha=0.1,
            seed=1,
        )
        for i in range(3)
    ]
    rows = [(t, lab) for s in shards for t, lab in zip(s["text"], s["label"], strict=True)]
    assert sorted(rows) == sorted(zip(splits.train["text"], splits.train["label"], strict=True))
    overall = Counter(splits.train["label"])
    for shard in shards:
        counts = Counter(shard["label"])
        shares = [counts.get(k, 0) / len(shard) for k in overall]
        # With alpha = 0.1 some label dominates each shard far beyond its global share (25%).
        assert max(shares) > 0.5


def test_every_shard_shares_the_global_label_map(splits, synthetic_tsv: Path) -> None:
    cfg = DatasetConfig(name="synthetic", hub_id=None, path=str(synthetic_tsv))
    for i in range(4):
        again = load_splits(cfg, seed=0)
        shard = partition(
            again.train, partition_id=i, num_partitions=4, scheme=Partitioning.DIRICHLET, alpha=0.1
        )
        assert again.label_map == splits.label_map
        assert set(shard["label"]) <= set(range(len(splits.label_map)))


def test_label_map_rejects_unknown_labels_by_name() -> None:
    labels = LabelMap.from_labels(["spam", "ham"])
    assert labels.names == ("ham", "spam")
    with pytest.raises(ValueError, match=r"not in the global label map: \['eggs'\]"):
        labels.encode(["ham", "eggs"], source="client 2")


def test_partition_id_out_of_range() -> None:
    from datasets import Dataset

    data = Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    with pytest.raises(ValueError, match=r"partition-id 2 is outside \[0, 2\)"):
        partition(data, partition_id=2, num_partitions=2)
