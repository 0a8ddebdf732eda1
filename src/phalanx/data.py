"""Sample order, sharding and batching that do not depend on the number of devices.

Epoch `e` visits the training samples in `permutation(seed, e)`; global step `k` takes
`perm[k*B:(k+1)*B]` (the last batch may be short). Each global batch is cut into
`gradient_accumulation` micro-batches, and each micro-batch into contiguous shards in rank order.
A rank's DataLoader reads only its own shards. A cursor (epoch, step) says where to continue.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, default_collate

from phalanx.errors import DataError


def permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The order of epoch `epoch`: a function of the seed and the epoch alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


def split_sizes(n: int, parts: int, weights: Sequence[float] | None = None) -> list[int]:
    """Sizes of `parts` contiguous pieces of `n`: equal to within one, or in proportion to weights."""
    if weights is None:
        base, extra = divmod(n, parts)
        return [base + (i < extra) for i in range(parts)]
    total = sum(weights)
    bounds = [round(n * sum(weights[:i]) / total) for i in range(parts + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def split(indices: Sequence[int], parts: int, weights: Sequence[float] | None = None) -> list[list[int]]:
    """`indices` cut into contiguous pieces, in order."""
    pieces, start = [], 0
    for size in split_sizes(len(indices), parts, weights):
        pieces.append(list(indices[start:start + size]))
        start += size
    return pieces


class Micro(NamedTuple):
    """One micro-batch as this rank sees it: its shard, the size of the whole global batch, and
    whether some rank's shard of some micro-batch of this step is empty (every rank knows, from the
    plan)."""

    shard: list[int]
    global_size: int
    any_empty: bool = False


class Plan:
    """Which samples each step of an epoch takes, and this rank's part of them."""

    def __init__(self, order: Sequence[int], batch_size: int, accumulation: int = 1,
                 rank: int = 0, world_size: int = 1, weights: Sequence[float] | None = None):
        self.order, self.batch_size, self.accumulation = order, batch_size, accumulation
        self.rank, self.world_size, self.weights = rank, world_size, weights
        self._steps: dict[int, list[Micro]] = {}  # the loader's sampler and the loop ask for each step

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def step(self, k: int) -> list[Micro]:
        """The micro-batches of global step `k`, this rank's shard of each."""
        micros = self._steps.pop(k, None)
        if micros is None:
            micros = self._steps[k] = self._make(k)
        return micros

    def _make(self, k: int) -> list[Micro]:
        batch = self.order[k * self.batch_size:(k + 1) * self.batch_size]
        n = len(batch)
        if self.world_size == 1 and self.accumulation == 1:
            return [Micro(list(batch), n)]
        shards, any_empty = [], False
        for micro in [batch] if self.accumulation == 1 else split(batch, min(self.accumulation, n)):
            sizes = split_sizes(len(micro), self.world_size, self.weights)
            start = sum(sizes[:self.rank])
            shards.append(list(micro[start:start + sizes[self.rank]]))
            any_empty = any_empty or 0 in sizes
        return [Micro(shard, n, any_empty) for shard in shards]

    def steps(self, start: int = 0) -> Iterator[tuple[int, list[Micro]]]:
        for k in range(start, len(self)):
            yield k, self.step(k)


class _ShardSampler:
    """Feeds a DataLoader the shards of a plan's steps, from a starting step on."""

    def __init__(self, plan: Plan, start: int):
        self.plan, self.start = plan, start

    def __iter__(self) -> Iterator[list[int]]:
        for _, micros in self.plan.steps(self.start):
            for micro in micros:
                yield micro.shard

    def __len__(self) -> int:
        return sum(len(micros) for _, micros in self.plan.steps(self.start))


def collate(items: list[Any]) -> dict[str, Any] | None:
    """Stack a list of dict items into a dict batch; an empty shard is None."""
    if not items:
        return None
    if type(items[0]) is not dict and not isinstance(items[0], Mapping):
        raise DataError(f"dataset items must be dicts of named values, e.g. {{'image': x, 'label': y}}; "
                        f"got {type(items[0]).__name__}. Return a dict from __getitem__")
    return default_collate(items)


def loader(dataset: Any, plan: Plan, start: int = 0, num_workers: int = 0, pin_memory: bool = False,
           seed: int = 0) -> DataLoader:
    """A DataLoader that yields this rank's shard of every micro-batch of `plan` from step `start`.

    Its own generator, seeded by `seed`, seeds the workers: making the loader draws nothing from the
    global RNG, so a resumed run's dropout and augmentation continue exactly where they stopped.
    """
    return DataLoader(dataset, batch_sampler=_ShardSampler(plan, start), collate_fn=collate,
                      num_workers=num_workers, pin_memory=pin_memory, persistent_workers=False,
                      generator=torch.Generator().manual_seed(seed))


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise DataError(f"a batch holds no tensor with a batch dimension (keys: {', '.join(batch)}); "
                    "items must hold tensors or numbers")


def get_stream(dataset: Any, name: str) -> Any:
    """Stream `name` of a dataset object: `dataset.streams()[name]`."""
    streams = getattr(dataset, "streams", None)
    if not callable(streams):
        raise DataError(f"{type(dataset).__name__} has no streams() method; a dataset class returns its "
                        "streams as {'train': ..., 'valid': ...} from streams()")
    available = streams()
    if name not in available:
        raise DataError(f"dataset {type(dataset).__name__} has no stream {name!r}; it has "
                        f"{', '.join(available) or 'none'}. Fix main_loop.extra_streams or the dataset")
    stream = available[name]
    if not hasattr(stream, "__getitem__") or not hasattr(stream, "__len__"):
        raise DataError(f"stream {name!r} is a {type(stream).__name__}; it must be a map-style dataset "
                        "(with __getitem__ and __len__)")
    return stream
