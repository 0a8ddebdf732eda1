"""The feed: the dataset's streams as the loop takes them. An epoch's training steps from the cursor
on (each a list of micro-batches and this process's batch of each), an evaluation stream's batches,
the training stream's first samples, the loader workers kept between epochs, and an iterable
stream's position as checkpoint state.

A strategy that reads the training samples itself (param_server deals each batch's samples out to
its workers as they become free) says so through `Strategy.feed`, which calls `deal`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from phalanx import batching, data, loading, seeding
from phalanx.config import Config
from phalanx.data import TRAIN
from phalanx.errors import ConfigError
from phalanx.strategies.base import Strategy

log = logging.getLogger("phalanx")

# a step of the epoch: its index, and each micro-batch with this process's batch of it
Step = tuple[int, list[tuple[data.Micro, Any]]]


class Ahead:
    """A loop's steps, each one readable ahead of its turn (`fetch`): a strategy whose step waits
    on a reduction with nothing to do reads the next step's batch meanwhile. A read that fails is
    raised where the step would have been read without it, after the step before has ended (an
    interruption, a KeyboardInterrupt, is not held back); `seconds`: the time spent reading
    ahead, for the loop's profile to count as data time."""

    __slots__ = ("_steps", "_next", "_error", "seconds")

    def __init__(self, steps: Iterator[Step]):
        self._steps = steps
        self._next: Step | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Step:
        step = self._next
        if step is not None:
            self._next = None
            return step
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return next(self._steps)

    def fetch(self) -> None:
        """Read the next step now, where it has not been (none after the last)."""
        if self._next is not None or self._error is not None:
            return
        start = time.perf_counter()
        try:
            self._next = next(self._steps)
        except Exception as e:  # noqa: BLE001 - raised in its turn (`__next__`), the end too
            self._error = e
        self.seconds += time.perf_counter() - start


class Feed:
    """The streams of `dataset` for a run of `cfg` under `strategy`. `persistent`: keep loader
    workers between epochs (not for one evaluation, which nothing would end)."""

    def __init__(self, cfg: Config, dataset: Any, strategy: Strategy, persistent: bool = True):
        self.cfg, self.dataset, self.strategy = cfg, dataset, strategy
        self._streams: dict[str, Any] = {}
        # the kind of sample order; a run resumed from an older checkpoint keeps its own
        self.order = data.FEISTEL
        self.shard_weights = _shard_weights(cfg, strategy.data_world_size)
        self.loader_options, keeps = loading.loader_options(cfg, strategy)
        self.loaders = loading.Loaders(**self.loader_options) if keeps and persistent else None
        # an iterable training stream that restored its own position from a checkpoint
        self._positioned = False
        self._warned_position = False
        # where the strategy reads the training samples itself: it is given the reader
        self._dealer: Callable[[Callable[[list[int]], Mapping | None]], None] | None = None
        strategy.feed(self)

    def deal(self, to: Callable[[Callable[[list[int]], Mapping | None]], None]) -> None:
        """Plan each training step's micro-batches whole and unread (every `Micro` holds all its
        samples, its batch None), and give `to` the function that reads samples by index, at each
        epoch's start. Evaluation keeps its shards."""
        self._dealer = to

    @property
    def streams(self) -> list[str]:
        return [TRAIN, *self.cfg.main_loop.extra_streams]

    def open_streams(self) -> None:
        """Every stream the run reads asked of the dataset now: a stream it does not have is said
        before a hook's check names another symptom of the same mistake."""
        for name in self.streams:
            self.stream(name)

    def stream(self, name: str) -> Any:
        """Stream `name` of the dataset, asked of `streams()` once."""
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = batching.named(
                data.get_stream(self.dataset, name), self.cfg.dataset.keys, name
            )
        return stream

    @property
    def reads_ahead(self) -> bool:
        """Whether a training step's batch may be read before its turn (`Ahead`): where the steps
        come from the plan, a map-style stream read here, and a checkpoint's cursor is the run's
        step, and where reading moves no generator a checkpoint saves (each sample's draws keyed
        by itself, `per_sample_random`). Not an iterable stream, whose checkpoint holds the
        stream's own position; not where the strategy reads the samples itself; not where items
        draw from the process's own generators, whose state a checkpoint after the step would
        hold with the next step's draws already taken."""
        return (
            self.cfg.per_sample_random
            and self._dealer is None
            and not data.is_iterable(self.stream(TRAIN))
        )

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples in the training stream; None for an iterable stream that does not say."""
        return data.stream_length(self.stream(TRAIN))

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in an epoch; None for an iterable stream that does not say its length."""
        n = self.samples_per_epoch
        return None if n is None else -(-n // self.cfg.dataset.batch_size)

    def close(self) -> None:
        """Stop the loader workers kept between epochs."""
        if self.loaders is not None:
            self.loaders.close()

    # --- training

    def steps(self, epoch: int, start: int) -> Iterator[Step]:
        """Epoch `epoch`'s steps from step `start` on."""
        stream = self.stream(TRAIN)
        cfg, strategy = self.cfg, self.strategy
        # each sample's augmentation: a function of the seed, the epoch and its index alone
        key = seeding.training_key(cfg.seed, epoch) if cfg.per_sample_random else None
        deals = self._dealer is not None
        # the shards this process trains on; a strategy that deals the samples out plans them all
        rank, world = (0, 1) if deals else (strategy.data_rank, strategy.data_world_size)
        if data.is_iterable(stream):
            if deals:
                raise ConfigError(
                    f"parallel.strategy={cfg.parallel.strategy} deals each batch's samples out to "
                    "its workers, which needs a stream indexed by sample (a map-style dataset); "
                    "this training stream is iterable: use parallel.strategy=ddp"
                )
            return self._stream_steps(stream, epoch, start, rank, world, key)
        plan = data.Plan(
            data.epoch_order(cfg.seed, epoch, len(stream), self.order),
            cfg.dataset.batch_size,
            cfg.parallel.accumulation,
            rank,
            world,
            self.shard_weights,
        )
        if self._dealer is not None:
            # the strategy reads the samples it takes itself: none is read here
            self._dealer(loading.fetcher(stream, TRAIN, key))
            return ((k, [(micro, None) for micro in micros]) for k, micros in plan.steps(start))
        worker_seed = hash((cfg.seed, epoch, start, strategy.data_rank)) % 2**62
        self._check_sync_batchnorm(plan)
        batches = iter(
            self.loader(
                stream,
                plan,
                start,
                seed=worker_seed,
                name=TRAIN,
                empty_batches=strategy.runs_empty_shards,
                training=True,
                key=key,
            )
        )
        return (
            (k, [(micro, next(batches)) for micro in micros]) for k, micros in plan.steps(start)
        )

    def _stream_steps(
        self, stream: Any, epoch: int, start: int, rank: int, world: int, key: int | None
    ) -> Iterator[Step]:
        """An iterable stream's own order: its next items, one global batch a step."""
        # streams that shuffle per epoch (datasets, webdataset)
        if callable(getattr(stream, "set_epoch", None)):
            stream.set_epoch(epoch)
        positioned, self._positioned = self._positioned, False
        steps = iter(
            loading.StreamSteps(
                stream,
                self.cfg.dataset.batch_size,
                self.cfg.parallel.accumulation,
                rank,
                world,
                self.shard_weights,
                start,
                TRAIN,
                self.strategy.runs_empty_shards,
                positioned,
                key,
            )
        )
        # its length is known only at its end
        if self.cfg.parallel.sync_batchnorm and self.strategy.data_world_size > 1:
            return ((k, self._full(k, fetched)) for k, fetched in steps)
        return steps

    def _check_sync_batchnorm(self, plan: data.Plan) -> None:
        """Synchronised BatchNorm needs every rank in every forward: no empty shard may occur."""
        if not (
            self.cfg.parallel.sync_batchnorm and self.strategy.data_world_size > 1 and len(plan)
        ):
            return
        # full batches all split alike; only the last may be short
        for k in {0, len(plan) - 1}:
            self._full(k, [(micro, None) for micro in plan.step(k)])

    def _full(self, k: int, fetched: list) -> list:
        """Step `k`'s micro-batches, where synchronised BatchNorm finds a sample on every rank
        (every rank knows the shards' sizes, so every rank stops here alike)."""
        if any(micro.any_empty for micro, _ in fetched):
            raise ConfigError(
                "parallel.sync_batchnorm needs a sample for each of the "
                f"{self.strategy.data_world_size} processes in every micro-batch, but step {k} has "
                "fewer; change dataset.batch_size, parallel.gradient_accumulation or the dataset "
                "size, or turn sync_batchnorm off"
            )
        return fetched

    # --- evaluation

    def eval_batches(self, name: str) -> Iterator[tuple[int, Mapping | None]]:
        """Stream `name`'s batches, every sample exactly once: (the global batch's size, this
        process's batch of it, None where it has no sample)."""
        stream = self.stream(name)
        batch_size = self.cfg.dataset.eval_batch_size or self.cfg.dataset.batch_size
        strategy = self.strategy
        # every evaluation of a stream draws the same augmentation for each sample
        key = seeding.stream_key(self.cfg.seed, name) if self.cfg.per_sample_random else None
        if data.is_iterable(stream):
            steps = loading.StreamSteps(
                stream,
                batch_size,
                1,
                strategy.data_rank,
                strategy.data_world_size,
                self.shard_weights,
                0,
                name,
                strategy.runs_empty_shards,
                key=key,
            )
            return ((step[0][0].global_size, step[0][1]) for _, step in steps)
        plan = data.Plan(
            range(len(stream)),
            batch_size,
            1,
            strategy.data_rank,
            strategy.data_world_size,
            self.shard_weights,
        )
        loaded = self.loader(
            stream, plan, 0, name=name, empty_batches=strategy.runs_empty_shards, key=key
        )
        return (
            (min(batch_size, len(stream) - k * batch_size), batch) for k, batch in enumerate(loaded)
        )

    def first_samples(self, n: int) -> Mapping:
        """The training stream's first `n` samples (fewer where it is shorter), as one batch."""
        stream = data.get_stream(self.dataset, TRAIN)
        # read as evaluation reads them: LogThroughput reads this process's shard size of them, so
        # the trainer's own draws must not depend on the count
        key = seeding.stream_key(self.cfg.seed, TRAIN) if self.cfg.per_sample_random else None
        items = loading.first_items(stream, n, key)
        if not items:
            raise ConfigError("the training stream is empty: there is nothing to train on")
        keys = tuple(self.cfg.dataset.keys) if self.cfg.dataset.keys else None
        batch = batching.collate(items, TRAIN, keys)
        assert batch is not None  # items is not empty
        return batch

    def loader(
        self,
        stream: Any,
        plan: data.Plan,
        start: int,
        seed: int = 0,
        name: str = "",
        empty_batches: bool = False,
        training: bool = False,
        key: int | None = None,
    ) -> Any:
        """The batches of `plan` from step `start`: from this stream's persistent workers, or a new
        DataLoader; with `key`, each item read under its own seed (`phalanx.seeding`)."""
        if self.loaders is not None:
            return self.loaders.loader(
                stream,
                plan,
                start,
                seed=seed,
                name=name,
                empty_batches=empty_batches,
                training=training,
                key=key,
            )
        return loading.loader(
            stream,
            plan,
            start,
            seed=seed,
            name=name,
            empty_batches=empty_batches,
            key=key,
            **self.loader_options,
        )

    # --- state

    def state_dict(self) -> Any:
        """Where an iterable training stream that can say so stands (its `state_dict()`, as JSON);
        None where it cannot."""
        stream = self.stream(TRAIN)
        if not (
            data.is_iterable(stream)
            and callable(getattr(stream, "state_dict", None))
            and callable(getattr(stream, "load_state_dict", None))
        ):
            return None
        position = stream.state_dict()
        try:
            json.dumps(position)
        except (TypeError, ValueError):
            if not self._warned_position:
                log.warning(
                    "stream train's state_dict() is not JSON; a resume reads the stream again up "
                    "to its position instead"
                )
                self._warned_position = True
            return None
        return position

    def load_state_dict(self, position: Any) -> None:
        """The iterable training stream goes on from `position`, which `state_dict` gave."""
        self.stream(TRAIN).load_state_dict(position)
        self._positioned = True


def _shard_weights(cfg: Config, world_size: int) -> list[float] | None:
    weights = cfg.parallel.shard_weights
    if weights is None or world_size == 1:
        return None
    if len(weights) != world_size:
        raise ConfigError(
            f"parallel.shard_weights has {len(weights)} weights {weights} but the job has "
            f"{world_size} processes; give one weight per process, or remove shard_weights"
        )
    return weights
