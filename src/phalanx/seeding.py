"""Per-sample random streams for the data: before a stream's item is read, torch's global CPU
generator, Python's `random` and NumPy's legacy global generator are seeded from a key and the
item's index, and after the read (of one item or a batch of them) they are restored, so the
augmentation a dataset draws in `__getitem__` is a function of (seed, epoch, index) alone: the
same in any process, DataLoader worker or batch, and the reader's own draws are not disturbed.

A key is a 64-bit integer of the seed and what the read is for: the epoch, for training
(`training_key`); the stream's name, for evaluation (`stream_key`: each evaluation of a stream
draws the same numbers, so its metrics change only with the model). An item's seed mixes the key
with the index (`item_seed`) by splitmix64's finaliser, in Python integers: a few multiplications,
cheap enough for every item. Saving and restoring the three generators costs more (NumPy's state
is 2.5 KB, copied each way), so it is done once per batch read, not per item.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = (1 << 64) - 1
_TRAINING, _EVALUATION = 0, 1  # what a key is for: no training key equals an evaluation's
T = TypeVar("T")


def _mix(z: int) -> int:
    """splitmix64: a bijection of 64-bit integers whose every output bit depends on every input
    bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def key(seed: int, *parts: int) -> int:
    """A 64-bit key of the seed and `parts`, each folded in by one mix."""
    k = _mix(seed & _MASK)
    for part in parts:
        k = _mix(k ^ (part & _MASK))
    return k


def training_key(seed: int, epoch: int) -> int:
    """The key of epoch `epoch`'s training reads."""
    return key(seed, _TRAINING, epoch)


def stream_key(seed: int, stream: str) -> int:
    """The key of every read of stream `stream` outside training: each evaluation of it, and the
    samples a hook looks at (by the name's CRC-32: Python's own string hash differs between
    processes)."""
    return key(seed, _EVALUATION, zlib.crc32(stream.encode()))


def item_seed(k: int, index: int) -> int:
    """The seed of item `index` read under key `k`: distinct indices get distinct seeds (the mix is
    a bijection)."""
    return _mix(k ^ (index & _MASK))


def seed(s: int) -> None:
    """Seed torch's global CPU generator, `random` and NumPy's legacy global generator with `s`.
    Not `torch.manual_seed`, which also seeds (and so initialises) CUDA: a DataLoader worker must
    not touch it."""
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)


@contextmanager
def kept() -> Iterator[None]:
    """Restore the three global generators on leaving, to the states they had on entering."""
    state = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


def read(keyed: Iterable[tuple[int, int]], read_one: Callable[[int], T]) -> list[T]:
    """`read_one(index)` for each (key, index), each with the generators seeded from its key and
    index; the generators as they were afterwards."""
    out = []
    with kept():
        for k, index in keyed:
            seed(item_seed(k, index))
            out.append(read_one(index))
    return out


def read_items(k: int, indices: Iterable[int], read_one: Callable[[int], Any]) -> list[Any]:
    """`read` of `indices`, all under key `k`."""
    return read(((k, i) for i in indices), read_one)


class Keyed(Dataset):
    """A stream read by (key, index): each item with the global generators seeded from both, and
    restored after the batch (`read`). A batched read (`__getitems__`) draws for all of its
    items at once, so it is called for one item at a time: each item's draws are then its own,
    whatever batch it is in."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._batched = callable(getattr(dataset, "__getitems__", None))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, keyed: tuple[int, int]) -> Any:
        return self.__getitems__([keyed])[0]

    def __getitems__(self, keyed: list[tuple[int, int]]) -> list[Any]:
        return read(keyed, self._one)

    def _one(self, index: int) -> Any:
        return self.dataset.__getitems__([index])[0] if self._batched else self.dataset[index]
