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
seeded too (its draws came from the reader's state, not the item's). Looking is cheap for torch
(its state's bytes), NumPy (its twister's bytes, `_NumpyState`) and `random` (its twister's bytes,
`_PythonRandom`). A batch in which a process first sees a stream draw is read twice. A read that
restores the state it drew from is not seen to draw.
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


class _NumpyState:
    """NumPy's legacy global generator, read cheaply. `np.random.get_state` takes about 30 us; the
    Mersenne Twister's own state (624 words and a position, 2.5 KB) can be copied in a fraction of
    a microsecond through the bit generator's public ctypes interface. A draw moves the twister,
    except one legacy Gaussian served from the cache the previous one left (`has_gauss`). So the
    last whole state read without a cached Gaussian is kept beside a copy of the twister: while
    the twister is where it was, the state is that one (the cache, empty then, fills only by drawing
    from the twister), and a read that leaves the twister where it was drew nothing. With a
    Gaussian cached, or a global generator that is not a Mersenne Twister (`set_bit_generator`),
    the whole states are read and compared. States set here (`set`: phalanx's restores and
    resumes) forget the kept one; not seen: the user's own `np.random.set_state` to a state of the
    same twister with a Gaussian cached."""

    def __init__(self) -> None:
        # the global generator's bit generator, and a copy of its twister (None: not one)
        self._generator: Any = None
        self._twister: Callable[[], bytes] | None = None
        # the twister's copy and the whole state (without a cached Gaussian) read with it
        self._known: tuple[bytes, tuple] | None = None

    def _current(self) -> Callable[[], bytes] | None:
        """The twister's reader for the global generator as it is now."""
        generator = getattr(np.random.mtrand._rand, "_bit_generator", None)
        if generator is not self._generator:
            self._generator, self._twister, self._known = generator, None, None
            if isinstance(generator, np.random.MT19937):
                self._twister = _reader(generator.ctypes.state_address, 624 * 4 + 4)
        return self._twister

    def get(self) -> Any:
        twister = self._current()
        if twister is None:
            return _numpy_state()
        now, known = twister(), self._known
        if known is not None and known[0] == now:
            return known[1]
        state = _numpy_state()
        # kept where nothing drew in between (another thread) and no Gaussian is cached; its key
        # array read-only, since every caller is handed this one tuple
        if not state[3] and twister() == now:
            state[1].flags.writeable = False
            self._known = (now, state)
        else:
            self._known = None
        return state

    def set(self, state: Any) -> None:
        np.random.set_state(state)
        known = self._known
        if known is None or state is not known[1]:
            self._known = None

    def unchanged(self, saved: Any) -> bool:
        twister, known = self._current(), self._known
        if twister is not None and known is not None and known[1] is saved:
            return twister() == known[0]
        return _same_numpy_state(saved, _numpy_state())


def set_numpy_state(state: Any) -> None:
    """`np.random.set_state` for phalanx's own code: the cheap reader forgets what it kept."""
    _NUMPY.set(state)


def _numpy_state() -> Any:
    """NumPy's global state: the legacy tuple for its Mersenne Twister, a dict for another bit
    generator (`np.random.set_bit_generator`), whose state the legacy form cannot hold."""
    if isinstance(getattr(np.random.mtrand._rand, "_bit_generator", None), np.random.MT19937):
        return np.random.get_state()
    return np.random.get_state(legacy=False)


class _PythonRandom:
    """Python's `random`, read cheaply. `random.getstate` builds a tuple of 625 integers (about
    10 us, and as long again to compare two); the C object the module's functions draw from holds
    its twister right after the object header, as its position and 624 words (2.5 KB), which a copy
    reads in a fraction of a microsecond. That layout is CPython's own: it is checked against
    `getstate` once, and where it does not match (another interpreter, a free-threaded build) the
    states are `getstate`'s. A state read here is the twister's bytes and the Gaussian that
    `random.gauss` keeps for its next call."""

    def __init__(self) -> None:
        # the generator the module's functions draw from, and its twister's address (None: read
        # by getstate)
        self._generator: Any = None
        self._address: int | None = None
        self._twister: Callable[[], bytes] = bytes  # its bytes, where the address is known
        try:
            generator = random.random.__self__  # type: ignore[attr-defined]
            # where id() is an address and no other thread draws while the bytes are copied
            cpython = sys.implementation.name == "cpython"
            if cpython and getattr(sys, "_is_gil_enabled", lambda: True)():
                address = id(generator) + object.__basicsize__
                _, words, _ = generator.getstate()
                if ctypes.string_at(address, _TWISTER) == _packed(words):
                    self._generator, self._address = generator, address
                    self._twister = _reader(address, _TWISTER)
        except (AttributeError, TypeError, ValueError, struct.error):
            pass

    def get(self) -> Any:
        address = self._address
        if address is None:
            return random.getstate()
        return self._twister(), self._generator.gauss_next

    def set(self, saved: Any) -> None:
        if self._address is None:
            random.setstate(saved)
            return
        twister, gauss = saved
        position, *words = struct.unpack(_TWISTER_LAYOUT, twister)
        random.setstate((random.Random.VERSION, (*words, position), gauss))

    def unchanged(self, saved: Any) -> bool:
        return self.get() == saved


# CPython's twister, as its C object holds it: the position, then the words
_TWISTER_LAYOUT = "=i624I"
_TWISTER = struct.calcsize(_TWISTER_LAYOUT)


def _packed(words: tuple[int, ...]) -> bytes:
    """`getstate`'s 624 words and position as the C object holds them."""
    return struct.pack(_TWISTER_LAYOUT, words[-1], *words[:-1])


def _reader(address: int, length: int) -> Callable[[], bytes]:
    """A function that copies `length` bytes from `address`: a view made once, its bytes read
    on each call (a seventh of `ctypes.string_at`'s cost, which converts its arguments each
    time). The memory must outlive the view: a generator's, which its reader keeps."""
    view = (ctypes.c_char * length).from_address(address)
    return lambda: view.raw


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


_TORCH = torch.default_generator
_NUMPY = _NumpyState()
_RANDOM = _PythonRandom()
# Not torch.manual_seed, which also seeds (and so initialises) CUDA: a DataLoader worker must not
# touch it. NumPy's legacy seed takes 32 bits.
GENERATORS = {
    "torch": _Generator(_TORCH.get_state, _TORCH.set_state, _TORCH.manual_seed, _same_torch_state),
    "random": _Generator(_RANDOM.get, _RANDOM.set, random.seed, _RANDOM.unchanged),
    "numpy": _Generator(
        _NUMPY.get, _NUMPY.set, lambda s: np.random.seed(s & 0xFFFFFFFF), _NUMPY.unchanged
    ),
}


_IN_ORDER = tuple(GENERATORS.items())


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

    def _read_seeded(self, k: int, index: int, seeders: list[Callable[[int], Any]]) -> Any:
        s = item_seed(k, index)
        for seeder in seeders:
            seeder(s)
        return self._one(index)

    def _one(self, index: int) -> Any:
        return self.dataset.__getitems__([index])[0] if self._batched else self.dataset[index]
