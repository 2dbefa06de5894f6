"""Loading a configured dataset into one label map and seeded train/validation/test splits.

Duplicates are collapsed before any split; validation is carved from train; the label map is
fixed here from the whole dataset, the same on every client.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset

from car_fl.data.corpus import Document, read_documents, read_queries
from car_fl.data.corpus_splits import split_corpus
from car_fl.data.dedupe import DedupeStats, dedupe, drop_texts_in
from car_fl.data.labels import LabelMap
from car_fl.data.placement import hash_placement
from car_fl.data.readers import (
    DataFormatError,
    Example,
    read_ag_news,
    read_arxiv,
    read_sms_spam,
    read_table,
)
from car_fl.settings.schema import DatasetConfig, Reader, Split

log = logging.getLogger(__name__)


@dataclass
class DataSplits:
    """Train, validation and test sets as ``datasets.Dataset`` (``text`` str, ``label`` int);
    ``stats`` counts what was removed and kept. A corpus also gives its ``documents`` (label
    order) and its ``new_documents``; its ``train`` has a ``topic`` column."""

    train: Dataset
    validation: Dataset
    test: Dataset
    label_map: LabelMap
    stats: dict[str, int]
    documents: tuple[Document, ...] | None = None
    new_documents: frozenset[int] = frozenset()


def read_local(cfg: DatasetConfig, path: str | Path) -> list[Example]:
    """Read one local file with the reader the dataset config names."""
    reader = cfg.reader
    if reader is Reader.CORPUS:  # a node's own queries: document ids are the labels
        documents = read_documents(cfg.documents_path or "")
        return [Example(q.text, q.document_id) for q in read_queries(path, documents)]
    if reader is Reader.SMS_SPAM:
        return read_sms_spam(path)
    if reader is Reader.AG_NEWS:
        return read_ag_news(path)
    if reader is Reader.ARXIV:
        return read_arxiv(path)
    return read_table(path, text_column=cfg.text_column, label_column=cfg.label_column)


def read_hub(cfg: DatasetConfig) -> dict[str, list[Example]]:
    """Download a dataset from the Hugging Face hub; returns examples per split."""
    import datasets

    assert cfg.hub_id is not None
    try:
        loaded = datasets.load_dataset(cfg.hub_id, cfg.hub_config)
    except Exception as err:
        raise RuntimeError(
            f"could not load dataset {cfg.hub_id!r} from the Hugging Face hub ({err}). "
            f"Without network access, point at a local copy instead: dataset.path=/path/to/file"
        ) from err
    out = {}
    for split, table in loaded.items():
        for column in (cfg.text_column, cfg.label_column):
            if column not in table.column_names:
                raise ValueError(
                    f"hub dataset {cfg.hub_id!r} split {split!r} has no column {column!r} "
                    f"(columns: {table.column_names}); set dataset.text_column/label_column"
                )
        feature = table.features[cfg.label_column]
        labels = table[cfg.label_column]
        if isinstance(feature, ClassLabel):
            labels = [feature.int2str(int(i)) for i in labels]
        out[split] = [
            Example(text=str(t), label=str(lab))
            for t, lab in zip(table[cfg.text_column], labels, strict=True)
        ]
    return out


def _filter_rare(examples: list[Example], minimum: int) -> list[Example]:
    if minimum <= 1:
        return examples
    counts = Counter(e.label for e in examples)
    return [e for e in examples if counts[e.label] >= minimum]


def stratified_split(
    labels: list[int], *, test_fraction: float, seed: int, stratify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/test indices. Stratified: each label keeps its share in both parts."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    if not stratify:
        order = rng.permutation(n)
        n_test = max(1, round(n * test_fraction))
        return np.sort(order[n_test:]), np.sort(order[:n_test])
    array = np.asarray(labels)
    train_idx, test_idx = [], []
    for label in np.unique(array):
        members = rng.permutation(np.flatnonzero(array == label))
        n_test = round(len(members) * test_fraction)
        if len(members) >= 2:
            n_test = min(max(n_test, 1), len(members) - 1)
        test_idx.append(members[:n_test])
        train_idx.append(members[n_test:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))


def split_off(
    examples: list[Example], labels: list[int], *, fraction: float, seed: int, cfg: DatasetConfig
) -> tuple[list[Example], list[Example]]:
    """(kept, held out): ``fraction`` of ``examples`` held out, seeded (stratified with
    ``dataset.stratify``) or, with ``dataset.split=hash``, each by its own text's hash."""
    if cfg.split is Split.HASH:
        place = hash_placement([e.text for e in examples], seed=seed, purpose="split")
        return [e for e, p in zip(examples, place, strict=True) if p >= fraction], [
            e for e, p in zip(examples, place, strict=True) if p < fraction
        ]
    kept_idx, held_idx = stratified_split(
        labels, test_fraction=fraction, seed=seed, stratify=cfg.stratify
    )
    return [examples[i] for i in kept_idx], [examples[i] for i in held_idx]


def _subsample(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    if limit is None or len(examples) <= limit:
        return examples
    keep = np.sort(np.random.default_rng(seed + 1).choice(len(examples), limit, replace=False))
    return [examples[i] for i in keep]


def splits_digest(splits: dict[str, Sequence[tuple[str, str]]]) -> int:
    """48 bits of a SHA-256 of every split's (label, text) pairs in order: the same file in
    another order splits otherwise, with the same sizes (a resume compares it)."""
    digest = hashlib.sha256()
    for name in sorted(splits):
        digest.update(f"\x1e{name}\x1e".encode())
        for label, text in splits[name]:
            digest.update(f"{label}\x1f{text}\x1d".encode())
    return int(digest.hexdigest()[:12], 16)  # an exact integer in JSON


def load_examples(cfg: DatasetConfig, label_map: LabelMap) -> Dataset:
    """Every example of the local file ``cfg.path`` (a client's own shard), unsplit."""
    if cfg.path is None:
        raise ValueError("a pre-sharded node needs its shard file: --node-config data-path=...")
    # Not deduplicated: a pre-made shard is training data only, never split here.
    return _to_dataset(read_local(cfg, cfg.path), label_map, str(cfg.path))


def _to_dataset(examples: list[Example], label_map: LabelMap, source: str) -> Dataset:
    return Dataset.from_dict(
        {
            "text": [e.text for e in examples],
            "label": label_map.encode([e.label for e in examples], source=source),
        }
    )


def check_label_texts(cfg: DatasetConfig, names: Sequence[str], source: object) -> None:
    """Say so when ``dataset.label_texts`` describe none of the data's labels: they are another
    data set's (the ``sms_spam`` preset's ham and spam beside a file of other labels)."""
    described = set(cfg.label_texts)
    if described and not described & set(names):
        shown = ", ".join(list(names)[:6]) + (", ..." if len(names) > 6 else "")
        log.warning(
            "dataset.label_texts describe %s, none of which %s has (%s): they are not used; "
            "for a label<TAB>text file of its own labels use dataset=tsv",
            ", ".join(sorted(described)),
            source,
            shown,
        )


def load_splits(cfg: DatasetConfig, *, seed: int, label_map: LabelMap | None = None) -> DataSplits:
    """Read the configured dataset, remove duplicates, fix the label map, split it (seeded);
    a given ``label_map`` (the server's) is used, and a label it lacks is a ``ValueError``."""
    if cfg.reader is Reader.CORPUS:
        return load_corpus_splits(cfg, seed=seed, label_map=label_map)
    test: list[Example] | None = None
    if cfg.path is not None:
        train = read_local(cfg, cfg.path)
        if cfg.test_path is not None:
            test = read_local(cfg, cfg.test_path)
        source = str(cfg.path)
    else:
        per_split = read_hub(cfg)
        train = per_split.get("train") or next(iter(per_split.values()))
        test = per_split.get("test")
        source = str(cfg.hub_id)

    removed = DedupeStats()
    if cfg.dedupe:  # before splitting, so that no text can land in two splits
        canonical = cfg.split is Split.HASH  # one record changes at most one (DP's unit)
        train, removed = dedupe(train, canonical=canonical)
        if test is not None:
            test, test_removed = dedupe(test, canonical=canonical)
            train, removed.test_overlap_removed = drop_texts_in(train, test)
            removed = removed + test_removed
    train = _filter_rare(_subsample(train, cfg.max_examples, seed), cfg.min_examples_per_label)
    if test is not None:
        limit = None if cfg.max_examples is None else max(1, round(cfg.max_examples / 4))
        test = _subsample(test, limit, seed)
        if cfg.min_examples_per_label > 1:  # labels dropped as rare go from the test set too
            kept = {e.label for e in train}
            test = [e for e in test if e.label in kept]
    all_examples = train + (test or [])
    if not train:
        raise DataFormatError(
            source,
            f"no examples left after dropping labels with fewer than "
            f"{cfg.min_examples_per_label} examples (dataset.min_examples_per_label)",
        )
    if label_map is None:
        label_map = LabelMap.from_labels(e.label for e in all_examples)
    else:
        label_map.encode([e.label for e in all_examples], source=source)
    if len(label_map) < 2:
        raise DataFormatError(source, f"needs at least 2 labels, found {label_map.to_list()}")
    check_label_texts(cfg, label_map.names, source)

    if test is None:
        ids = label_map.encode([e.label for e in train], source=source)
        train, test = split_off(train, ids, fraction=cfg.test_fraction, seed=seed, cfg=cfg)
    validation: list[Example] = []
    if cfg.val_fraction > 0:  # carved from train, with a seed of its own
        ids = label_map.encode([e.label for e in train], source=source)
        train, validation = split_off(train, ids, fraction=cfg.val_fraction, seed=seed + 2, cfg=cfg)
    if not train or not test:
        raise DataFormatError(
            source,
            f"{len(train)} training and {len(test)} test examples after the split "
            f"(dataset.split={cfg.split}): too few examples for dataset.test_fraction="
            f"{cfg.test_fraction}",
        )

    stats = {
        "train_examples": len(train),
        "validation_examples": len(validation),
        "test_examples": len(test),
        **removed.as_dict(),
        "splits_digest": splits_digest(
            {
                name: [(e.label, e.text) for e in examples]
                for name, examples in (("train", train), ("validation", validation), ("test", test))
            }
        ),
    }
    log.info(
        "dataset %s: %d train, %d validation, %d test examples, %d labels; duplicates removed: "
        "%d copies, %d with conflicting labels, %d training texts also in the test file",
        cfg.label,
        len(train),
        len(validation),
        len(test),
        len(label_map),
        removed.duplicates_removed,
        removed.conflicting_removed,
        removed.test_overlap_removed,
    )
    return DataSplits(
        train=_to_dataset(train, label_map, source),
        validation=_to_dataset(validation, label_map, source),
        test=_to_dataset(test, label_map, source),
        label_map=label_map,
        stats=stats,
    )


def load_corpus_splits(
    cfg: DatasetConfig, *, seed: int, label_map: LabelMap | None = None
) -> DataSplits:
    """A corpus (:mod:`car_fl.data.corpus`) split per document (:mod:`car_fl.data.corpus_splits`);
    its label map is the document ids in file order, which a given ``label_map`` must equal."""
    if cfg.path is None or cfg.documents_path is None:
        raise ValueError(
            "dataset.reader=corpus needs dataset.path (queries) and dataset.documents_path"
        )
    documents = read_documents(cfg.documents_path)
    queries = read_queries(cfg.path, documents)
    names = LabelMap(tuple(d.id for d in documents))
    if label_map is not None and label_map.names != names.names:
        raise ValueError(
            f"the documents of {cfg.documents_path} differ from the server's corpus "
            f"({len(names)} here, {len(label_map)} there); every party needs the same documents "
            "file"
        )
    split = split_corpus(
        documents,
        queries,
        new_fraction=cfg.new_fraction,
        seed=seed,
        pseudo_queries=cfg.pseudo_queries,
        pseudo_query_words=cfg.pseudo_query_words,
        generated=(
            read_queries(cfg.generated_queries_path, documents)
            if cfg.generated_queries_path
            else ()
        ),
    )
    topics = [str(d.metadata.get(cfg.topic_key, "")) for d in documents]

    def table(name: str, *, topic: bool = False) -> Dataset:
        columns: dict[str, list[object]] = {
            "text": list(split.texts[name]),
            "label": list(split.documents[name]),
        }
        if topic:
            columns["topic"] = [topics[d] for d in split.documents[name]]
        return Dataset.from_dict(columns)

    log.info(
        "corpus %s: %d documents (%d new), %d train, %d validation, %d test queries; removed: "
        "%d duplicate, %d conflicting or cross-split, %d held-out inside their document",
        cfg.name,
        len(documents),
        len(split.new_documents),
        len(split.texts["train"]),
        len(split.texts["validation"]),
        len(split.texts["test"]),
        split.stats.get("duplicates_removed", 0),
        split.stats.get("conflicting_or_cross_split_removed", 0),
        split.stats.get("heldout_in_document_removed", 0),
    )
    return DataSplits(
        train=table("train", topic=True),
        validation=table("validation"),
        test=table("test"),
        label_map=names,
        stats={
            "train_examples": len(split.texts["train"]),
            "validation_examples": len(split.texts["validation"]),
            "test_examples": len(split.texts["test"]),
            **split.stats,
            "splits_digest": splits_digest(
                {
                    name: list(zip(map(str, split.documents[name]), split.texts[name], strict=True))
                    for name in ("train", "validation", "test")
                }
            ),
        },
        documents=tuple(documents),
        new_documents=split.new_documents,
    )
