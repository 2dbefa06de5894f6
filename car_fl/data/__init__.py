"""Datasets of the method: readers, the global label map, the split and client shards.

Names are imported on first use (PEP 562), so that ``car_fl.data.labels`` does not pull in
``datasets`` and ``flwr_datasets`` (about 2.5 s): a client round on cached data needs neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for mypy; imported lazily at run time
    from car_fl.data.labels import LabelMap
    from car_fl.data.partition import make_partitioner, partition
    from car_fl.data.readers import DataFormatError, Example
    from car_fl.data.splits import DataSplits, load_splits

_HOMES = {
    "LabelMap": "car_fl.data.labels",
    "make_partitioner": "car_fl.data.partition",
    "partition": "car_fl.data.partition",
    "DataFormatError": "car_fl.data.readers",
    "Example": "car_fl.data.readers",
    "DataSplits": "car_fl.data.splits",
    "load_splits": "car_fl.data.splits",
}

__all__ = [
    "DataFormatError",
    "DataSplits",
    "Example",
    "LabelMap",
    "load_splits",
    "make_partitioner",
    "partition",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    # Importing ``car_fl.data.partition`` binds the submodule to this package's name
    # ``partition``; bind the function instead, as the eager import used to.
    globals()[name] = value
    return value
