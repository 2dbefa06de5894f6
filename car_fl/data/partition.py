"""Client shards: IID or Dirichlet(α) non-IID, with flwr-datasets partitioners.

Shards are cut from the training split after the label map is fixed; each example lands in one.
IID shards are cut from a seeded shuffle and keep file order; ``hash`` shards place each
example by a keyed hash of its own text (:func:`~car_fl.data.placement.hash_placement`).
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner

from car_fl.data.placement import hash_placement
from car_fl.settings.schema import Partitioning


def make_partitioner(
    *,
    num_partitions: int,
    scheme: Partitioning = Partitioning.IID,
    alpha: float = 1.0,
    seed: int = 42,
    min_partition_size: int = 1,
) -> Partitioner:
    """A flwr-datasets partitioner by name: ``iid``, ``dirichlet`` (over the label column) or
    ``topic`` (Dirichlet over a corpus's ``topic`` column); ``hash`` has none (see
    :func:`partition`)."""
    if num_partitions < 1:
        raise ValueError(f"number of partitions must be >= 1, got {num_partitions}")
    if scheme is Partitioning.IID:
        return IidPartitioner(num_partitions=num_partitions)
    if scheme in (Partitioning.DIRICHLET, Partitioning.TOPIC):
        if alpha <= 0:
            raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="topic" if scheme is Partitioning.TOPIC else "label",
            alpha=alpha,
            min_partition_size=min_partition_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    raise AssertionError(f"no partitioner for {scheme!r}")


def partition(
    dataset: Dataset,
    *,
    partition_id: int,
    num_partitions: int,
    scheme: Partitioning = Partitioning.IID,
    alpha: float = 1.0,
    seed: int = 42,
) -> Dataset:
    """Shard ``partition_id`` of ``num_partitions`` of ``dataset``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id {partition_id} is outside [0, {num_partitions}); give each node a "
            "distinct partition-id from 0 to num-partitions - 1"
        )
    if num_partitions > len(dataset):
        raise ValueError(f"cannot split {len(dataset)} examples into {num_partitions} partitions")
    if scheme is Partitioning.IID:
        return dataset.select(
            iid_indices(
                len(dataset), partition_id=partition_id, num_partitions=num_partitions, seed=seed
            )
        )
    if scheme is Partitioning.HASH:
        place = hash_placement(dataset["text"], seed=seed, purpose="partition")
        shard = np.floor(place * num_partitions).astype(int)
        return dataset.select(np.flatnonzero(shard == partition_id).tolist())
    if scheme is Partitioning.TOPIC and "topic" not in dataset.column_names:
        raise ValueError(
            "fl.partitioning=topic needs a corpus (dataset.reader=corpus) whose documents name "
            "a topic in their metadata (dataset.topic_key); use fl.partitioning=iid or dirichlet"
        )
    partitioner = make_partitioner(
        num_partitions=num_partitions, scheme=scheme, alpha=alpha, seed=seed
    )
    partitioner.dataset = dataset
    return partitioner.load_partition(partition_id)


def iid_indices(n: int, *, partition_id: int, num_partitions: int, seed: int) -> list[int]:
    """The example indices of IID shard ``partition_id``: a slice of a seeded permutation."""
    shuffled = Dataset.from_dict({"index": list(range(n))}).shuffle(seed=seed)
    partitioner = make_partitioner(num_partitions=num_partitions, scheme=Partitioning.IID)
    partitioner.dataset = shuffled
    return sorted(int(i) for i in partitioner.load_partition(partition_id)["index"])
