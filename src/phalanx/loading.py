"""Loaders of a plan's shards: a loader per epoch (in the process where it has no workers), or
persistent workers seeded per epoch as fresh ones would be (`Loaders`), and the DataLoader options
a config and a device ask for; and the steps of an iterable stream (`StreamSteps`). Items become
batches in `phalanx.batching`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import random
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from phalanx import environment, seeding
from phalanx.batching import NamedItems, collate, empty_like
from phalanx.data import Micro, Plan, is_iterable
from phalanx.errors import ConfigError, DataError

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.strategies.base import Strategy


class _ShardSampler:
    """Feeds a DataLoader the shards of a plan's steps, from a starting step on; with `tag`, each
    index as (tag, index): the key of a `seeding.Keyed` read, or the seed of `_Reseeded` workers."""

    def __init__(self, plan: Plan, start: int, tag: Any = None):
        self.plan, self.start, self.tag = plan, start, tag

    def __iter__(self) -> Iterator[list[int]] | Iterator[list[tuple[Any, int]]]:
        tag = self.tag
        for _, micros in self.plan.steps(self.start):
            for micro in micros:
                yield micro.shard if tag is None else [(tag, i) for i in micro.shard]

    def __len__(self) -> int:
        return self.plan.micro_batches(self.start)


class _Unbatchable:
    """A collate error in a DataLoader worker, carried back as a value: the loader re-raises a
    worker's exception with the worker's traceback inside its message, no longer one line."""

    def __init__(self, message: str):
        self.message = message


class _Collate:
    """`collate` for one stream; in worker processes, errors travel back as `_Unbatchable`. An empty
    shard is None, or the zero-size batch `empty` where the strategy runs the model on it too."""

    def __init__(
        self,
        name: str,
        in_worker: bool,
        empty: Mapping | None = None,
        keys: tuple[str, ...] | None = None,
    ):
        self.name, self.in_worker, self.empty, self.keys = name, in_worker, empty, keys

    def __call__(self, items: list[Any]) -> dict[str, Any] | _Unbatchable | None:
        if not items and self.empty is not None:
            return dict(self.empty)
        try:
            return collate(items, self.name, self.keys)
        except DataError as e:
            if not self.in_worker:
                raise
            return _Unbatchable(str(e))


class _WorkersLoader(DataLoader):
    """A DataLoader with worker processes that raises their collate errors as themselves."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # torch's stub: its own iterator
        if self._iterator is None or not self.persistent_workers:  # the workers start here
            _collect_before_fork(self.multiprocessing_context)
        for batch in super().__iter__():
            if isinstance(batch, _Unbatchable):
                raise DataError(batch.message)
            yield batch


def _end_with(parent: int, worker_id: int) -> None:
    """A DataLoader worker's `worker_init_fn`: Linux kills it when the process that started it,
    `parent`, ends. A training process that ends at once (a failed or stopped worker of several
    ends with `os._exit`) takes its loader workers with it, instead of leaving them to notice
    seconds later, holding the terminal's output open meanwhile. Where the worker is not
    `parent`'s child (a forkserver started it), or not on Linux, nothing: torch's workers watch
    their parent themselves."""
    import ctypes

    if os.getppid() != parent:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it ended while this was asked
            os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _collect_before_fork(context: Any) -> None:
    """A forked worker's garbage collector frees whatever garbage it inherited, in a process that
    has none of its parent's threads: an earlier loader's pinned batches or a resumed optimizer's
    CUDA state (freeing them calls CUDA, which aborts the worker), a process group that was
    destroyed (freeing it waits for its communication threads, which hangs the worker). Collected
    here, before the fork, there is none to inherit; it costs one collection a loader start."""
    if (context or torch.multiprocessing).get_start_method() == "fork":
        gc.collect()


def loader(
    dataset: Any,
    plan: Plan,
    start: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    seed: int = 0,
    name: str = "",
    empty_batches: bool = False,
    key: int | None = None,
) -> Iterable[Any]:
    """A loader that yields this rank's shard of every micro-batch of `plan` from step `start`;
    `name` is the stream's, for errors. An empty shard is None, or with `empty_batches` a batch of
    zero samples shaped like the stream's items (for strategies whose every rank runs the model).
    With `key` (see `phalanx.seeding`), each item is read with the global generators seeded from the
    key and its index, in this process or a worker alike, and restored after.

    Its own generator, seeded by `seed`, seeds the workers: making the loader draws nothing from the
    global RNG, so a resumed run's dropout and augmentation continue exactly where they stopped.
    Without workers, the batches are read here, as a DataLoader without workers reads them
    (`_InProcess`), and pinned as it pins them.
    """
    empty = empty_batch(dataset, name, key) if empty_batches and len(dataset) else None
    pin = _pinner() if pin_memory and not num_workers else None
    if not num_workers and (not pin_memory or pin is not None):
        fetch = fetcher(dataset, name, key, empty)
        return _InProcess(_unnamed(dataset)[0], fetch, _ShardSampler(plan, start), pin)
    kind = _WorkersLoader if num_workers else DataLoader
    items, keys = _unnamed(dataset)
    return kind(
        items if key is None else seeding.Keyed(items),
        batch_sampler=_ShardSampler(plan, start, key),
        collate_fn=_Collate(name, num_workers > 0, empty, keys),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=prefetch_factor,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(_end_with, os.getpid()) if num_workers else None,
    )


def fetcher(
    dataset: Any, name: str = "", key: int | None = None, empty: Mapping | None = None
) -> Callable[[list[int]], dict[str, Any] | None]:
    """A function that reads the given samples of a stream in this process and collates them: for
    a loader without workers, and for a strategy that deals each batch's samples out, whose
    processes read only those they take. With `key`, each sample as `loader` reads it; an empty
    list of samples gives `empty` (None: None)."""
    items, keys = _unnamed(dataset)
    batch = _Collate(name, False, empty, keys)
    if key is not None:
        read = seeding.Keyed(items).read

        def fetch(indices: list[int]) -> dict[str, Any] | None:
            return batch(read(indices, key))  # type: ignore[return-value]  # never _Unbatchable

        return fetch
    getitems = getattr(items, "__getitems__", None)

    def fetch_plain(indices: list[int]) -> dict[str, Any] | None:
        # a comprehension, not map(): Python 3.11 runs a Python __getitem__ inside the
        # comprehension's frame loop, where map() makes a C call and starts a new frame loop for
        # every sample (the comprehension is about 6% faster on the benchmarks' items)
        got = getitems(list(indices)) if getitems is not None else [items[i] for i in indices]
        return batch(got)  # type: ignore[return-value]  # not in a worker: never _Unbatchable

    return fetch_plain


class _InProcess:
    """The batches of a loader without workers, each read and collated in this process when it is
    asked for (and pinned, with `pin`): what a DataLoader without workers does, less its machinery
    around each batch (about 15 us a batch, a few percent of a small model's step)."""

    def __init__(
        self,
        dataset: Any,
        fetch: Callable[[list[int]], Any],
        sampler: _ShardSampler,
        pin: Callable[[Any], Any] | None = None,
    ):
        self.dataset = dataset  # the items read, as a DataLoader's
        self._fetch, self._sampler, self._pin = fetch, sampler, pin

    def __iter__(self) -> Iterator[Any]:
        fetch, pin = self._fetch, self._pin
        for shard in self._sampler:
            batch = fetch(shard)  # type: ignore[arg-type]  # untagged: the shard's indices
            yield batch if pin is None or batch is None else pin(batch)

    def __len__(self) -> int:
        return len(self._sampler)


def _pinner() -> Callable[[Any], Any] | None:
    """What a DataLoader without workers pins its batches with (None where it would not pin: no
    GPU, or a torch that moved it; the DataLoader then says so itself)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.utils.data._utils.pin_memory import pin_memory
    except ImportError:
        return None
    return pin_memory


def first_items(stream: Any, n: int, key: int | None = None) -> list[Any]:
    """A stream's first `n` items (fewer where it is shorter): by index, or as an iterable stream
    gives them; with `key`, each read as a keyed loader reads it, the global generators left as
    they were."""
    if is_iterable(stream):
        steps = StreamSteps(stream, n, key=key)
        return steps._take(steps._iter(), 0)
    indices = range(min(n, len(stream)))
    if key is None:
        return [stream[i] for i in indices]
    return seeding.read_items(key, indices, stream.__getitem__)


def _unnamed(dataset: Any) -> tuple[Any, tuple[str, ...] | None]:
    """The stream that a stream named by dataset.keys wraps, and the keys, so that the loader
    reads the items as they are and names whole batches."""
    if isinstance(dataset, NamedItems):
        return dataset.stream, dataset.keys
    return dataset, None


def base_seed(seed: int) -> int:
    """The seed a DataLoader whose generator is seeded with `seed` gives its workers (worker w
    seeds itself with it plus w)."""
    return int(
        torch.empty((), dtype=torch.int64)
        .random_(generator=torch.Generator().manual_seed(seed))
        .item()
    )


class _Reseeded(Dataset):
    """A stream read by persistent workers, indexed by (seed, index): a worker that sees a new seed
    (a new epoch's loader) seeds random, numpy and torch as a new DataLoader's worker would, so that
    augmentation draws the same numbers as with workers started afresh each epoch."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._seed: tuple[int, int] | None = None
        # its batched read (Hugging Face datasets have one)
        if callable(getattr(dataset, "__getitems__", None)):
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[tuple[int, int], int]) -> Any:
        token, index = key
        self._reseed(token)
        return self.dataset[index]

    def _getitems(self, keys: list[tuple[tuple[int, int], int]]) -> list[Any]:
        if not keys:
            return []
        self._reseed(keys[0][0])
        return self.dataset.__getitems__([index for _, index in keys])

    def _reseed(self, token: tuple[int, int]) -> None:
        if token != self._seed:
            self._seed = token
            worker = torch.utils.data.get_worker_info()
            # persistent workers only: this runs in a worker process
            assert worker is not None
            _seed_worker(token[0], worker.id)


def _seed_worker(seed: int, worker: int) -> None:
    # the seeding torch's workers start with
    from torch.utils.data._utils.worker import _generate_state

    random.seed(seed + worker)
    torch.manual_seed(seed + worker)
    np.random.seed(_generate_state(seed, worker))


class Loaders:
    """DataLoaders whose workers live for the whole run (`dataset.persistent_workers`): one per
    stream, pointed at each epoch's plan, its workers seeded at each epoch as `loader`'s fresh ones
    are (or each item by its key, as `loader`'s), so that a run reads and augments the same batches
    either way."""

    def __init__(
        self, num_workers: int, pin_memory: bool = False, prefetch_factor: int | None = None
    ):
        self.options: dict[str, Any] = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor,
        }
        self._made: dict[tuple[str, bool, bool], tuple[Any, DataLoader, _ShardSampler]] = {}
        self._uses = 0

    def loader(
        self,
        dataset: Any,
        plan: Plan,
        start: int = 0,
        seed: int = 0,
        name: str = "",
        empty_batches: bool = False,
        training: bool = False,
        key: int | None = None,
    ) -> DataLoader:
        """As `loader`, with the workers of this stream (for training or evaluation: a stream may
        be both, evaluated in the middle of its training epoch), started at their first use."""
        made = self._made.get((name, training, key is not None))
        self._uses += 1
        # the workers' items: keyed, or (seed, the loader's use), new at every epoch even where the
        # seed is not
        tag = key if key is not None else (base_seed(seed), self._uses)
        if made is None or made[0] is not dataset:
            sampler = _ShardSampler(plan, start, tag)
            empty = empty_batch(dataset, name, key) if empty_batches and len(dataset) else None
            items, keys = _unnamed(dataset)
            made = self._made[name, training, key is not None] = (
                dataset,
                _WorkersLoader(
                    seeding.Keyed(items) if key is not None else _Reseeded(items),
                    batch_sampler=sampler,
                    collate_fn=_Collate(name, True, empty, keys),
                    persistent_workers=True,
                    generator=torch.Generator().manual_seed(seed),
                    worker_init_fn=functools.partial(_end_with, os.getpid()),
                    **self.options,
                ),
                sampler,
            )
        _, made_loader, sampler = made
        sampler.plan, sampler.start, sampler.tag = plan, start, tag
        return made_loader

    def close(self) -> None:
        """End the workers now, even where an iterator of theirs is still referenced (by a
        traceback, say); otherwise they would end with the process."""
        for _, made_loader, _ in self._made.values():
            iterator = getattr(made_loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self._made.clear()


def empty_batch(dataset: Any, name: str = "", key: int | None = None) -> dict[str, Any]:
    """A batch of zero samples shaped like the stream's items: each tensor value with a first
    dimension of 0, lists empty, other values as the first item has them. With `key`, the first
    item is read as a keyed loader reads it, the global generators left as they were."""
    first = dataset[0] if key is None else seeding.read([(key, 0)], dataset.__getitem__)[0]
    return empty_like(first, name)


def loader_options(cfg: Config, strategy: Strategy) -> tuple[dict[str, Any], bool]:
    """DataLoader workers and pinned memory: by default none on CPU; on a GPU, pinned memory and up
    to 4 workers per device, as the machine's cores allow. And whether the workers persist."""
    workers = cfg.dataset.num_workers
    on_gpu = strategy.device.type == "cuda"
    if workers == "auto":
        local = environment.here().local_world_size
        workers = min(4, (os.cpu_count() or 1) // max(1, local) - 1) if on_gpu else 0
    pin = on_gpu if cfg.dataset.pin_memory == "auto" else cfg.dataset.pin_memory
    options = {"num_workers": max(0, workers), "pin_memory": pin}
    for key in ("prefetch_factor", "persistent_workers"):
        value = getattr(cfg.dataset, key)
        if value not in (None, "auto", False) and not options["num_workers"]:
            raise ConfigError(
                f"dataset.{key}={str(value).lower()} is for DataLoader workers, but this run has "
                f"none; set dataset.num_workers, or remove {key}"
            )
    if cfg.dataset.prefetch_factor is not None:
        options["prefetch_factor"] = cfg.dataset.prefetch_factor
    persistent = cfg.dataset.persistent_workers
    return options, bool(options["num_workers"]) and persistent in (True, "auto")


class StreamSteps:
    """The global steps of an iterable stream: each takes the next `batch_size` items in the
    stream's own order (the last may be short), cut into micro-batches and shards exactly as `Plan`
    cuts positions. Every rank reads every item and keeps its own shards, so the global batches are
    those of one process on any number of them; the reading is repeated on each rank. Yields (step,
    [(micro, batch) ...]) from step `start`: the items of the steps before are read and dropped,
    unless `positioned` (the stream restored its own position). With `key`, each item is read with
    the global generators seeded from the key and its position in the stream (and `iter` of the
    stream from the key alone), restored after each step's reading."""

    def __init__(
        self,
        stream: Any,
        batch_size: int,
        accumulation: int = 1,
        rank: int = 0,
        world_size: int = 1,
        weights: Sequence[float] | None = None,
        start: int = 0,
        name: str = "",
        empty_batches: bool = False,
        positioned: bool = False,
        key: int | None = None,
    ):
        self.stream, self.batch_size, self.accumulation = stream, batch_size, accumulation
        self.rank, self.world_size, self.weights = rank, world_size, weights
        self.start, self.name, self.empty_batches, self.positioned = (
            start,
            name,
            empty_batches,
            positioned,
        )
        self.key = key

    def __iter__(self) -> Iterator[tuple[int, list[tuple[Micro, dict | None]]]]:
        items = self._iter()
        if not self.positioned:
            skipped = sum(len(self._take(items, k)) for k in range(self.start))
            if skipped < self.start * self.batch_size:
                raise DataError(
                    f"stream {self.name!r} ended after {skipped} items, but the checkpoint is "
                    f"{self.start} steps of {self.batch_size} into it: is it the stream the run "
                    "began with?"
                )
        k = self.start
        while True:
            taken = self._take(items, k)
            if not taken:
                # training on it would take no step, and its metrics would be those of nothing
                if k == 0:
                    raise DataError(
                        f"stream {self.name!r} yielded no item; a stream needs at least one "
                        "sample: check what it reads (its path, split or filter)"
                    )
                return
            first = k * self.batch_size
            plan = Plan(
                range(first, first + len(taken)),
                len(taken),
                self.accumulation,
                self.rank,
                self.world_size,
                self.weights,
            )
            fetched = []
            for micro in plan.step(0):
                batch = collate([taken[p - first] for p in micro.shard], self.name)
                # a batch of zero samples, shaped like the items
                if batch is None and self.empty_batches:
                    batch = empty_like(taken[0], self.name)
                fetched.append((micro, batch))
            yield k, fetched
            k += 1

    def _iter(self) -> Iterator[Any]:
        if self.key is None:
            return iter(self.stream)
        # where a stream's __iter__ draws (a shuffle of its files), it draws from the key too
        return seeding.read([(self.key, _START)], lambda _: iter(self.stream))[0]

    def _take(self, items: Iterator[Any], k: int) -> list[Any]:
        """Step `k`'s items: the next `batch_size` (fewer at the stream's end)."""
        if self.key is None:
            return list(itertools.islice(items, self.batch_size))
        first = k * self.batch_size
        positions = range(first, first + self.batch_size)
        read = seeding.read_items(self.key, positions, lambda _: next(items, _END))
        return list(itertools.takewhile(lambda item: item is not _END, read))


# the position `iter` of an iterable stream is keyed by: before its first item
_START = -1
_END = object()
