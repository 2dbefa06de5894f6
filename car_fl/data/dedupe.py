"""Duplicates over normalised text (NFKC, whitespace, case, the marks around words), so that no
text lands in two splits.

Copies with one label collapse to the first; copies with conflicting labels are all dropped.
``canonical`` (``dataset.split=hash``) keeps each (normalised text, label) once as its
normalised text and conflicting copies too, so one record changes the result by at most itself
(record-level DP's unit); copies that differ in case or marks then stay apart but share a
split, since the hash placement reads :func:`duplicate_key`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from car_fl.data.readers import Example


def normalize_text(text: str) -> str:
    """NFKC-normalised text with every run of whitespace replaced by one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def duplicate_key(text: str) -> str:
    """What copies share: :func:`normalize_text`, case folded, with the marks that end or set off
    words read as a space ("Yup..." is "yup", "Call later In meeting." is "call later in
    meeting"). A mark inside a word ("I'll", "1.5", "e-mail") stays, as do brackets (":)" is
    not ":("), dashes ("-5" is not "5") and ``# @ %``; a text of such marks alone is its own
    key."""
    folded = normalize_text(text).casefold()
    spaced = _MARK.sub(lambda m: " " if _sets_off(folded, m.start()) else m[0], folded)
    return " ".join(spaced.split()) or folded


#: Where a mark may be (``\w`` is ``str.isalnum`` or ``_``): found in C, judged in Python.
_MARK = re.compile(r"[^\w\s]|_")


def _sets_off(text: str, i: int) -> bool:
    if unicodedata.category(text[i]) not in ("Po", "Pi", "Pf", "Pc") or text[i] in "#@%":
        return False
    return not (0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum())


@dataclass
class DedupeStats:
    """How many examples the duplicate rules removed, per rule."""

    #: Later copies of a text already seen with the same label.
    duplicates_removed: int = 0
    #: Every copy of a text that occurs with more than one label.
    conflicting_removed: int = 0
    #: Training examples whose text is also in the given test file.
    test_overlap_removed: int = 0

    def __add__(self, other: DedupeStats) -> DedupeStats:
        return DedupeStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def dedupe(
    examples: Sequence[Example], *, canonical: bool = False
) -> tuple[list[Example], DedupeStats]:
    """One example per normalised text, in first-seen order; conflicting texts dropped
    (``canonical``: one per normalised text and label, as that text; see the module)."""
    if canonical:
        stats = DedupeStats()
        unique: dict[tuple[str, str], Example] = {}
        for example in examples:
            pair = (normalize_text(example.text), example.label)
            if pair in unique:
                stats.duplicates_removed += 1
            else:
                unique[pair] = Example(text=pair[0], label=example.label)
        return list(unique.values()), stats
    labels: dict[str, set[str]] = {}
    for example in examples:
        labels.setdefault(duplicate_key(example.text), set()).add(example.label)
    kept: list[Example] = []
    seen: set[str] = set()
    stats = DedupeStats()
    for example in examples:
        key = duplicate_key(example.text)
        if len(labels[key]) > 1:
            stats.conflicting_removed += 1
        elif key in seen:
            stats.duplicates_removed += 1
        else:
            seen.add(key)
            kept.append(example)
    return kept, stats


def drop_texts_in(
    examples: Sequence[Example], others: Iterable[Example]
) -> tuple[list[Example], int]:
    """``examples`` without those whose text (:func:`duplicate_key`) occurs in ``others``; and
    how many."""
    taken = {duplicate_key(e.text) for e in others}
    kept = [e for e in examples if duplicate_key(e.text) not in taken]
    return kept, len(examples) - len(kept)
