"""Readers for the method's datasets in their original file formats, and for any table.

Every reader returns a list of :class:`Example` (text, label name). Malformed input raises
:class:`DataFormatError` naming the file, the line (1-based) and the problem.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

AG_NEWS_CLASSES = {1: "World", 2: "Sports", 3: "Business", 4: "Sci/Tech"}


@dataclass(frozen=True)
class Example:
    """One query text and the name of the label (document) it belongs to."""

    text: str
    label: str


class DataFormatError(ValueError):
    """A data file is missing or malformed; the message names the file and the line."""

    def __init__(self, path: Path | str, problem: str, line: int | None = None) -> None:
        where = f"{path}" if line is None else f"{path}, line {line}"
        super().__init__(f"{where}: {problem}")
        self.path = Path(path)
        self.line = line


def _require_file(path: Path) -> None:
    if not path.exists():
        raise DataFormatError(path, "file not found; check dataset.path / dataset.test_path")
    if not path.is_file():
        raise DataFormatError(path, "is not a regular file")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    _require_file(path)
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            for number, line in enumerate(handle, start=1):
                yield number, line.rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataFormatError(path, f"not valid UTF-8 ({err.reason} at byte {err.start})") from err


def read_sms_spam(path: Path | str) -> list[Example]:
    """The SMS Spam Collection: ``label<TAB>text`` per line, no header."""
    path = Path(path)
    examples = []
    for number, line in _lines(path):
        if not line.strip():
            continue
        label, sep, text = line.partition("\t")
        if not sep:
            raise DataFormatError(path, "expected 'label<TAB>text', found no TAB", number)
        label = label.strip()
        if not label or not text.strip():
            raise DataFormatError(path, "empty label or empty text", number)
        examples.append(Example(text=text, label=label))
    if not examples:
        raise DataFormatError(path, "contains no examples")
    return examples


def read_ag_news(path: Path | str) -> list[Example]:
    """AG News CSV (``"class index (1-4)","title","description"``, no header): the text is
    ``title + " " + description``, the label the class name (World, Sports, ...)."""
    path = Path(path)
    _require_file(path)
    examples = []
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        try:
            for row in reader:
                number = reader.line_num
                if not row:
                    continue
                if len(row) != 3:
                    raise DataFormatError(
                        path,
                        f"expected 3 columns (class, title, description), found {len(row)}",
                        number,
                    )
                try:
                    label = AG_NEWS_CLASSES[int(row[0])]
                except (ValueError, KeyError):
                    raise DataFormatError(
                        path, f"class index must be 1-4, found {row[0]!r}", number
                    ) from None
                title, description = row[1].strip(), row[2].strip()
                text = f"{title} {description}".strip().replace("\\", " ")
                if not text:
                    raise DataFormatError(path, "empty title and description", number)
                examples.append(Example(text=text, label=label))
        except csv.Error as err:
            raise DataFormatError(path, f"CSV error: {err}", reader.line_num) from err
    if not examples:
        raise DataFormatError(path, "contains no examples")
    return examples


def read_arxiv(path: Path | str) -> list[Example]:
    """arXiv metadata snapshot (JSON lines): the text is ``title + ". " + abstract``, whitespace
    collapsed; the label the first of the space-separated ``categories``."""
    path = Path(path)
    examples = []
    for number, record in _json_rows(path):
        missing = [key for key in ("title", "abstract", "categories") if key not in record]
        if missing:
            raise DataFormatError(path, f"missing field(s) {', '.join(missing)}", number)
        categories = str(record["categories"]).split()
        if not categories:
            raise DataFormatError(path, "empty 'categories'", number)
        title = " ".join(str(record["title"]).split())
        abstract = " ".join(str(record["abstract"]).split())
        examples.append(Example(text=f"{title}. {abstract}", label=categories[0]))
    if not examples:
        raise DataFormatError(path, "contains no examples")
    return examples


TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def read_table(path: Path | str, *, text_column: str, label_column: str) -> list[Example]:
    """Any CSV / TSV (with a header), JSON lines or Parquet file with a text and a label column."""
    path = Path(path)
    examples = []
    for number, row in table_rows(path, TABLE_SUFFIXES, "table format"):
        for column in (text_column, label_column):
            if column not in row:
                raise DataFormatError(
                    path,
                    f"no column {column!r} (columns: {', '.join(map(str, row))}); set "
                    "dataset.text_column / dataset.label_column",
                    number,
                )
        text, label = row[text_column], row[label_column]
        if text is None or label is None or not str(text).strip() or not str(label).strip():
            raise DataFormatError(path, "empty text or label", number)
        examples.append(Example(text=str(text), label=str(label).strip()))
    if not examples:
        raise DataFormatError(path, "contains no examples")
    return examples


def table_rows(
    path: Path, suffixes: Sequence[str], kind: str
) -> Iterator[tuple[int, dict[str, object]]]:
    """Each row of a CSV / TSV (with a header), JSON lines or Parquet file and its line number;
    a file whose suffix is not in ``suffixes`` is refused as an unknown ``kind``."""
    _require_file(path)
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        raise DataFormatError(path, f"unknown {kind} {suffix!r}; use one of {', '.join(suffixes)}")
    if suffix in (".csv", ".tsv"):
        return _csv_rows(path, delimiter="\t" if suffix == ".tsv" else ",")
    if suffix in (".jsonl", ".json"):
        return _json_rows(path)
    return _parquet_rows(path)


def _csv_rows(path: Path, *, delimiter: str) -> Iterator[tuple[int, dict[str, object]]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        try:
            for row in reader:
                if None in row:
                    raise DataFormatError(path, "more fields than the header has", reader.line_num)
                yield reader.line_num, dict(row)
        except csv.Error as err:
            raise DataFormatError(path, f"CSV error: {err}", reader.line_num) from err
        except UnicodeDecodeError as err:
            raise DataFormatError(path, f"not valid UTF-8 ({err.reason})") from err


def _json_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(path, f"invalid JSON ({err.msg})", number) from err
        if not isinstance(record, dict):
            raise DataFormatError(path, "expected a JSON object", number)
        yield number, record


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:
        raise DataFormatError(path, f"cannot read Parquet: {err}") from err
    yield from enumerate(table.to_pylist(), start=1)
