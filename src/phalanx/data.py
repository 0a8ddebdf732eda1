"""Sample order, sharding and batching that do not depend on the number of devices.

Epoch `e` visits the training samples in the order `Order(seed, e, n)`; global step `k` takes
`order[k*B:(k+1)*B]` (the last batch may be short). Each global batch is cut into
`gradient_accumulation` micro-batches, and each micro-batch into contiguous shards in rank order.
A rank's DataLoader reads only its own shards. A cursor (epoch, step) says where to continue.

The order is a keyed bijection of [0, n) computed per position (a Feistel network on the smallest
even number of bits that holds n, walked again from any value >= n until it lands below n), so
an epoch of 10^10 samples costs no memory and its first batch is immediate. Runs whose
checkpoints predate it keep the order they started with (`ORDERS`: `randperm`, a list per epoch).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, default_collate

from phalanx.errors import DataError


FEISTEL, RANDPERM = "feistel", "randperm"
ORDERS = (FEISTEL, RANDPERM)   # the order a run uses; checkpoints without one name used randperm
_ROUNDS = 6
_MASK32, _MIX = (1 << 32) - 1, 0x45D9F3B   # x < 2^32 times _MIX < 2^27: no int64 overflow


class Order:
    """The order of one epoch's n samples: position -> sample index, a pseudo-random bijection of
    [0, n) that depends on the seed and the epoch alone, computed for each position when asked.
    Indexing with an int gives an index; with a slice, a list of them."""

    def __init__(self, seed: int, epoch: int, n: int):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2                  # each half of the Feistel network's word
        self._low = (1 << self._half) - 1
        digest = hashlib.sha256(f"phalanx-order:{seed}:{epoch}".encode()).digest()
        self._keys = [int.from_bytes(digest[4 * r:4 * r + 4], "little") for r in range(_ROUNDS)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.n)
            return self.at(torch.arange(start, stop, step, dtype=torch.int64)).tolist()
        if not -self.n <= key < self.n:
            raise IndexError(f"position {key} of an epoch of {self.n} samples")
        return int(self.at(torch.tensor([key % self.n], dtype=torch.int64))[0])

    def __iter__(self) -> Iterator[int]:
        chunk = 1 << 16
        for start in range(0, self.n, chunk):
            yield from self[start:start + chunk]

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The sample index at each position (an int64 tensor of positions in [0, n))."""
        values = self._rounds(positions)
        outside = values >= self.n
        while bool(outside.any()):  # cycle-walking: a value beyond n goes round again, until it lands inside
            values[outside] = self._rounds(values[outside])
            outside = values >= self.n
        return values

    def _rounds(self, values: torch.Tensor) -> torch.Tensor:
        left, right = values >> self._half, values & self._low
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._low)
        return (left << self._half) | right


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (multiply and xor-shift), in int64 arithmetic that cannot overflow."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def epoch_order(seed: int, epoch: int, n: int, kind: str = FEISTEL) -> Sequence[int]:
    """The order of epoch `epoch`: a function of the seed and the epoch alone. `kind` randperm is the
    order of runs that began before the Feistel order (a list of every index, drawn by torch.randperm)."""
    if kind == RANDPERM:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=generator).tolist()
    return Order(seed, epoch, n)


def permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The order of epoch `epoch`, every index of it, as a list."""
    return list(Order(seed, epoch, n))


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

    def micro_batches(self, start: int = 0) -> int:
        """Micro-batches in steps `start` on: counted, not made (an epoch may hold billions of samples)."""
        steps = len(self) - start
        if steps <= 0:
            return 0
        last = len(self.order) - (len(self) - 1) * self.batch_size
        return (steps - 1) * min(self.accumulation, self.batch_size) + min(self.accumulation, last)

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
        return self.plan.micro_batches(self.start)


def collate(items: list[Any], name: str = "") -> dict[str, Any] | None:
    """Stack a list of dict items into a dict batch; an empty shard is None. Items that cannot be
    stacked are a DataError naming the stream `name`, the key and how the items differ."""
    if not items:
        return None
    if type(items[0]) is not dict and not isinstance(items[0], Mapping):
        raise DataError(f"dataset items must be dicts of named values, e.g. {{'image': x, 'label': y}}; "
                        f"got {type(items[0]).__name__}. Return a dict from __getitem__")
    try:
        return default_collate(items)
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as e:
        raise DataError(_why_not_batched(items, name, e)) from e


def _why_not_batched(items: list[Any], name: str, error: Exception) -> str:
    """Which key of the items default_collate could not batch, and how its values differ (found
    only after a failure, so batching that works pays nothing for it)."""
    where = f"stream {name!r}" if name else "a batch"
    keys = set(items[0])
    for item in items[1:]:
        if not isinstance(item, Mapping) or set(item) != keys:
            other = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            return (f"{where}: items hold different keys ({sorted(keys)} and {other}); every item of a "
                    "stream must hold the same keys")
    for key in items[0]:
        values = [item[key] for item in items]
        try:
            default_collate(values)
        except Exception as e:  # noqa: BLE001 - any failure of this key is the one to report
            return f"{where}, key {key!r}: {_how_values_differ(values, key, e)}"
    return f"{where}: the items cannot be batched ({_first_line(error)})"


def _how_values_differ(values: list[Any], key: str, error: Exception) -> str:
    shapes = [tuple(v.shape) for v in values if hasattr(v, "shape")]  # tensors and numpy arrays
    if len(shapes) == len(values) and len(set(shapes)) > 1:
        distinct = list(dict.fromkeys(shapes))
        shown = " and ".join(str(list(shape)) for shape in distinct[:3]) + (" ..." if len(distinct) > 3 else "")
        return (f"items of different shapes {shown} cannot be stacked into one batch; give every item's "
                f"{key!r} one shape in the dataset (pad or crop it)")
    types = list(dict.fromkeys(type(v).__name__ for v in values))
    if len(types) > 1:
        return f"items hold values of different types ({', '.join(types)}); give every item's {key!r} one type"
    return (f"{_first_line(error)}; an item's values must be tensors of one shape, numbers or strings, "
            "or dicts and lists of them")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class _Unbatchable:
    """A collate error in a DataLoader worker, carried back as a value: the loader re-raises a
    worker's exception with the worker's traceback inside its message, no longer one line."""

    def __init__(self, message: str):
        self.message = message


class _Collate:
    """`collate` for one stream; in worker processes, errors travel back as `_Unbatchable`. An empty
    shard is None, or the zero-size batch `empty` where the strategy runs the model on it too."""

    def __init__(self, name: str, in_worker: bool, empty: Mapping | None = None):
        self.name, self.in_worker, self.empty = name, in_worker, empty

    def __call__(self, items: list[Any]) -> dict[str, Any] | _Unbatchable | None:
        if not items and self.empty is not None:
            return dict(self.empty)
        try:
            return collate(items, self.name)
        except DataError as e:
            if not self.in_worker:
                raise
            return _Unbatchable(str(e))


class _WorkersLoader(DataLoader):
    """A DataLoader with worker processes that raises their collate errors as themselves."""

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            if isinstance(batch, _Unbatchable):
                raise DataError(batch.message)
            yield batch


def loader(dataset: Any, plan: Plan, start: int = 0, num_workers: int = 0, pin_memory: bool = False,
           seed: int = 0, name: str = "", empty_batches: bool = False) -> DataLoader:
    """A DataLoader that yields this rank's shard of every micro-batch of `plan` from step `start`;
    `name` is the stream's, for errors. An empty shard is None, or with `empty_batches` a batch of
    zero samples shaped like the stream's items (for strategies whose every rank runs the model).

    Its own generator, seeded by `seed`, seeds the workers: making the loader draws nothing from the
    global RNG, so a resumed run's dropout and augmentation continue exactly where they stopped.
    """
    kind = _WorkersLoader if num_workers else DataLoader
    empty = empty_batch(dataset, name) if empty_batches and len(dataset) else None
    return kind(dataset, batch_sampler=_ShardSampler(plan, start), collate_fn=_Collate(name, num_workers > 0, empty),
                num_workers=num_workers, pin_memory=pin_memory, persistent_workers=False,
                generator=torch.Generator().manual_seed(seed))


def empty_batch(dataset: Any, name: str = "") -> dict[str, Any]:
    """A batch of zero samples shaped like the stream's items: each tensor value with a first
    dimension of 0, lists empty, other values as the first item has them."""
    batch = collate([dataset[0]], name)
    return {k: v[:0].clone() if isinstance(v, torch.Tensor) else v[:0] if isinstance(v, list) else v
            for k, v in batch.items()}


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
    if len(stream) == 0:  # training on it would take no step, and its metrics would be those of nothing
        raise DataError(f"stream {name!r} of {type(dataset).__name__} is empty; a stream needs at least one "
                        f"sample: check what streams() returns for {name!r} (its path, split or filter)")
    return stream


class TokenWindows:
    """A flat file of token ids (the `train.bin` layout: one array of `dtype`, no header), memory-mapped
    and read as a map-style stream of non-overlapping windows. Item i is tokens [i*block_size,
    i*block_size + block_size + 1): `{"tokens": its first block_size, "targets": its last block_size}`
    (int64), the next-token pairs a language model trains on. Reading a window reads only its pages,
    so the file may be far larger than memory."""

    def __init__(self, path: str | Path, block_size: int, dtype: str = "uint16",
                 keys: tuple[str, str] = ("tokens", "targets")):
        import numpy as np

        self.path, self.block_size, self.keys = Path(path), block_size, tuple(keys)
        if block_size < 1:
            raise DataError(f"TokenWindows: block_size must be at least 1, got {block_size}")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise DataError(f"TokenWindows: dtype {dtype!r} is not a numpy dtype; use uint16 (vocabularies up to "
                            "65536) or uint32") from None
        if not self.path.is_file():
            raise DataError(f"TokenWindows: {self.path} is not a file; write the token ids there first (e.g. "
                            f"numpy.array(ids, dtype={self.dtype.name}).tofile(path))")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(f"TokenWindows: {self.path} holds {size} bytes, not a whole number of {self.dtype.name} "
                            f"tokens ({self.dtype.itemsize} bytes each); is dtype right?")
        self.tokens = size // self.dtype.itemsize
        self._map = None  # opened in the process that reads it (DataLoader workers each map their own)

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.block_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import numpy as np

        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)} in {self.path}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = i * self.block_size
        window = torch.from_numpy(self._map[start:start + self.block_size + 1].astype(np.int64))
        return {self.keys[0]: window[:-1], self.keys[1]: window[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}  # a worker process maps the file again
