"""Per-sample random streams for the data: before a stream's item is read, torch's global CPU
generator, Python's `random` and NumPy's legacy global generator are seeded from a key and the
item's index, and after the read (of one item or a batch of them) they are restored, so the
augmentation a dataset draws in `__getitem__` is a function of (seed, epoch, index) alone: the
same in any process, DataLoader worker or batch, and the reader's own draws are not disturbed.

A key is a 64-bit integer of the seed and what the read is for: the epoch, for training
(`training_key`); the stream's name, for evaluation (`stream_key`: each evaluation of a stream
draws the same numbers, so its metrics change only with the model). An item's seed mixes the key
with the index (`item_seed`) by splitmix64's finaliser, in Python integers: a few multiplications,
cheap enough for every item.

Seeding is what costs: each of the three is a Mersenne Twister, whose seeding computes its 2.5 KB
state (1 to 3.5 us each, 7 us an item for the three). So the states are saved and restored once
per batch read, not per item, and a map-style stream's reader (`Keyed`) seeds before each item
only the generators that the stream has been seen to draw from: the others are looked at before
and after each batch, and a batch during which one of them moved is read again with that one
seeded too (its draws came from the reader's state, not the item's). A batch in which a process
first sees a stream draw is read twice. A read that restores the state it drew from is not seen to
draw.

Looking costs a few words, not a state (`_Marked`): each generator is looked at through a mark
read in place (its twister's position, first and last words, and the Gaussian or normal it keeps
for its next draw), and its whole state is read only where the mark moved since the last time it
was. Reading and comparing the whole states (2.5 to 5 KB each) around every batch cost a small
model's training step about 4% in the measurements (BENCHMARKS.md): more than their own
microseconds, in what they evict from the caches. A draw moves the position; draws that bring it
back (a multiple of 624) have made all 624 words anew, so that a mark alike after a draw is as
likely as two random 64-bit numbers alike. A stream seen to draw from none (most: a tensor
dataset, a tokenised corpus) costs a batch the marks read before and after it, and nothing else.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = (1 << 64) - 1
# what a key is for: no training key equals an evaluation's
_TRAINING, _EVALUATION = 0, 1
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


class _Generator(NamedTuple):
    """One of the global generators that a dataset's `__getitem__` draws from."""

    get: Callable[[], Any]
    set: Callable[[Any], Any]
    seed: Callable[[int], Any]
    # whether the generator is where `get` found it then (it was not drawn from since)
    unchanged: Callable[[Any], bool]


def _same_numpy_state(a: Any, b: Any) -> bool:
    """Whether two of `_numpy_state`'s states are equal: the legacy tuple ('MT19937', key array,
    position, has_gauss, cached gaussian), or another bit generator's dict (its arrays compared as
    arrays)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a[2:] == b[2:] and np.array_equal(a[1], b[1])
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numpy_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def _words(address: int, count: int) -> memoryview:
    """`count` 32-bit words at `address`, read in place through a view made once: each item read is
    the word as it is then. The memory must outlive the view: a generator's, which its reader
    keeps."""
    return memoryview((ctypes.c_char * (4 * count)).from_address(address)).cast("B").cast("I")


class _Marked:
    """A global generator read cheaply. Its whole state (`_read`) is kept with the mark it was read
    at (`_mark`: a few of its words, read in place; None where none can be read now), and handed
    out again while the mark stays; whether the generator moved since a state was handed out is
    then told by the mark alone. A state phalanx sets (`set`: restores, resumes) other than the
    kept one forgets it."""

    def __init__(self) -> None:
        self._known: tuple[Any, Any] | None = None  # (mark, state)

    def _mark(self) -> Any:
        return None

    def _read(self) -> Any:
        raise NotImplementedError

    def _write(self, state: Any) -> None:
        raise NotImplementedError

    def _same(self, saved: Any) -> bool:
        """Whether the generator's state is `saved`, compared whole."""
        raise NotImplementedError

    def _keeps(self, state: Any) -> bool:
        """Whether `state`, read at a mark, is the generator's state whenever that mark is read."""
        return True

    def get(self) -> Any:
        mark = self._mark()
        if mark is None:
            return self._read()
        known = self._known
        if known is not None and known[0] == mark:
            return known[1]
        state = self._read()
        # kept where nothing drew in between (another thread)
        keep = self._mark() == mark and self._keeps(state)
        self._known = (mark, state) if keep else None
        return state

    def set(self, state: Any) -> None:
        self._write(state)
        known = self._known
        if known is None or state is not known[1]:
            self._known = None

    def unchanged(self, saved: Any) -> bool:
        known = self._known
        if known is not None and saved is known[1]:
            mark = self._mark()
            if mark is not None:
                return mark == known[0]
        return self._same(saved)

    def kept(self) -> tuple[Any, Any] | None:
        """(the mark the generator is at, its state there), the state read where the generator
        moved since it was kept; None where the state cannot be kept (`_keeps`)."""
        mark = self._mark()  # first: it forgets what was kept of a generator replaced
        known = self._known
        if known is not None and known[0] == mark:
            return known
        if mark is None:
            return None
        self.get()  # read, and kept where it can be
        return self._known


class _NumpyState(_Marked):
    """NumPy's legacy global generator, read cheaply. `np.random.get_state` takes about 30 us; its
    Mersenne Twister (624 words and a position) lies behind the bit generator's public ctypes
    interface, whose first and last words and position are the mark. A draw moves the twister,
    except one legacy Gaussian served from the cache the previous one left (`has_gauss`), which
    the twister's words do not show. So only a state without a cached Gaussian is kept: while the
    twister is where it was, the state is that one (the cache, empty then, fills only by drawing
    from the twister). With a Gaussian cached, or a global generator that is not a Mersenne Twister
    (`set_bit_generator`), the whole states are read and compared. Not seen: the user's own
    `np.random.set_state` to a state of the same twister with a Gaussian cached."""

    def __init__(self) -> None:
        super().__init__()
        # the global generator's bit generator, and its twister's words (None: not a twister)
        self._generator: Any = None
        self._twister: memoryview | None = None

    def _mark(self) -> Any:
        generator = getattr(np.random.mtrand._rand, "_bit_generator", None)
        if generator is not self._generator:
            self._generator, self._twister, self._known = generator, None, None
            if isinstance(generator, np.random.MT19937):
                self._twister = _words(generator.ctypes.state_address, 625)
        words = self._twister
        return None if words is None else (words[0], words[623], words[624])

    def _read(self) -> Any:
        return _numpy_state()

    def _write(self, state: Any) -> None:
        np.random.set_state(state)

    def _same(self, saved: Any) -> bool:
        return _same_numpy_state(saved, _numpy_state())

    def _keeps(self, state: Any) -> bool:
        if state[3]:  # a Gaussian cached
            return False
        state[1].flags.writeable = False  # every caller is handed this one tuple
        return True


def set_numpy_state(state: Any) -> None:
    """`np.random.set_state` for phalanx's own code: the cheap reader forgets what it kept."""
    _NUMPY.set(state)


def _numpy_state() -> Any:
    """NumPy's global state: the legacy tuple for its Mersenne Twister, a dict for another bit
    generator (`np.random.set_bit_generator`), whose state the legacy form cannot hold."""
    if isinstance(getattr(np.random.mtrand._rand, "_bit_generator", None), np.random.MT19937):
        return np.random.get_state()
    return np.random.get_state(legacy=False)


class _PythonRandom(_Marked):
    """Python's `random`, read cheaply. `random.getstate` builds a tuple of 625 integers (about
    10 us, and as long again to compare two); the C object the module's functions draw from holds
    its twister right after the object header, as its position and 624 words (2.5 KB), which a copy
    reads in a fraction of a microsecond. That layout is CPython's own: it is checked against
    `getstate` once, and where it does not match (another interpreter, a free-threaded build) the
    states are `getstate`'s. A state read here is the twister's bytes and the Gaussian that
    `random.gauss` keeps for its next call; its mark, the position, the first and last words and
    that Gaussian."""

    def __init__(self) -> None:
        super().__init__()
        # the generator the module's functions draw from, and its twister's address (None: read
        # by getstate)
        self._generator: Any = None
        self._address: int | None = None
        self._words: memoryview | None = None  # its position and words, where the address is known
        try:
            generator = random.random.__self__  # type: ignore[attr-defined]
            # where id() is an address and no other thread draws while the bytes are copied
            cpython = sys.implementation.name == "cpython"
            if cpython and getattr(sys, "_is_gil_enabled", lambda: True)():
                address = id(generator) + object.__basicsize__
                _, words, _ = generator.getstate()
                if ctypes.string_at(address, _TWISTER) == _packed(words):
                    self._generator, self._address = generator, address
                    self._words = _words(address, _TWISTER // 4)
        except (AttributeError, TypeError, ValueError, struct.error):
            pass

    def _mark(self) -> Any:
        words = self._words
        if words is None or self._address is None:
            return None
        return words[0], words[1], words[624], self._generator.gauss_next

    def _read(self) -> Any:
        words = self._words
        if words is None or self._address is None:
            return random.getstate()
        return words.tobytes(), self._generator.gauss_next

    def _write(self, saved: Any) -> None:
        if self._address is None:
            random.setstate(saved)
            return
        twister, gauss = saved
        position, *words = struct.unpack(_TWISTER_LAYOUT, twister)
        random.setstate((random.Random.VERSION, (*words, position), gauss))

    def _same(self, saved: Any) -> bool:
        return self._read() == saved


# CPython's twister, as its C object holds it: the position, then the words
_TWISTER_LAYOUT = "=i624I"
_TWISTER = struct.calcsize(_TWISTER_LAYOUT)


def _packed(words: tuple[int, ...]) -> bytes:
    """`getstate`'s 624 words and position as the C object holds them."""
    return struct.pack(_TWISTER_LAYOUT, words[-1], *words[:-1])


def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp (None where it cannot be found, as on Windows)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _memcmp()


def _same_torch_state(saved: torch.Tensor) -> bool:
    # the two states' memory compared where they lie: half the cost of copying both into bytes,
    # a third of torch.equal's dispatch
    now = _TORCH.get_state()
    size = now.numel()
    if _MEMCMP is not None and saved.numel() == size:
        return _MEMCMP(now.data_ptr(), saved.data_ptr(), size) == 0
    return now.numpy().tobytes() == saved.numpy().tobytes()


# torch's CPU generator as `get_state` serialises it: seed, position (left, seeded, next), the 624
# words (each in 8 bytes), the cached double normal (x, y, rho, valid), then the cached float one
_TORCH_STATE = struct.Struct("=QiiQ624Qdddi4xf?3x")
# ... and as its C++ object holds them, from the seed on: the position's fields in 12 bytes, the
# words in 4 each (the twister padded to 8 bytes), then the two cached normals (`std::optional`s
# of a float and of a double)
_TORCH_OBJECT = struct.Struct("=QiB3xI624I4xf?3xd?7x")


# its mark, read from those words: the seed, the position and the first two words (words 0-5),
# then the last word and the two cached normals (628 and 630-634; 629 is padding)
_TORCH_HEAD = struct.Struct("=6I")
_TORCH_TAIL = struct.Struct("=I4x5I")
_TORCH_TAIL_AT = 628 * 4


def _torch_words(generator: torch.Generator) -> memoryview | None:
    """The words of `generator`'s C++ object from its seed on, in place, as `_TORCH_OBJECT` lays
    them out; None where its layout is not that one: found on a generator of its own with a
    normal cached, and checked on `generator` at the same offset."""
    try:
        probe = torch.Generator()
        probe.manual_seed(0x5EED)
        torch.randn(1, generator=probe, dtype=torch.float64)  # a double normal cached
        offset = next((o for o in range(0, 256, 8) if _torch_layout(probe, o)), None)
        if offset is None or not _torch_layout(generator, offset):
            return None
        return _words(_address(generator) + offset, _TORCH_OBJECT.size // 4)
    except (AttributeError, TypeError, ValueError, RuntimeError, struct.error):
        return None


def _address(generator: torch.Generator) -> int:
    """The address of `generator`'s C++ object (torch's Python binding gives it, untyped)."""
    return int(generator._cdata)  # type: ignore[attr-defined]


def _torch_layout(generator: torch.Generator, offset: int) -> bool:
    """Whether `generator`'s object holds its state, as `get_state` gives it, at `offset` as
    `_TORCH_OBJECT` lays it out (its seed, position and first words are compared before the rest
    is read, so that no read goes past an object whose layout is another)."""
    state = _TORCH_STATE.unpack(generator.get_state().numpy().tobytes())
    (seed, left, seeded, position), words = state[:4], [w & 0xFFFFFFFF for w in state[4:628]]
    _, normal, _, normal_valid, float_normal, float_valid = state[628:]
    head = struct.Struct("=QiB3xI8I")  # the padding after `seeded` holds anything
    address = _address(generator) + offset
    if head.unpack(ctypes.string_at(address, head.size)) != (
        seed,
        left,
        seeded,
        position,
        *words[:8],
    ):
        return False
    held = _TORCH_OBJECT.unpack(ctypes.string_at(address, _TORCH_OBJECT.size))
    float_held, float_held_valid, normal_held, normal_held_valid = held[628:]
    return (
        list(held[4:628]) == words
        and float_held_valid == float_valid
        and (not float_valid or float_held == float_normal)
        and normal_held_valid == bool(normal_valid)
        and (not normal_valid or normal_held == normal)
    )


class _TorchState(_Marked):
    """torch's default CPU generator, read cheaply. `get_state` copies its 5 KB state into a new
    tensor, and a comparison reads both: on every batch, several percent of a small model's step.
    Its C++ object holds the twister's seed and position, its 624 words and the two cached normals
    at an offset found once (`_torch_words`): the position, the first and last words and the
    cached normals are the mark. Where that layout is not found (another torch), every state is
    `get_state`'s, compared where it lies."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator
        self._words = _torch_words(generator)

    def _mark(self) -> Any:
        w = self._words
        if w is None:
            return None
        return _TORCH_HEAD.unpack_from(w), _TORCH_TAIL.unpack_from(w, _TORCH_TAIL_AT)

    def _read(self) -> Any:
        return self.generator.get_state()

    def _write(self, state: Any) -> None:
        self.generator.set_state(state)

    def _same(self, saved: Any) -> bool:
        return _same_torch_state(saved)


_TORCH = torch.default_generator
_TORCH_READER = _TorchState(_TORCH)
_NUMPY = _NumpyState()
_RANDOM = _PythonRandom()
# Not torch.manual_seed, which also seeds (and so initialises) CUDA: a DataLoader worker must not
# touch it. NumPy's legacy seed takes 32 bits.
GENERATORS = {
    "torch": _Generator(
        _TORCH_READER.get, _TORCH_READER.set, _TORCH.manual_seed, _TORCH_READER.unchanged
    ),
    "random": _Generator(_RANDOM.get, _RANDOM.set, random.seed, _RANDOM.unchanged),
    "numpy": _Generator(
        _NUMPY.get, _NUMPY.set, lambda s: np.random.seed(s & 0xFFFFFFFF), _NUMPY.unchanged
    ),
}


_IN_ORDER = tuple(GENERATORS.items())


def _kept() -> tuple[tuple[Any, Any], ...] | None:
    """(mark, state) of each of the three generators (in GENERATORS' order), where each one's state
    can be kept at its mark; None where one's cannot."""
    marks = _marks()  # first: a mark forgets what was kept of a generator replaced
    t, r, n = _TORCH_READER._known, _RANDOM._known, _NUMPY._known
    # every batch but the first: each generator where it was kept
    if t is not None and r is not None and n is not None and (t[0], r[0], n[0]) == marks:
        return t, r, n
    torch_kept, random_kept, numpy_kept = _TORCH_READER.kept(), _RANDOM.kept(), _NUMPY.kept()
    if torch_kept is None or random_kept is None or numpy_kept is None:
        return None
    return torch_kept, random_kept, numpy_kept


def _marks() -> tuple:
    return _TORCH_READER._mark(), _RANDOM._mark(), _NUMPY._mark()


def _states_of(kept: tuple[tuple[Any, Any], ...]) -> dict[str, Any]:
    return {name: state for name, (_, state) in zip(GENERATORS, kept, strict=True)}


def seed(s: int) -> None:
    """Seed torch's global CPU generator, `random` and NumPy's legacy global generator with `s`."""
    for generator in GENERATORS.values():
        generator.seed(s)


def states() -> dict[str, Any]:
    """The three generators' states."""
    return {name: generator.get() for name, generator in GENERATORS.items()}


def restore(saved: dict[str, Any], names: Iterable[str] | None = None) -> None:
    """Set the generators `names` (all: None) to their states in `saved`."""
    for name in GENERATORS if names is None else names:
        GENERATORS[name].set(saved[name])


@contextmanager
def kept() -> Iterator[None]:
    """Restore the three global generators on leaving, to the states they had on entering."""
    saved = states()
    try:
        yield
    finally:
        restore(saved)


def read(keyed: Iterable[tuple[int, int]], read_one: Callable[[int], T]) -> list[T]:
    """`read_one(index)` for each (key, index), each with the three generators seeded from its key
    and index; the generators as they were afterwards. For reads that cannot be repeated (an
    iterable stream's) or are rare; `Keyed` reads a map-style stream's batches."""
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
    """A map-style stream read by (key, index): each item as `read` would read it, seeding only the
    generators the stream has been seen to draw from (`drawn`, learned in each process; see the
    module's docstring), the generators restored after each batch. A batched read
    (`__getitems__`) draws for all of its items at once, so it is called for one item at a time:
    each item's draws are then its own, whatever batch it is in."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self.drawn: set[str] = set()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, keyed: tuple[int, int]) -> Any:
        return self.__getitems__([keyed])[0]

    def __getitems__(self, keyed: list[tuple[int, int]]) -> list[Any]:
        return self.read([index for _, index in keyed], [k for k, _ in keyed])

    def read(self, indices: list[int], key: int | list[int]) -> list[Any]:
        """The items `indices`, each read under `key` (one key, or one an item)."""
        if not self.drawn:
            items = self._unseeded(indices)
            if items is not None:
                return items
        saved = states()
        try:
            while True:
                drawn = self.drawn
                seeders = [GENERATORS[name].seed for name in drawn]
                if not seeders:
                    # a stream that has drawn nothing yet: no seed to compute
                    read = self._one if self._batched else self.dataset.__getitem__
                    items = [read(index) for index in indices]
                elif isinstance(key, int):
                    items = [self._read_seeded(key, index, seeders) for index in indices]
                else:
                    pairs = zip(key, indices, strict=True)
                    items = [self._read_seeded(k, i, seeders) for k, i in pairs]
                moved = [
                    name
                    for name, generator in _IN_ORDER
                    if name not in drawn and not generator.unchanged(saved[name])
                ]
                if not moved:
                    break
                # drawn from the reader's state: read again, those seeded too
                self.drawn = drawn | set(moved)
        except BaseException:
            restore(saved)
            raise
        restore(saved, self.drawn)
        return items

    def _unseeded(self, indices: list[int]) -> list[Any] | None:
        """The items read from the generators as they are, for a stream seen to draw from none:
        where none moved (the marks before and after alike), nothing else is read or restored.
        None where that cannot be told by the marks alone (a state not kept at its mark), or where
        one moved: its state is then put back and the stream is known to draw from it."""
        kept = _kept()
        if kept is None:
            return None
        read = self._one if self._batched else self.dataset.__getitem__
        try:
            items = [read(index) for index in indices]  # (not map(): see loading.fetcher)
        except BaseException:
            restore(_states_of(kept))
            raise
        after = _marks()
        if after == (kept[0][0], kept[1][0], kept[2][0]):
            return items
        restore(_states_of(kept))
        moved = zip(GENERATORS, kept, after, strict=True)
        self.drawn = {name for name, (mark, _), now in moved if mark != now}
        return None

    def _read_seeded(self, k: int, index: int, seeders: list[Callable[[int], Any]]) -> Any:
        s = item_seed(k, index)
        for seeder in seeders:
            seeder(s)
        return self._one(index)

    def _one(self, index: int) -> Any:
        return self.dataset.__getitems__([index])[0] if self._batched else self.dataset[index]
