"""The trainer: builds the parts a config names and runs the main loop, calling hooks at its events.

The loop is written once; how devices and processes are used is the strategy's business, reached
only through its protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from phalanx import data, keras_models, loading, random, seeding, strategies, timeline
from phalanx.background import Background
from phalanx.build import (
    build_dataset,
    build_optimizer,
    build_schedulers,
    derived_seed,
    seed_everything,
)
from phalanx.checkpoint import Checkpoints, saves_shards
from phalanx.config import CompileConfig, Config
from phalanx.data import TRAIN
from phalanx.engine import Engine, GradNorms, concat
from phalanx.errors import ConfigError, ModelError, lost_a_peer
from phalanx.hooks import build_hooks
from phalanx.hooks.base import Hook, TrainingTerminated
from phalanx.hooks.profiler import Profile
from phalanx.hooks.variables import flat_variables
from phalanx.losses import StepLosses
from phalanx.model import Forward, build_model
from phalanx.objects import Objects
from phalanx.precision import Precision
from phalanx.runstate import Checkpointing
from phalanx.signals import GracefulStop, Interrupted
from phalanx.strategies.base import (
    DealsSamples,
    Micros,
    ModelOptions,
    Outcome,
    RandomStreams,
    Serves,
    Strategy,
)
from phalanx.view import RunView

log = logging.getLogger("phalanx")
EVENTS = ("before_training", "after_batch", "after_epoch", "after_epoch_profile", "after_training")


class _Interrupted(Exception):
    pass


def _check_given_model(module: torch.nn.Module, strategy: Strategy) -> None:
    """A model given as an object: built already, so not on the meta device; and, where each rank
    built its own (under torchrun), the same on every rank, as one process's would be."""
    where = strategy.init_context()
    if isinstance(where, torch.device):
        setting, instead = (
            ("parallel.fsdp.init: meta", "init: full")
            if where.type == "meta"
            else ("parallel.build: device", "build: host")
        )
        raise ConfigError(
            f"{setting} builds the model itself, but the model was given as an object, built "
            f"already; name its class in model.class, or use {instead}"
        )
    differing = strategy.differing_ranks(module) if hasattr(strategy, "differing_ranks") else []
    if differing:
        raise ConfigError(
            f"the model given differs on rank(s) {differing} from rank 0's: each process built its "
            "own from its own random state. Seed before building it (torch.manual_seed(0) first), "
            "so that every process starts from the same weights"
        )


class Trainer(Checkpointing):
    """One run: the model, data, optimizer, strategy and hooks that a config describes."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None,
        search_dirs: Sequence[Path] = (),
        hooks: Sequence[Hook] | None = None,
        strategy: Strategy | None = None,
        inference: bool = False,
        objects: Objects | None = None,
    ):
        """`hooks`: these instead of the config's. `objects`: a model, dataset or hooks given as
        Python objects (by `phalanx.fit`), used instead of building what the config names, and the
        hooks after the config's. `inference`: only evaluate and predict; no optimizer (building one
        imports torch's compiler stack, seconds of start-up that `phalanx eval` does not need)."""
        objects = objects or Objects()
        self.cfg, self.run_dir, self.search_dirs = cfg, run_dir, list(search_dirs)
        self.strategy = strategy or strategies.create(cfg)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        torch.set_float32_matmul_precision(cfg.matmul_precision)
        seed_everything(cfg.seed)
        self.dataset = (
            objects.dataset
            if objects.dataset is not None
            else build_dataset(cfg.dataset, self.search_dirs)
        )
        self._streams: dict[str, Any] = {}
        self._positioned = (
            False  # an iterable training stream restored its own position from a checkpoint
        )
        self._warned_position = False
        if objects.model is not None:
            module = objects.model
            _check_given_model(module, self.strategy)
        else:
            with self.strategy.init_context():
                module = build_model(cfg.model, self.search_dirs)
        if run_dir is not None and not inference and self.strategy.is_main:
            # a Keras model's description, which `phalanx export` rebuilds it from without its code
            keras_models.record(module, run_dir)
        self.precision = Precision(cfg.precision, self.strategy.device, cfg.channels_last)
        compiled = (
            (cfg.compile if not isinstance(cfg.compile, bool) else CompileConfig())
            if cfg.compile
            else None
        )
        options = ModelOptions(
            self.precision,
            cfg.channels_last,
            tuple(cfg.activation_checkpointing),
            compiled,
            sample=self._first_samples,
            adapter=lambda m: Forward(m, cfg.model, self.search_dirs),
        )
        # dropout masks keyed by sample: set on the user's module, under its own names, before any
        # strategy wraps, shards or splits it
        self.keyed = random.key_modules(module) if cfg.per_sample_random else []
        # the module to call, and the user's module inside it: what the optimizer steps and
        # checkpoints hold
        self.module, self.model = self.strategy.setup(module, options)
        # Dropout and augmentation: each rank's streams from the seed and the rank (rank 0's those
        # of one process), as on a resume on another process count; not from what building the model
        # drew, so that a model given as an object trains as the config's own would.
        seed_everything(derived_seed(cfg.seed, 0, self.strategy.rank))
        if isinstance(self.strategy, RandomStreams):  # towers: each tower's, as ddp's ranks'
            self.strategy.seed_streams(cfg.seed, 0)
        self.forward = Forward(self.module, cfg.model, self.search_dirs, inner=self.model)
        self.optimizer = optimizer = (
            None
            if inference
            else build_optimizer(
                cfg.optimizer,
                self.model,
                self.search_dirs,
                cfg.dataset.batch_size,
                fused=self.strategy.device.type == "cuda",
            )
        )
        self.schedulers = (
            []
            if optimizer is None
            else build_schedulers(cfg, optimizer, self.search_dirs, self.steps_per_epoch)
        )
        self.engine = Engine(
            self.module,
            self.forward,
            self.optimizer,
            self.schedulers,
            self.precision,
            cfg.optimizer.max_grad_norm,
            random_seed=cfg.seed if cfg.per_sample_random else None,
        )
        self.checkpoints = (
            Checkpoints(run_dir / "checkpoints", cfg.checkpoints.keep_last) if run_dir else None
        )
        self.background = None  # checkpoints.async: a writer thread on the main process
        if cfg.checkpoints.async_ and self.checkpoints is not None:
            if saves_shards(self.strategy):
                log.info(
                    "checkpoints.async: every rank writes its own shards at once; they are saved "
                    "as they are taken"
                )
            elif self.strategy.is_main:
                self.background = Background(
                    self.checkpoints,
                    lambda step, best: self._trace("checkpoint", step=step, best=best),
                )
        self.epoch, self.step, self.step_in_epoch = 0, 0, 0
        self.order = (
            data.FEISTEL
        )  # the kind of sample order; a run resumed from an older checkpoint keeps its own
        self.rounds = 0  # evaluation rounds begun, with main_loop.eval_every_n_steps
        self.shard_weights = _shard_weights(cfg, self.strategy.data_world_size)
        self.epoch_data: dict[str, dict[str, Any]] = {}
        self.metrics: dict[
            str, float
        ] = {}  # the numbers of the last evaluation round, as "stream.variable"
        # seconds this process spent: waiting for data; forward and backward (with the all-reduce
        # that overlaps backward); communication after backward; the optimizer; hooks; evaluation
        self.times = timeline.LoopTimes(cuda=self.strategy.device.type == "cuda")
        self.profile = self.times.total
        self.losses = StepLosses()
        self.last_batch_size = 0
        # the first step's gradients are looked at once: a model whose loss reaches none of the
        # parameters the optimizer trains would otherwise train nothing, silently
        self._unchecked = not isinstance(self.strategy, Serves)
        self.training = (
            False  # True while after_batch follows an optimizer step (not an evaluation)
        )
        self.stop = GracefulStop()
        own = list(hooks) if hooks is not None else build_hooks(cfg, self.search_dirs)
        if cfg.profile is not None and hooks is None:
            own.append(
                Profile(cfg.profile.start_step, cfg.profile.steps, cfg.profile.record_shapes)
            )
        self.hooks = [*own, *objects.hooks]
        self.loader_options, persistent = loading.loader_options(cfg, self.strategy)
        # workers kept between epochs; not for one evaluation (eval, predict), which nothing would
        # end
        self.loaders = (
            loading.Loaders(**self.loader_options) if persistent and not inference else None
        )
        self.view = RunView(self)  # what hooks see of the run
        # the steps done and whether training: a strategy names a hung rank's step by it, and one
        # whose processes do not step together (param_server) numbers its steps by it
        self.strategy.watch(lambda: (self.step, self.training))
        for hook in self.hooks:
            hook.attach(self.view)
        self._listeners = {event: [h for h in self.hooks if h.overrides(event)] for event in EVENTS}
        self._gatherers, self._gather_keys = _gathering(self._listeners["after_batch"])

    @property
    def streams(self) -> list[str]:
        return [TRAIN, *self.cfg.main_loop.extra_streams]

    def stream(self, name: str) -> Any:
        """Stream `name` of the dataset, asked of `streams()` once."""
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = loading.named(
                data.get_stream(self.dataset, name), self.cfg.dataset.keys, name
            )
        return stream

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in an epoch; None for an iterable stream that does not say its length."""
        n = data.stream_length(self.stream(TRAIN))
        return None if n is None else -(-n // self.cfg.dataset.batch_size)

    # --- the main loop -------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the configured epochs end or a hook stops; returns the process exit code.
        Where the strategy gives this process another role (a parameter server's), it serves the
        processes that train instead."""
        roles = self.strategy if isinstance(self.strategy, Serves) else None
        if roles is None:
            return self._run()
        if roles.serving:
            roles.serve(self.engine, self.steps_per_epoch)
            return 0
        with roles.working():
            return self._run()

    def _run(self) -> int:
        self.stop.install()
        success, code, interrupted = True, 0, False
        self._trace("started", epoch=self.epoch, step=self.step)
        try:
            with self.stop.starting():
                stop = self._emit("before_training")
            if stop is not None:
                raise stop
            if not self.cfg.main_loop.skip_zeroth_epoch and self.step == 0:
                self._evaluation_epoch(0, self.streams)
            every = self.cfg.main_loop.eval_every_n_steps
            if (
                every is not None and self.step // every > self.rounds
            ):  # saved on a beat, before its round
                self._evaluation_round(every)
            while self.epoch < self.cfg.main_loop.epochs:
                self._train_epoch()
        except TrainingTerminated as stop:
            success, code = stop.success, 0 if stop.success else 1
            (log.info if success else log.error)("training stopped: %s", stop.reason)
        except _Interrupted:
            self.save_checkpoint()
            success, code, interrupted = False, self.stop.exit_code(), True
        except Interrupted:  # while the hooks started: nothing trained, nothing to save
            log.warning("interrupted before the first step of this run")
            self._trace("interrupted", epoch=self.epoch, step=self.step, before_first_step=True)
            self._finish(False)
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            if lost_a_peer(error):  # a consequence: another rank or machine ended first
                self._trace("failed", step=self.step, error=error, cause="lost another rank")
            else:
                self._trace("failed", step=self.step, error=error)
            self._finish(False)
            raise
        committed = self._finish(success)
        if interrupted and self.strategy.is_main and self.stop.reforming:
            log.info(
                "the job re-formed at step %d (%s); its workers start again from it",
                self.step,
                "saved" if committed else "its checkpoint could not be written (see above)",
            )
        elif interrupted and self.strategy.is_main:  # said once the step is committed, not before
            log.warning(
                "interrupted at step %d; %s. Continue with: phalanx resume %s",
                self.step,
                "saved" if committed else "its checkpoint could not be written (see above)",
                self.run_dir,
            )
        self._trace(
            "interrupted" if code > 128 else "finished" if success else "failed",
            epoch=self.epoch,
            step=self.step,
        )
        return code

    def _finish(self, success: bool) -> bool:
        """End the run's parts; whether its last checkpoint was committed (a background write may
        still have been under way)."""
        self.stop.restore()
        if self.loaders is not None:
            self.loaders.close()
        self._emit("after_training", success)
        if self.background is not None:  # the last checkpoint is committed before the run ends
            try:
                self.background.wait()
            except Exception as e:  # noqa: BLE001 - a failed run's own error is the one to raise
                if success:
                    raise
                log.error("the last checkpoint could not be written: %s", e)
                return False
        return True

    def _train_epoch(self, end: bool = True) -> None:
        epoch = self.epoch + 1
        self.epoch_data = {s: {} for s in self.streams}
        self.losses.begin_epoch()
        profile = self.times.begin_epoch()
        try:
            self._train_steps(self._steps(epoch), profile)
        finally:  # also when a hook or a signal ends the epoch early
            self.times.end_epoch(profile)
        self.epoch, self.step_in_epoch = epoch, 0
        self.engine.end_epoch()
        if isinstance(self.strategy, Serves):
            self.strategy.epoch_report()
        if not end:
            return
        every = self.cfg.main_loop.eval_every_n_steps
        if every is None:
            self._evaluation_epoch(epoch, self.cfg.main_loop.extra_streams, profile)
        elif (
            self.epoch == self.cfg.main_loop.epochs and self.step % every
        ):  # the end of training, off the beat
            self.rounds = self.step // every + 1
            self._evaluation_epoch(self.rounds, self.cfg.main_loop.extra_streams, self.times.round)

    def _steps(self, epoch: int) -> Iterator[tuple[int, list[tuple[data.Micro, Any]]]]:
        """Epoch `epoch`'s steps from the cursor on: (step, [(micro-batch, this rank's batch)])."""
        stream = self.stream(TRAIN)
        cfg, strategy = self.cfg, self.strategy
        # each sample's augmentation: a function of the seed, the epoch and its index alone
        key = seeding.training_key(cfg.seed, epoch) if cfg.per_sample_random else None
        # the shards this process trains on; a strategy that deals the samples out plans them all
        rank, world = strategy.data_rank, strategy.data_world_size
        deals = isinstance(strategy, DealsSamples)
        if deals:
            rank, world = 0, 1
        if deals and data.is_iterable(stream):
            raise ConfigError(
                f"parallel.strategy={cfg.parallel.strategy} deals each batch's samples out to its "
                "workers, which needs a stream indexed by sample (a map-style dataset); this "
                "training stream is iterable: use parallel.strategy=ddp"
            )
        if data.is_iterable(
            stream
        ):  # the stream's own order: the next items, one global batch a step
            if callable(
                getattr(stream, "set_epoch", None)
            ):  # streams that shuffle per epoch (datasets, webdataset)
                stream.set_epoch(epoch)
            positioned, self._positioned = self._positioned, False
            steps = iter(
                loading.StreamSteps(
                    stream,
                    cfg.dataset.batch_size,
                    cfg.parallel.accumulation,
                    rank,
                    world,
                    self.shard_weights,
                    self.step_in_epoch,
                    TRAIN,
                    strategy.runs_empty_shards,
                    positioned,
                    key,
                )
            )
            if (
                cfg.parallel.sync_batchnorm and strategy.data_world_size > 1
            ):  # its length is known only at its end
                return ((k, self._full(k, fetched)) for k, fetched in steps)
            return steps
        plan = data.Plan(
            data.epoch_order(cfg.seed, epoch, len(stream), self.order),
            cfg.dataset.batch_size,
            cfg.parallel.accumulation,
            rank,
            world,
            self.shard_weights,
        )
        if deals:  # it reads the samples it takes itself: none is read here
            assert isinstance(strategy, DealsSamples)
            strategy.deal_from(loading.fetcher(stream, TRAIN, key))
            return (
                (k, [(micro, None) for micro in micros])
                for k, micros in plan.steps(self.step_in_epoch)
            )
        worker_seed = hash((cfg.seed, epoch, self.step_in_epoch, strategy.data_rank)) % 2**62
        self._check_sync_batchnorm(plan)
        batches = iter(
            self._loader(
                stream,
                plan,
                self.step_in_epoch,
                seed=worker_seed,
                name=TRAIN,
                empty_batches=strategy.runs_empty_shards,
                training=True,
                key=key,
            )
        )
        return (
            (k, [(micro, next(batches)) for micro in micros])
            for k, micros in plan.steps(self.step_in_epoch)
        )

    def _loader(
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

    def _train_steps(self, steps: Iterator, profile: dict[str, float]) -> None:
        self.training = True
        try:
            self._steps_loop(steps, profile)
        finally:
            self.training = False

    def _check_gradients(self) -> None:
        """After the run's first step: one error where no parameter that the optimizer trains got
        a gradient on any process (the step changed nothing, and no later one will)."""
        self._unchecked = False
        # negative weights zero the step's gradients (no positive weight to divide by): the
        # cause, where there is one, is the error to give
        self.engine.refuse_negative_weights()
        params = [p for g in self.engine.trained_optimizer.param_groups for p in g["params"]]
        local = any(
            p.grad is not None and bool(getattr(p.grad, "_local_tensor", p.grad).ne(0).any())
            for p in params
        )
        if not self.any_rank(local):
            raise ModelError(
                "no parameter that the optimizer trains got a gradient in the first step: the "
                "loss does not depend on them, so training would change nothing. Check that the "
                "model's forward uses its parameters (not copies, nor tensors detached from them) "
                "and that the loss is computed from its outputs"
            )

    def _steps_loop(self, steps: Iterator, profile: dict[str, float]) -> None:
        listeners = self._listeners["after_batch"]
        clock, stop = time.perf_counter, self.stop
        train_step, losses = self.train_step, self.losses
        every = self.cfg.main_loop.eval_every_n_steps
        device = self.times.device
        # seconds fetching, computing, communicating, optimizing and in hooks, since they were last
        # added to the epoch's `profile`
        live = self.times.begin_steps()
        try:
            t0 = clock()
            for k, fetched in steps:  # planning and fetching the step count as data time
                t1 = clock()
                if device is not None:
                    device.begin()
                result = train_step(fetched, stop.requested)
                if device is not None:
                    device.end()
                if self._unchecked:
                    self._check_gradients()
                losses.add(result.loss, result.settle)
                self.last_batch_size = fetched[0][0].global_size
                self.step, self.step_in_epoch = self.step + 1, k + 1
                t2 = clock()
                terminated = self._after_batch(listeners, TRAIN, result.parts)
                t3 = clock()
                communication, optimizer = result.communication_s, result.optimizer_s
                live[0] += t1 - t0
                live[1] += t2 - t1 - communication - optimizer
                live[2] += communication
                live[3] += optimizer
                live[4] += t3 - t2
                if terminated is not None:
                    raise terminated
                if result.stop:
                    raise _Interrupted
                if (
                    every is not None and self.step % every == 0
                ):  # an evaluation round, inside the epoch
                    self.times.add(profile)
                    self._evaluation_round(every)
                    t3 = clock()
                t0 = t3
        finally:
            losses.settle()  # no agreement in flight outlives the steps
            self.times.add(profile)

    def times_so_far(self) -> dict[str, float]:
        """Seconds this process spent so far in the run, by part of the loop, up to the last step
        (`profile` adds an epoch's at its end)."""
        return self.times.so_far()

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The last training step's global mean loss. Where the strategy agrees on it behind the
        step (the pipeline), reading it waits for that agreement: read it when it is needed."""
        return self.losses.last

    @property
    def epoch_loss(self) -> torch.Tensor | None:
        """The mean of the training steps' losses in the epoch so far (since the resume, in an
        epoch resumed), None before its first step. Reading it waits for the steps' losses where
        the strategy agrees on them behind the step, as `last_loss` does."""
        return self.losses.epoch_mean()

    def _evaluation_round(self, every: int) -> None:
        """Evaluate the extra streams after every `main_loop.eval_every_n_steps` (`every`) optimizer
        steps, and end an evaluation round: the after_epoch events, with the round's number
        (steps // N) as their epoch, and the training variables of the steps since the last
        round."""
        training, self.training = self.training, False
        self.rounds = self.step // every
        try:
            self._evaluation_epoch(self.rounds, self.cfg.main_loop.extra_streams, self.times.round)
            self.epoch_data = {s: {} for s in self.streams}
        finally:
            self.training = training

    def _check_sync_batchnorm(self, plan: data.Plan) -> None:
        """Synchronised BatchNorm needs every rank in every forward: no empty shard may occur."""
        if not (
            self.cfg.parallel.sync_batchnorm and self.strategy.data_world_size > 1 and len(plan)
        ):
            return
        for k in {0, len(plan) - 1}:  # full batches all split alike; only the last may be short
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

    def _evaluation_epoch(
        self, epoch: int, streams: list[str], profile: dict | None = None
    ) -> None:
        """Evaluate `streams`, then end epoch `epoch` (or evaluation round) with its after_epoch
        events."""
        profile = dict(profile or {})
        self.times.new_round()
        self.epoch_data = self.epoch_data if epoch else {s: {} for s in self.streams}
        start = time.perf_counter()
        for name in streams:
            self.evaluate(name)
        profile["eval"] = time.perf_counter() - start
        self.profile["eval"] += profile["eval"]
        if epoch and self.engine.max_grad_norm is not None:  # the norms of the epoch's steps
            self.epoch_data.setdefault(TRAIN, {}).update(self.engine.norms.variables())
            self.engine.norms = GradNorms()
        start = time.perf_counter()
        stop = self._emit("after_epoch", epoch, self.epoch_data)
        profile["after_epoch"] = time.perf_counter() - start
        stop = (
            self._emit(
                "after_epoch_profile", epoch, profile, TRAIN, self.cfg.main_loop.extra_streams
            )
            or stop
        )
        self.metrics = flat_variables(self.epoch_data)
        if self.cfg.main_loop.eval_every_n_steps is None:
            self._trace("epoch", epoch=epoch, step=self.step, metrics=self.metrics)
        else:
            self._trace(
                "epoch", epoch=self.epoch, step=self.step, round=epoch, metrics=self.metrics
            )
        if stop is not None:
            raise stop
        if self.any_rank(self.stop.requested):
            raise _Interrupted

    def evaluate(self, name: str) -> None:
        """Run stream `name` through the model, every sample exactly once, calling after_batch."""
        stream = self.stream(name)
        batch_size = self.cfg.dataset.eval_batch_size or self.cfg.dataset.batch_size
        strategy, listeners = self.strategy, self._listeners["after_batch"]
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
            batches = ((step[0][0].global_size, step[0][1]) for _, step in steps)
        else:
            plan = data.Plan(
                range(len(stream)),
                batch_size,
                1,
                strategy.data_rank,
                strategy.data_world_size,
                self.shard_weights,
            )
            loaded = self._loader(
                stream, plan, 0, name=name, empty_batches=strategy.runs_empty_shards, key=key
            )
            batches = (
                (min(batch_size, len(stream) - k * batch_size), batch)
                for k, batch in enumerate(loaded)
            )
        for size, batch in batches:
            self.last_batch_size = size
            outputs = None if batch is None else self.eval_step(batch)
            stop = self._after_batch(listeners, name, [outputs])
            if stop is not None:
                raise stop

    def _after_batch(
        self, listeners: list[Hook], stream: str, parts: Sequence[dict | None]
    ) -> TrainingTerminated | None:
        """Call after_batch with this rank's data, or the gathered global batch for hooks that need
        it."""
        local = concat(parts)
        merged = (
            self.strategy.gather_outputs(list(parts), self._gather_keys)
            if self._gatherers and self.strategy.world_size > 1
            else local
        )
        stop = None
        for hook in listeners:
            view = merged if hook.gathers else local  # empty where this rank had no samples
            try:
                hook.after_batch(stream, view)
            except TrainingTerminated as t:
                stop = stop or t
        return stop

    def _first_samples(self, n: int) -> Mapping:
        """The training stream's first `n` samples (fewer where it is shorter), as one batch."""
        stream = data.get_stream(self.dataset, TRAIN)
        # read as evaluation reads them: LogThroughput reads this process's shard size of them, so
        # the trainer's own draws must not depend on the count
        key = seeding.stream_key(self.cfg.seed, TRAIN) if self.cfg.per_sample_random else None
        items = loading.first_items(stream, n, key)
        if not items:
            raise ConfigError("the training stream is empty: there is nothing to train on")
        keys = tuple(self.cfg.dataset.keys) if self.cfg.dataset.keys else None
        batch = loading.collate(items, TRAIN, keys)
        assert batch is not None  # items is not empty
        return batch

    # --- training driven from Python, epoch by epoch or step by step ----------------------------

    def begin_training(self) -> None:
        """Start the hooks, as run() does before its first step (before_training: writers open,
        trackers connect), for a loop of the caller's own over `train_epoch` or `train_step`; end it
        with `end_training`. A hook that stops training raises its TrainingTerminated here, once the
        later hooks have started too."""
        stop = self._emit("before_training")
        if stop is not None:
            raise stop

    def end_training(self, success: bool = True) -> bool:
        """End what `begin_training` started, as run() ends: the loader workers kept between epochs
        stop, the hooks' after_training runs (writers close, trackers say how it ended) and a
        checkpoint still being written in the background is waited for. Returns whether that
        checkpoint was committed."""
        return self._finish(success)

    def train_epoch(self, end: bool = True) -> None:
        """Train the next epoch as run() trains each: its steps from the cursor on, each followed by
        the after_batch hooks (and any evaluation round of main_loop.eval_every_n_steps), then its
        end: the extra streams evaluated and the after_epoch hooks called (metrics, checkpoints).
        `end=False` leaves that end out, the epoch still counted and its schedulers stepped: the
        step loop alone, as a benchmark measures it. A hook that stops training raises its
        TrainingTerminated."""
        self._train_epoch(end)

    def call_after_batch(
        self, stream: str, parts: Sequence[dict | None], *, training: bool
    ) -> None:
        """Call the after_batch hooks on a batch's outputs, as the loop does after each step: a
        training step's `Outcome.parts` with `training=True` (hooks that act on optimizer steps,
        such as the writers of the step loss, see one), or an evaluation batch's
        `[eval_step(batch)]` with `training=False`. Hooks that gather see the global batch. They
        read `step`, `last_loss` and `last_batch_size` as they stand: the caller's loop advances
        them. A hook that stops training raises its TrainingTerminated, once the later hooks have
        run."""
        was, self.training = self.training, training
        try:
            stop = self._after_batch(self._listeners["after_batch"], stream, parts)
        finally:
            self.training = was
        if stop is not None:
            raise stop

    def add_hook(self, hook: Hook) -> None:
        """Call `hook` at its events from now on, after the hooks the trainer was built with: a hook
        that the code driving a built trainer (a benchmark's timer, say) adds itself."""
        hook.attach(self.view)
        self.hooks.append(hook)
        for event in EVENTS:
            if hook.overrides(event):
                self._listeners[event].append(hook)
        self._gatherers, self._gather_keys = _gathering(self._listeners["after_batch"])

    def train_step(self, micros: Micros, stop: bool = False) -> Outcome:
        """One optimizer step over a global batch's fetched micro-batches (`stop`: this rank's wish
        to stop, agreed among ranks), as the strategy runs it; no hook is called."""
        self.engine.step = self.step
        return self.strategy.train_step(self.engine, micros, stop)

    def eval_step(self, batch: Mapping) -> dict:
        """The model's outputs on an evaluation batch (this process's shard), as the strategy runs
        it."""
        return self.strategy.evaluate(self.engine, batch)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank: decisions that end the loop are taken by all alike."""
        if self.strategy.world_size == 1:
            return flag
        return bool(
            self.strategy.reduce(torch.tensor([float(flag)], device=self.strategy.device), "max")
            > 0
        )

    def _emit(self, event: str, *args: Any) -> TrainingTerminated | None:
        """Call every hook on `event`; a hook that stops training lets the later ones run first."""
        stop = None
        for hook in self._listeners[event]:
            try:
                getattr(hook, event)(*args)
            except TrainingTerminated as t:
                stop = stop or t
        return stop


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


def _gathering(listeners: list[Hook]) -> tuple[list[Hook], set[str] | None]:
    """The after_batch hooks that see the gathered global batch, and the keys to gather: those they
    list, or all (None) where one lists none."""
    gatherers = [h for h in listeners if h.gathers]
    listed = [h.gather_keys for h in gatherers if h.gather_keys is not None]
    keys = {k for named in listed for k in named} if len(listed) == len(gatherers) else None
    return gatherers, keys
