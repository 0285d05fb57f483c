"""tt3 shim of datasets.distributed.split_dataset_by_node (map-style only)."""

from . import Dataset  # noqa: F401  (as the real package exposes it)


def split_dataset_by_node(dataset, rank, world_size):
    # Same contiguous-shard rule as datasets' Dataset.shard(contiguous=True).
    n = len(dataset)
    div, mod = divmod(n, world_size)
    start = div * rank + min(rank, mod)
    end = start + div + (1 if rank < mod else 0)
    return dataset.select(range(start, end))
