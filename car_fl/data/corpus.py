"""Document corpora for retrieval: a documents file and a queries file, read with line numbers.

Documents: JSON lines (``id``, ``text``, optional ``title``, ``metadata``; other fields join the
metadata) or a CSV/TSV with ``id`` and ``text`` columns. Queries: ``query``, ``document_id``
and optional ``split`` (all or none). Malformed input is a
:class:`~car_fl.data.readers.DataFormatError` naming the file, the line and the problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from car_fl.data.readers import DataFormatError, table_rows

SPLITS = ("train", "validation", "test")
#: Accepted spellings of a split name.
SPLIT_ALIASES = {"train": "train", "validation": "validation", "val": "validation", "test": "test"}
DOCUMENT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")


@dataclass(frozen=True)
class Document:
    """One document: its id (the label name), text, optional title and metadata."""

    id: str
    text: str
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CorpusQuery:
    """One query, the id of the document that answers it, and its split (``None``: assign)."""

    text: str
    document_id: str
    split: str | None = None
    #: Line of the queries file (1-based), for error messages.
    line: int = 0


def _text(value: object) -> str:
    return "" if value is None else " ".join(str(value).split())


def read_documents(path: Path | str) -> list[Document]:
    """The documents of a corpus, in file order; ids must be unique and texts non-empty."""
    path = Path(path)
    documents: list[Document] = []
    first_line: dict[str, int] = {}
    for number, row in table_rows(path, DOCUMENT_SUFFIXES, "format"):
        missing = [key for key in ("id", "text") if key not in row]
        if missing:
            raise DataFormatError(
                path,
                f"a document needs the field(s) {', '.join(missing)} (found: "
                f"{', '.join(map(str, row)) or 'none'})",
                number,
            )
        doc_id, text = _text(row["id"]), _text(row["text"])
        if not doc_id:
            raise DataFormatError(path, "empty document id", number)
        if not text:
            raise DataFormatError(path, f"document {doc_id!r} has an empty text", number)
        if doc_id in first_line:
            raise DataFormatError(
                path,
                f"duplicate document id {doc_id!r} (first on line {first_line[doc_id]})",
                number,
            )
        first_line[doc_id] = number
        metadata = row.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise DataFormatError(path, "'metadata' must be a JSON object", number)
        extra = {k: v for k, v in row.items() if k not in ("id", "text", "title", "metadata")}
        documents.append(
            Document(
                id=doc_id,
                text=text,
                title=_text(row.get("title")),
                metadata={**(metadata or {}), **extra},
            )
        )
    if not documents:
        raise DataFormatError(path, "contains no documents")
    return documents


def read_queries(path: Path | str, documents: Sequence[Document]) -> list[CorpusQuery]:
    """The queries of a corpus, each naming a document of ``documents``."""
    path = Path(path)
    known = {d.id for d in documents}
    queries: list[CorpusQuery] = []
    with_split: int | None = None
    without_split: int | None = None
    for number, row in table_rows(path, DOCUMENT_SUFFIXES, "format"):
        doc_key = next((k for k in ("document_id", "doc_id") if k in row), None)
        if "query" not in row or doc_key is None:
            raise DataFormatError(
                path,
                "a query needs the fields query and document_id (found: "
                f"{', '.join(map(str, row)) or 'none'})",
                number,
            )
        text, doc_id = _text(row["query"]), _text(row[doc_key])
        if not text:
            raise DataFormatError(path, "empty query text", number)
        if doc_id not in known:
            raise DataFormatError(
                path,
                f"document id {doc_id!r} is not in the documents file (dataset.documents_path)",
                number,
            )
        raw_split = _text(row.get("split")).lower()
        split = SPLIT_ALIASES.get(raw_split) if raw_split else None
        if raw_split and split is None:
            raise DataFormatError(
                path, f"split {raw_split!r} is not one of {', '.join(SPLITS)}", number
            )
        if split is None:
            without_split = without_split or number
        else:
            with_split = with_split or number
        if with_split and without_split:
            raise DataFormatError(
                path,
                f"line {with_split} names a split and line {without_split} does not; give every "
                "query a split, or none (then car-fl assigns them per document)",
                number,
            )
        queries.append(CorpusQuery(text=text, document_id=doc_id, split=split, line=number))
    if not queries:
        raise DataFormatError(path, "contains no queries")
    return queries


def documents_digest(documents: Sequence[Document]) -> str:
    """SHA-256 of the documents' ids and texts, in order (a checkpoint names its corpus by it)."""
    hasher = hashlib.sha256()
    for doc in documents:
        for part in (doc.id, doc.text):
            encoded = part.encode("utf-8")
            hasher.update(len(encoded).to_bytes(8, "little") + encoded)
    return hasher.hexdigest()[:32]
