"""Sample order, sharding and batching that do not depend on the number of devices.

Epoch `e` visits the training samples in the order `Order(seed, e, n)`; global step `k` takes
`order[k*B:(k+1)*B]` (the last batch may be short). Each global batch is cut into
`gradient_accumulation` micro-batches, and each micro-batch into contiguous shards in rank order. A
rank's DataLoader (see `phalanx.loading`) reads only its own shards. A cursor (epoch, step) says
where to continue.

The order is a keyed bijection of [0, n) computed per position (a Feistel network on the smallest
even number of bits that holds n, walked again from any value >= n until it lands below n), so
an epoch of 10^10 samples costs no memory and its first batch is immediate. Runs whose
checkpoints predate it keep the order they started with (`ORDERS`: `randperm`, a list per epoch).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import numpy as np
import torch
from torch.utils.data import IterableDataset

from phalanx.errors import DataError, beyond_input, named

FEISTEL, RANDPERM = "feistel", "randperm"
# the order a run uses; checkpoints without one name used randperm
ORDERS = (FEISTEL, RANDPERM)
_ROUNDS = 6
_MIX, _16 = np.uint32(0x45D9F3B), np.uint32(16)
_BLOCK = 1 << 16  # positions computed together
# domains up to this size are computed whole, once (2 MiB at most)
_TABLE = 1 << 18


class Order(Sequence[int]):
    """The order of one epoch's n samples: position -> sample index, a pseudo-random bijection of
    [0, n) that depends on the seed and the epoch alone, computed for each position when asked.
    Indexing with an int gives an index; with a slice, a list of them."""

    def __init__(self, seed: int, epoch: int, n: int):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2  # each half of the Feistel network's word
        self._low = (1 << self._half) - 1
        digest = hashlib.sha256(f"phalanx-order:{seed}:{epoch}".encode()).digest()
        self._keys = [int.from_bytes(digest[4 * r : 4 * r + 4], "little") for r in range(_ROUNDS)]
        self._cached: tuple[int, list[int]] = (-1, [])
        self._domain = 1 << (2 * self._half)  # the values the network permutes
        self._values: np.ndarray | None = None  # its value at each of them (see _table)

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> list[int]: ...

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.n)
            if step != 1:
                return self.at(np.arange(start, stop, step, dtype=np.int64)).tolist()
            out: list[int] = []
            # from the blocks of positions the slice spans
            while start < stop:
                block = start // _BLOCK
                values = self._block(block)
                offset = block * _BLOCK
                out += values[start - offset : stop - offset]
                start = offset + len(values)
            return out
        if not -self.n <= key < self.n:
            raise IndexError(f"position {key} of an epoch of {self.n} samples")
        key %= self.n
        return self._block(key // _BLOCK)[key % _BLOCK]

    def __iter__(self) -> Iterator[int]:
        for block in range(-(-self.n // _BLOCK)):
            yield from self._block(block)

    def _block(self, block: int) -> list[int]:
        """The indices at positions [block * _BLOCK, (block + 1) * _BLOCK), computed together (a
        step's few positions alone would cost the tensor operations' overhead each time) and kept
        until another block is asked for: the memory of one block, whatever n."""
        if self._cached[0] != block:
            start = block * _BLOCK
            stop = min(self.n, start + _BLOCK)
            values = (
                self._walk(self._table(), slice(start, stop))
                if self._domain <= _TABLE
                else self.at(np.arange(start, stop, dtype=np.int64))
            )
            self._cached = (block, values.tolist())
        return self._cached[1]

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample index at each position (an int64 array of positions in [0, n)). In numpy: on a
        step's few thousand values its operations cost a fraction of torch's."""
        if self._domain <= _TABLE:
            return self._walk(self._table(), positions)
        values = self._rounds(positions.astype(np.uint64))
        outside = np.flatnonzero(values >= self.n)
        # cycle-walking: a value beyond n goes round again, until it lands inside
        while len(outside):
            values[outside] = self._rounds(values[outside])
            outside = outside[values[outside] >= self.n]
        return values.astype(np.int64)

    def _table(self) -> np.ndarray:
        """The network's value for every point of its domain, computed once. A small epoch's
        cycle-walk would otherwise run the rounds again for each of its steps (a domain up to four
        times n leaves a long tail of values to walk), each a few dozen array operations on a
        handful of values."""
        if self._values is None:
            values = self._rounds(np.arange(self._domain, dtype=np.uint64))
            self._values = values.astype(np.int64)  # the gathers index with it
        return self._values

    def _walk(self, table: np.ndarray, positions: np.ndarray | slice) -> np.ndarray:
        """`at` by looking the rounds up (int64 `table`): the same values, a gather per step of the
        walk; `positions` an array of them, or a slice of consecutive ones (a block's)."""
        values = table[positions].copy() if isinstance(positions, slice) else table[positions]
        outside = np.flatnonzero(values >= self.n)
        while len(outside):
            values[outside] = table[values[outside]]
            outside = outside[values[outside] >= self.n]
        return values

    def _rounds(self, values: np.ndarray) -> np.ndarray:
        """The network's value at each of `values` (uint64). Each half fits in 32 bits, where the
        rounds run: uint32 arithmetic wraps as the hash needs, in half the memory."""
        half = np.uint64(self._half)
        left = (values >> half).astype(np.uint32)
        right = (values & np.uint64(self._low)).astype(np.uint32)
        low = np.uint32(self._low)
        for key in self._keys:
            mixed = _mix(right ^ np.uint32(key))
            mixed &= low
            mixed ^= left
            left, right = right, mixed
        return (left.astype(np.uint64) << half) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (multiply and xor-shift) of uint32 values, in place."""
    x ^= x >> _16
    x *= _MIX
    x ^= x >> _16
    x *= _MIX
    x ^= x >> _16
    return x


def epoch_order(seed: int, epoch: int, n: int, kind: str = FEISTEL) -> Sequence[int]:
    """The order of epoch `epoch`: a function of the seed and the epoch alone. `kind` randperm is
    the order of runs that began before the Feistel order (a list of every index, drawn by
    torch.randperm)."""
    if kind == RANDPERM:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=generator).tolist()
    return Order(seed, epoch, n)


def permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The order of epoch `epoch`, every index of it, as a list."""
    return list(Order(seed, epoch, n))


def split_sizes(n: int, parts: int, weights: Sequence[float] | None = None) -> list[int]:
    """Sizes of `parts` contiguous pieces of `n`: equal within one, or in proportion to weights."""
    if weights is None:
        base, extra = divmod(n, parts)
        return [base + (i < extra) for i in range(parts)]
    total = sum(weights)
    bounds = [round(n * sum(weights[:i]) / total) for i in range(parts + 1)]
    return [b - a for a, b in itertools.pairwise(bounds)]


def split(
    indices: Sequence[int], parts: int, weights: Sequence[float] | None = None
) -> list[list[int]]:
    """`indices` cut into contiguous pieces, in order."""
    pieces, start = [], 0
    for size in split_sizes(len(indices), parts, weights):
        pieces.append(list(indices[start : start + size]))
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

    def __init__(
        self,
        order: Sequence[int],
        batch_size: int,
        accumulation: int = 1,
        rank: int = 0,
        world_size: int = 1,
        weights: Sequence[float] | None = None,
    ):
        self.order, self.batch_size, self.accumulation = order, batch_size, accumulation
        self.rank, self.world_size, self.weights = rank, world_size, weights
        # the loader's sampler and the loop ask for each step
        self._steps: dict[int, list[Micro]] = {}

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def step(self, k: int) -> list[Micro]:
        """The micro-batches of global step `k`, this rank's shard of each."""
        micros = self._steps.pop(k, None)
        if micros is None:
            micros = self._steps[k] = self._make(k)
        return micros

    def _make(self, k: int) -> list[Micro]:
        batch = self.order[k * self.batch_size : (k + 1) * self.batch_size]
        n = len(batch)
        if self.world_size == 1 and self.accumulation == 1:
            return [Micro(list(batch), n)]
        shards, any_empty = [], False
        for micro in [batch] if self.accumulation == 1 else split(batch, min(self.accumulation, n)):
            sizes = split_sizes(len(micro), self.world_size, self.weights)
            start = sum(sizes[: self.rank])
            shards.append(list(micro[start : start + sizes[self.rank]]))
            any_empty = any_empty or 0 in sizes
        return [Micro(shard, n, any_empty) for shard in shards]

    def micro_batches(self, start: int = 0) -> int:
        """Micro-batches in steps `start` on: counted, not made (an epoch may hold billions of
        samples)."""
        steps = len(self) - start
        if steps <= 0:
            return 0
        last = len(self.order) - (len(self) - 1) * self.batch_size
        return (steps - 1) * min(self.accumulation, self.batch_size) + min(self.accumulation, last)

    def steps(self, start: int = 0) -> Iterator[tuple[int, list[Micro]]]:
        for k in range(start, len(self)):
            yield k, self.step(k)


TRAIN = "train"  # the training stream's name


def get_stream(
    dataset: Any, name: str, fix: str = "Fix main_loop.extra_streams or the dataset"
) -> Any:
    """Stream `name` of a dataset object: `dataset.streams()[name]`; where it has none, an error
    that lists the streams it has and ends with `fix`."""
    streams = getattr(dataset, "streams", None)
    if not callable(streams):
        raise DataError(
            f"{type(dataset).__name__} has no streams() method; a dataset class returns its "
            "streams as {'train': ..., 'valid': ...} from streams()"
        )
    try:
        available = streams()
    # what reading data raises (a missing file, a bad split): said as the constructor's are
    except (OSError, ValueError, RuntimeError, LookupError) as e:
        if beyond_input(e):
            raise
        raise DataError(
            f"dataset: {type(dataset).__name__}.streams() failed: {named(e)}; fix the values in "
            "the dataset section (the files, paths or splits it reads)"
        ) from e
    if not isinstance(available, Mapping):
        raise DataError(
            f"{type(dataset).__name__}.streams() returned a {type(available).__name__}; return "
            "the streams by name, as {'train': ..., 'valid': ...}"
        )
    if name not in available:
        raise DataError(
            f"dataset {type(dataset).__name__} has no stream {name!r}; it has "
            f"{', '.join(available) or 'none'}. {fix}"
        )
    stream = available[name]
    if is_iterable(stream):
        if not hasattr(stream, "__iter__"):
            raise DataError(
                f"stream {name!r} is a {type(stream).__name__}; it must be a map-style dataset "
                "(with __getitem__ and __len__) or an iterable one (an IterableDataset, with "
                "__iter__)"
            )
        if hasattr(stream, "__next__"):
            raise DataError(
                f"stream {name!r} is an iterator ({type(stream).__name__}), which can be read only "
                "once; give an iterable that starts again at each iter(), such as an "
                "IterableDataset, or a map-style dataset"
            )
        return stream
    if not hasattr(stream, "__len__"):
        raise DataError(
            f"stream {name!r} is a {type(stream).__name__}, which has __getitem__ but no __len__; "
            "give it __len__ (a map-style dataset), or make it an IterableDataset"
        )
    try:
        size = len(stream)
    # a length that is not a count (negative, not an int), or one that raised
    except (TypeError, ValueError, OverflowError, RuntimeError, OSError, LookupError) as e:
        raise DataError(
            f"stream {name!r} of {type(dataset).__name__}: len() failed: {named(e)}; its __len__ "
            "must return the number of samples it holds, an int of 0 or more"
        ) from e
    # training on it would take no step, and its metrics would be those of nothing
    if size == 0:
        raise DataError(
            f"stream {name!r} of {type(dataset).__name__} is empty; a stream needs at least one "
            f"sample: check what streams() returns for {name!r} (its path, split or filter)"
        )
    return stream


def is_iterable(stream: Any) -> bool:
    """Whether a stream is read by iterating it (an IterableDataset, a generator-backed stream)
    rather than by index."""
    return isinstance(stream, IterableDataset) or not hasattr(stream, "__getitem__")


def stream_length(stream: Any) -> int | None:
    """Samples in a stream, where it says (an iterable stream may not know)."""
    try:
        return len(stream)
    except TypeError:
        return None


class TokenWindows:
    """A flat file of token ids (the `train.bin` layout: one array of `dtype`, no header),
    memory-mapped and read as a map-style stream of non-overlapping windows. Item i is tokens
    [i*block_size, i*block_size + block_size + 1): `{"tokens": its first block_size, "targets": its
    last block_size}` (int64), the next-token pairs a language model trains on. Reading a window
    reads only its pages, so the file may be far larger than memory."""

    def __init__(
        self,
        path: str | Path,
        block_size: int,
        dtype: str = "uint16",
        keys: tuple[str, str] = ("tokens", "targets"),
    ):
        self.path, self.block_size, self.keys = Path(path), block_size, tuple(keys)
        if block_size < 1:
            raise DataError(f"TokenWindows: block_size must be at least 1, got {block_size}")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise DataError(
                f"TokenWindows: dtype {dtype!r} is not a numpy dtype; use uint16 (vocabularies up "
                "to 65536) or uint32"
            ) from None
        if not self.path.is_file():
            raise DataError(
                f"TokenWindows: {self.path} is not a file; write the token ids there first (e.g. "
                f"numpy.array(ids, dtype={self.dtype.name}).tofile(path))"
            )
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(
                f"TokenWindows: {self.path} holds {size} bytes, not a whole number of "
                f"{self.dtype.name} tokens ({self.dtype.itemsize} bytes each); is dtype right?"
            )
        self.tokens = size // self.dtype.itemsize
        # opened in the process that reads it (DataLoader workers each map their own)
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.block_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)} in {self.path}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = i * self.block_size
        window = torch.from_numpy(self._map[start : start + self.block_size + 1].astype(np.int64))
        return {self.keys[0]: window[:-1], self.keys[1]: window[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}  # a worker process maps the file again
