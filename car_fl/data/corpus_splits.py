"""A corpus's queries split per document, with no query text in two splits, and new documents.

Rules, in order (:func:`split_corpus`):

1. **Splits.** Named splits are kept; otherwise a document's last query is test, the one before
   validation, the rest train.
2. **Duplicates** (:func:`~car_fl.data.dedupe.duplicate_key`: NFKC, whitespace, case, marks)
   collapse when they agree; a text with two documents or in two splits is dropped everywhere.
3. A validation or test query whose words stand, in order and whole, in its own document is
   dropped ("alpha beta" in "the alpha beta test", "bert" in "(BERT)", not "cat" in
   "education").
4. **New documents.** ``new_fraction`` of the documents (seeded) lose their training queries.
5. **Pseudo-queries** and 6. **generated queries** join the training queries after the real
   ones: none for a new document, none whose text is a kept query's or two documents share.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from car_fl.data.corpus import SPLITS, CorpusQuery, Document
from car_fl.data.dedupe import duplicate_key
from car_fl.data.pseudo_queries import DEFAULT_WORDS, extractive_queries


def words(text: str) -> str:
    """``text``'s words (``\\w`` runs of :func:`~car_fl.data.dedupe.duplicate_key`, so "(BERT)"
    and "cat-like" hold "bert" and "cat"), one space between, one at each end (rule 3)."""
    return f" {' '.join(_WORD.findall(duplicate_key(text)))} "


_WORD = re.compile(r"\w+")


def phrase_in(text: str, document_words: str) -> bool:
    """Whether ``text``'s words stand whole and in order in a document's :func:`words`."""
    return words(text) in document_words


def new_document_indices(count: int, *, new_fraction: float, seed: int) -> frozenset[int]:
    """The new documents among ``count``: a seeded choice of round(new_fraction·count)."""
    order = np.random.default_rng(seed).permutation(count)
    return frozenset(int(i) for i in order[: round(new_fraction * count)])


@dataclass
class CorpusSplit:
    """Query texts and document indices per split; the new documents; what was removed."""

    texts: dict[str, list[str]]
    documents: dict[str, list[int]]
    new_documents: frozenset[int]
    stats: dict[str, int]


def assign_splits(queries: Sequence[CorpusQuery]) -> list[str]:
    """Each query's split: its own, or by position among its document's queries."""
    if all(q.split is not None for q in queries):
        return [str(q.split) for q in queries]
    per_doc: dict[str, list[int]] = defaultdict(list)
    for i, q in enumerate(queries):
        per_doc[q.document_id].append(i)
    out = ["train"] * len(queries)
    for members in per_doc.values():
        out[members[-1]] = "test"
        if len(members) >= 3:
            out[members[-2]] = "validation"
    return out


def split_corpus(
    documents: Sequence[Document],
    queries: Sequence[CorpusQuery],
    *,
    new_fraction: float,
    seed: int,
    pseudo_queries: int = 0,
    pseudo_query_words: int = DEFAULT_WORDS,
    generated: Sequence[CorpusQuery] = (),
) -> CorpusSplit:
    """Apply the module's rules; document indices follow ``documents``' order."""
    index = {d.id: i for i, d in enumerate(documents)}
    splits = assign_splits(queries)
    groups: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for q, split in zip(queries, splits, strict=True):
        groups[duplicate_key(q.text)].append((q.text, index[q.document_id], split))
    stats: Counter[str] = Counter()
    kept: list[tuple[str, int, str]] = []
    for occurrences in groups.values():
        if len({(d, s) for _, d, s in occurrences}) > 1:
            stats["conflicting_or_cross_split_removed"] += len(occurrences)
            continue
        stats["duplicates_removed"] += len(occurrences) - 1
        kept.append(occurrences[0])
    doc_keys = [words(d.text) for d in documents]
    inside = {i for i, (t, d, s) in enumerate(kept) if s != "train" and phrase_in(t, doc_keys[d])}
    stats["heldout_in_document_removed"] = len(inside)
    kept = [q for i, q in enumerate(kept) if i not in inside]

    new = new_document_indices(len(documents), new_fraction=new_fraction, seed=seed)
    stats["new_document_train_queries_removed"] = sum(
        1 for _, d, s in kept if s == "train" and d in new
    )
    kept = [q for q in kept if not (q[2] == "train" and q[1] in new)]  # file order
    taken = {duplicate_key(t) for t, _, _ in kept}
    pseudo = extractive_queries(
        [d.text for d in documents],
        per_document=pseudo_queries,
        words=pseudo_query_words,
        seed=seed,
        skip=new,
    )
    written = [(q.text, index[q.document_id]) for q in generated if index[q.document_id] not in new]
    owners: dict[str, set[int]] = defaultdict(set)
    first: dict[str, tuple[str, int, str]] = {}
    kind: dict[str, str] = {}
    for origin, extra in (("pseudo_queries", pseudo), ("generated_queries", written)):
        for text, doc in extra:
            owners[duplicate_key(text)].add(doc)
            first.setdefault(duplicate_key(text), (text, doc, "train"))
            kind.setdefault(duplicate_key(text), origin)
    # once each; a text two documents share has no right answer (rule 2): dropped
    fresh = [key for key in first if key not in taken and len(owners[key]) == 1]
    stats["pseudo_queries"] = sum(kind[key] == "pseudo_queries" for key in fresh)
    stats["generated_queries"] = sum(kind[key] == "generated_queries" for key in fresh)
    kept += [first[key] for key in fresh]

    texts: dict[str, list[str]] = {s: [] for s in SPLITS}
    docs: dict[str, list[int]] = {s: [] for s in SPLITS}
    for text, doc, split in kept:
        texts[split].append(text)
        docs[split].append(doc)
    trained = set(docs["train"])
    stats.update(
        {
            "documents": len(documents),
            "new_documents": len(new),
            "documents_without_train_queries": len(documents) - len(trained),
            **{f"{s}_queries": len(texts[s]) for s in SPLITS},
            **{f"{s}_queries_of_new_documents": sum(d in new for d in docs[s]) for s in SPLITS},
        }
    )
    return CorpusSplit(texts=texts, documents=docs, new_documents=new, stats=dict(stats))
