"""Datasets of the method: readers, the global label map, the split and client shards."""

from car_fl.data.labels import LabelMap
from car_fl.data.partition import make_partitioner, partition
from car_fl.data.readers import DataFormatError, Example
from car_fl.data.splits import DataSplits, load_splits

__all__ = [
    "DataFormatError",
    "DataSplits",
    "Example",
    "LabelMap",
    "load_splits",
    "make_partitioner",
    "partition",
]
