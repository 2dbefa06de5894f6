"""How a node whose owner set a privacy policy reads its data file: its own way, never the run's.

How a file becomes examples (reader, columns, dedupe, label filters, subsample, split and its
seed) is a function of the records, so a run choosing it could make one record decide the
others' fate. On a node with a policy these keys come from the policy's ``[data]`` table (or
car-fl's defaults); on a shared file a run that reads otherwise is refused (``READING_DIFFERS``).
See docs/privacy.md, 'What a server's run config may set'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from car_fl.settings.schema import DatasetConfig, Reader, Settings, Split

log = logging.getLogger(__name__)

_DEFAULTS = DatasetConfig()
#: Keys only a table reader reads, only a corpus reader reads, and that every reader but a
#: corpus's reads (a corpus is split per document, with fixed fractions: ``split_corpus``).
_TABLE_KEYS = frozenset({"text_column", "label_column"})
_CORPUS_KEYS = frozenset(
    {
        "new_fraction",
        "topic_key",
        "pseudo_queries",
        "pseudo_query_words",
        "documents_path",
        "generated_queries_path",
    }
)
_FILE_KEYS = frozenset(
    {
        "dedupe",
        "split",
        "stratify",
        "min_examples_per_label",
        "max_examples",
        "test_fraction",
        "val_fraction",
        "test_path",
    }
)
_DEFAULT_SEED = Settings().seed

#: The ``[data]`` keys and the setting each fixes (``seed`` is the run's top-level seed).
KEYS: Mapping[str, str] = MappingProxyType(
    {
        "reader": "dataset.reader",
        "text-column": "dataset.text_column",
        "label-column": "dataset.label_column",
        "dedupe": "dataset.dedupe",
        "split": "dataset.split",
        "stratify": "dataset.stratify",
        "min-examples-per-label": "dataset.min_examples_per_label",
        "max-examples": "dataset.max_examples",
        "test-fraction": "dataset.test_fraction",
        "val-fraction": "dataset.val_fraction",
        "new-fraction": "dataset.new_fraction",
        "topic-key": "dataset.topic_key",
        "pseudo-queries": "dataset.pseudo_queries",
        "pseudo-query-words": "dataset.pseudo_query_words",
        "seed": "seed",
    }
)


class ReadingError(ValueError):
    """A ``[data]`` value of the policy is invalid (the message names where and why)."""


@dataclass(frozen=True)
class NodeReading:
    """The node owner's reading of its data file (see the module docstring)."""

    reader: Reader = _DEFAULTS.reader
    text_column: str = _DEFAULTS.text_column
    label_column: str = _DEFAULTS.label_column
    dedupe: bool = _DEFAULTS.dedupe
    split: Split = _DEFAULTS.split
    stratify: bool = _DEFAULTS.stratify
    min_examples_per_label: int = _DEFAULTS.min_examples_per_label
    max_examples: int | None = _DEFAULTS.max_examples
    test_fraction: float = _DEFAULTS.test_fraction
    val_fraction: float = _DEFAULTS.val_fraction
    new_fraction: float = _DEFAULTS.new_fraction
    topic_key: str = _DEFAULTS.topic_key
    pseudo_queries: int = _DEFAULTS.pseudo_queries
    pseudo_query_words: int = _DEFAULTS.pseudo_query_words
    seed: int = _DEFAULT_SEED

    @classmethod
    def parse(cls, table: object, *, where: Callable[[str], str]) -> NodeReading:
        """The reading of a policy's ``[data]`` table (``where(key)`` prefixes errors with the
        file, line and key); a key the table leaves out keeps car-fl's default."""
        if not isinstance(table, Mapping):
            raise ReadingError(where("data") + "must be a table: [data] with reader = ... below it")
        unknown = sorted(set(table) - set(KEYS))
        if unknown:
            raise ReadingError(
                where(unknown[0]) + f"unknown [data] key; the keys are: {', '.join(KEYS)}"
            )
        values: dict[str, Any] = {}
        for key, value in table.items():
            name = key.replace("-", "_")
            values[name] = _checked(name, value, where(key))
        try:  # the schema's own checks (fractions, a corpus without documents is the run's)
            reading = cls(**values)
            DatasetConfig(**{**_reading_fields(reading), "path": "-"})
        except ValueError as err:
            raise ReadingError(where("data") + str(err)) from None
        return reading

    def apply(
        self,
        settings: Settings,
        *,
        source: object = "the privacy policy",
        paths: Mapping[str, str | None] | None = None,
    ) -> Settings:
        """``settings`` with this reading; a run's value that differs is logged and ignored.

        ``paths``: the node's own test, documents and generated-queries files (``None`` when
        its node config names none); the run's are never used."""
        ignored = self.differences(settings)
        if ignored:
            log.warning(
                "this node reads its data file as its owner set in %s ([data]), not as the run "
                "says: ignored %s",
                source,
                ", ".join(ignored),
            )
        for key, value in (paths or {}).items():
            if getattr(settings.dataset, key) not in (None, "", value):
                log.warning(
                    "the run's dataset.%s=%s is ignored: on a node with a privacy policy only "
                    "its node config names it",
                    key,
                    getattr(settings.dataset, key),
                )
        own: dict[str, Any] = {key: value or None for key, value in (paths or {}).items()}
        dataset = dataclasses.replace(settings.dataset, **_reading_fields(self), **own)
        return dataclasses.replace(settings, dataset=dataset, seed=self.seed)

    def differences(
        self,
        settings: Settings,
        *,
        paths: Mapping[str, str | None] | None = None,
        run_paths: Mapping[str, str | None] | None = None,
    ) -> list[str]:
        """The run's reading keys that differ from this one, as ``key=run's value``; with
        ``paths``, also a file one side names and the other does not (the run's files are
        ``settings``' unless ``run_paths`` gives them)."""
        readers = {self.reader, settings.dataset.reader}
        found = [
            f"{KEYS[key.replace('_', '-')]}={getattr(settings.dataset, key)!r}"
            for key, value in _reading_fields(self).items()
            if getattr(settings.dataset, key) != value and _matters(key, readers)
        ]
        if settings.seed != self.seed:
            found.append(f"seed={settings.seed}")
        for key, value in (paths or {}).items():
            run = (run_paths or {}).get(key, getattr(settings.dataset, key))
            if _matters(key, readers) and bool(run) != bool(value):
                found.append(f"dataset.{key}={run!r} (this node's: {value or None!r})")
        return found

    def refusal(
        self,
        settings: Settings,
        *,
        paths: Mapping[str, str | None],
        run_paths: Mapping[str, str | None] | None = None,
        source: object = "the privacy policy",
    ) -> str | None:
        """Why a node on a shared file refuses a run that reads it otherwise, or ``None``."""
        differs = self.differences(settings, paths=paths, run_paths=run_paths)
        if not differs:
            return None
        return (
            f"the run reads the shared data file otherwise than {source}'s [data]: "
            f"{', '.join(differs)}; this node's split would not be the server's (its training "
            "records could be in the server's test split), so it takes no part until the run "
            "reads as [data] says (or the node holds its own shard: data-is-shard)"
        )


def _matters(key: str, readers: set[Reader]) -> bool:
    """Whether a differing ``key`` (a dataset field or path) changes what either reader reads."""
    if key in _TABLE_KEYS:
        return Reader.TABLE in readers
    if key in _CORPUS_KEYS:
        return Reader.CORPUS in readers
    if key in _FILE_KEYS:
        return bool(readers - {Reader.CORPUS})
    return True


def _reading_fields(reading: NodeReading) -> dict[str, Any]:
    """The dataset fields of ``reading`` (all but the seed)."""
    return {
        f.name: getattr(reading, f.name) for f in dataclasses.fields(reading) if f.name != "seed"
    }


def _checked(name: str, value: object, where: str) -> object:
    """``value`` of the ``[data]`` key ``name``, of the type its setting has."""
    choices = {"reader": Reader, "split": Split}
    if name in choices:
        kind = choices[name]
        if value not in {c.value for c in kind}:
            valid = ", ".join(c.value for c in kind)
            raise ReadingError(where + f"must be one of {valid}, got {value!r}")
        return kind(value)
    if name in ("dedupe", "stratify"):
        if not isinstance(value, bool):
            raise ReadingError(where + f"must be true or false, got {value!r}")
        return value
    if name in ("text_column", "label_column", "topic_key"):
        if not isinstance(value, str) or not value:
            raise ReadingError(where + f"must be a non-empty string, got {value!r}")
        return value
    if name in (
        "min_examples_per_label",
        "max_examples",
        "seed",
        "pseudo_queries",
        "pseudo_query_words",
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ReadingError(where + f"must be a whole number, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ReadingError(where + f"must be a number, got {value!r}")
    return float(value)
