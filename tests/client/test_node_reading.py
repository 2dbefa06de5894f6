"""car_fl.client.node_reading: a node with a policy reads its data as its owner says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from car_fl.client.node_reading import NodeReading
from car_fl.client.policy import NodePolicy, PolicyError
from car_fl.settings.schema import DatasetConfig, Reader

BASE = 'modes = ["fixed"]\n'


def policy(tmp_path: Path, data: str) -> NodePolicy:
    path = tmp_path / "policy.toml"
    path.write_text(BASE + data, encoding="utf-8")
    return NodePolicy.load(path)


def test_without_a_data_table_the_node_reads_with_car_fls_defaults(tmp_path: Path) -> None:
    reading = policy(tmp_path, "").data
    defaults = DatasetConfig()
    assert reading.reader is defaults.reader
    assert (reading.text_column, reading.label_column) == (
        defaults.text_column,
        defaults.label_column,
    )
    assert reading.min_examples_per_label == defaults.min_examples_per_label
    assert reading.dedupe is True and reading.max_examples is None


def test_the_data_table_reads_back(tmp_path: Path) -> None:
    reading = policy(
        tmp_path,
        '[data]\nreader = "table"\ntext-column = "question"\nlabel-column = "doc"\n'
        "dedupe = false\nmin-examples-per-label = 3\nseed = 7\nval-fraction = 0\n",
    ).data
    assert reading.reader is Reader.TABLE
    assert (reading.text_column, reading.label_column) == ("question", "doc")
    assert (reading.dedupe, reading.min_examples_per_label, reading.seed) == (False, 3, 7)
    assert reading.val_fraction == 0.0


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ('[data]\nreader = "excel"\n', ["'reader'", "line 3", "sms_spam"]),
        ("[data]\nmin-examples-per-label = 1.5\n", ["'min-examples-per-label'", "whole number"]),
        ("[data]\ndedupe = 1\n", ["'dedupe'", "true or false"]),
        ("[data]\ncolumns = 2\n", ["'columns'", "unknown [data] key", "text-column"]),
        ("[data]\ntest-fraction = 1.5\n", ["dataset.test_fraction must be in (0, 1)"]),
        ("[data]\nmin-examples-per-label = 0\n", ["min_examples_per_label must be >= 1"]),
        ('data = "sms"\n', ["'data'", "must be a table"]),
    ],
)
def test_a_bad_data_table_is_refused_naming_the_key(
    tmp_path: Path, data: str, names: list[str]
) -> None:
    with pytest.raises(PolicyError) as err:
        policy(tmp_path, data)
    assert "policy.toml" in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_a_runs_reading_keys_are_ignored_and_logged(
    make_settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The malicious server's reading (finding 1 of issue 41) never reaches the node's file."""
    run = make_settings(
        "dataset=file",
        "dataset.text_column=ham",
        "dataset.label_column=ham",
        "dataset.min_examples_per_label=61",
        "dataset.dedupe=false",
        "seed=3",
    )
    with caplog.at_level(logging.WARNING, logger="car_fl.client.node_reading"):
        mine = NodeReading().apply(run, source="policy.toml")
    assert mine.dataset.reader is Reader.SMS_SPAM
    assert (mine.dataset.text_column, mine.dataset.label_column) == ("text", "label")
    assert (mine.dataset.min_examples_per_label, mine.dataset.dedupe, mine.seed) == (1, True, 42)
    assert mine.dataset.path == run.dataset.path  # the node's path stays the node's
    assert mine.dp == run.dp and mine.train == run.train  # the run sets everything else
    text = caplog.text
    for ignored in ("dataset.reader", "dataset.min_examples_per_label=61", "seed=3", "policy.toml"):
        assert ignored in text


def test_a_run_that_reads_as_the_node_does_logs_nothing(
    make_settings, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="car_fl.client.node_reading"):
        NodeReading().apply(make_settings())
    assert caplog.text == ""


def test_only_the_nodes_own_config_names_its_test_and_documents_files(make_settings) -> None:
    """A run's dataset.test_path cancelled the owner's test split and dropped the training
    texts that matched a file of the server's choice; a run's documents_path could make a
    corpus read fail exactly when the node holds a query of a missing document."""
    run = make_settings("dataset.test_path=/srv/theirs.tsv")
    mine = NodeReading().apply(run, paths={"test_path": None, "documents_path": None})
    assert mine.dataset.test_path is None and mine.dataset.documents_path is None
    own = NodeReading().apply(run, paths={"test_path": "/mine/test.tsv", "documents_path": None})
    assert own.dataset.test_path == "/mine/test.tsv"
    # a run's generated queries would add training queries of the server's choice
    theirs = make_settings("dataset.generated_queries_path=/srv/queries.jsonl")
    paths: dict[str, str | None] = {"test_path": None, "documents_path": None}
    paths["generated_queries_path"] = None
    assert NodeReading().apply(theirs, paths=paths).dataset.generated_queries_path is None
    paths["generated_queries_path"] = "/mine/generated.jsonl"
    mine_too = NodeReading().apply(theirs, paths=paths).dataset.generated_queries_path
    assert mine_too == "/mine/generated.jsonl"


def test_only_what_either_reader_reads_is_a_difference(make_settings) -> None:
    """Review: a run naming a documents file the node's table reader never opens, or a corpus
    run whose split fractions a corpus never reads (it splits per document), was refused on a
    shared file; what either reader does read still is."""
    none = {"test_path": None, "documents_path": None, "generated_queries_path": None}
    sms = NodeReading()
    assert (
        sms.differences(make_settings("dataset.documents_path=/srv/docs.jsonl"), paths=none) == []
    )
    assert sms.differences(make_settings("dataset.test_fraction=0.3"), paths=none) == [
        "dataset.test_fraction=0.3"
    ]
    assert sms.differences(make_settings("dataset.test_path=/srv/t.tsv"), paths=none) == [
        "dataset.test_path='/srv/t.tsv' (this node's: None)"
    ]
    # the run's own test file when the node's settings already carry the node's
    own = {**none, "test_path": "/mine/test.tsv"}
    carried = make_settings("dataset.test_path=/mine/test.tsv")
    assert sms.differences(carried, paths=own) == []
    assert sms.differences(carried, paths=own, run_paths={"test_path": None}) == [
        "dataset.test_path=None (this node's: '/mine/test.tsv')"
    ]
    corpus = NodeReading(reader=Reader.CORPUS)
    run = make_settings(
        "dataset.reader=corpus",
        "dataset.documents_path=/srv/docs.jsonl",
        "dataset.test_fraction=0.3",
        "dataset.stratify=false",
        "dataset.test_path=/srv/t.tsv",
    )
    mine = {**none, "documents_path": "/mine/docs.jsonl"}
    assert corpus.differences(run, paths=mine) == []
    changed = make_settings(
        "dataset.reader=corpus", "dataset.documents_path=/d", "dataset.new_fraction=0.2"
    )
    assert corpus.differences(changed, paths=mine, run_paths={"documents_path": "/d"}) == [
        "dataset.new_fraction=0.2"
    ]
