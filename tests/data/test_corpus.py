"""Corpus files: documents and queries in JSON lines or CSV/TSV, and their line-numbered errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.data.corpus import Document, documents_digest, read_documents, read_queries
from car_fl.data.readers import DataFormatError


def jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


DOCS = [
    {"id": "d1", "text": "Loewner  driving\nfunctions", "title": "Loewner", "metadata": {"x": 1}},
    {"id": 2, "text": "Quantum dots", "category": "quant-ph"},
]


def test_documents_from_json_lines_keep_order_title_and_metadata(tmp_path: Path) -> None:
    docs = read_documents(jsonl(tmp_path / "d.jsonl", DOCS))
    assert docs == [
        Document("d1", "Loewner driving functions", "Loewner", {"x": 1}),
        Document("2", "Quantum dots", "", {"category": "quant-ph"}),
    ]


def test_documents_and_queries_from_tsv(tmp_path: Path) -> None:
    (tmp_path / "d.tsv").write_text("id\ttext\ttopic\na\tfirst doc\tt1\nb\tsecond\tt2\n")
    (tmp_path / "q.tsv").write_text("query\tdocument_id\nwhich one\tb\n")
    docs = read_documents(tmp_path / "d.tsv")
    assert [d.metadata["topic"] for d in docs] == ["t1", "t2"]
    queries = read_queries(tmp_path / "q.tsv", docs)
    assert [(q.text, q.document_id, q.split, q.line) for q in queries] == [
        ("which one", "b", None, 2)
    ]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "a", "text": "x"}, {"text": "y"}], r"line 2: a document needs the field\(s\) id"),
        (
            [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}],
            r"line 2: duplicate document id 'a' \(first on line 1\)",
        ),
        ([{"id": "a", "text": "  "}], r"line 1: document 'a' has an empty text"),
        ([{"id": "a", "text": "x", "metadata": [1]}], r"line 1: 'metadata' must be a JSON object"),
        ([], r"contains no documents"),
    ],
)
def test_bad_documents_name_file_and_line(tmp_path: Path, rows: list[object], message: str) -> None:
    with pytest.raises(DataFormatError, match=r"d.jsonl.*" + message):
        read_documents(jsonl(tmp_path / "d.jsonl", rows))


def test_a_documents_file_that_is_not_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{oops\n')
    with pytest.raises(DataFormatError, match=r"d.jsonl, line 2: invalid JSON"):
        read_documents(path)
    with pytest.raises(DataFormatError, match=r"unknown format '.txt'"):
        read_documents((tmp_path / "d.txt", (tmp_path / "d.txt").write_text("x"))[0])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"query": "q", "document_id": "zz"}],
            r"line 1: document id 'zz' is not in the documents file",
        ),
        ([{"query": "q"}], r"line 1: a query needs the fields query and document_id"),
        ([{"query": " ", "document_id": "d1"}], r"line 1: empty query text"),
        (
            [{"query": "q", "document_id": "d1", "split": "dev"}],
            r"line 1: split 'dev' is not one of train, validation, test",
        ),
        (
            [{"query": "q", "doc_id": "d1", "split": "val"}, {"query": "r", "document_id": "d1"}],
            r"line 2: line 1 names a split and line 2 does not",
        ),
    ],
)
def test_bad_queries_name_file_and_line(tmp_path: Path, rows: list[object], message: str) -> None:
    docs = read_documents(jsonl(tmp_path / "d.jsonl", DOCS))
    with pytest.raises(DataFormatError, match=r"q.jsonl.*" + message):
        read_queries(jsonl(tmp_path / "q.jsonl", rows), docs)


def test_split_aliases_and_the_documents_digest(tmp_path: Path) -> None:
    docs = read_documents(jsonl(tmp_path / "d.jsonl", DOCS))
    rows = [
        {"query": "q", "doc_id": "d1", "split": "val"},
        {"query": "r", "doc_id": 2, "split": "TEST"},
    ]
    assert [q.split for q in read_queries(jsonl(tmp_path / "q.jsonl", rows), docs)] == [
        "validation",
        "test",
    ]
    changed = [Document(d.id, d.text + ".", d.title) for d in docs]
    assert documents_digest(docs) == documents_digest(list(docs))
    assert documents_digest(docs) != documents_digest(changed)
