"""The trainer: builds the parts a config names and runs the main loop, calling hooks at its events.

The loop is written once; how devices and processes are used is the strategy's business, reached
only through its protocol. The trainer holds its parts: the feed (`feed.Feed`: the data as the
loop takes it), the run state (`runstate.RunState`: counters and what a checkpoint holds), the
step losses (`losses.StepLosses`), the loop's times (`timeline.LoopTimes`) and the hooks' calls
(`hooks.calling.Calls`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from phalanx import logs, strategies, timeline
from phalanx.config import Config
from phalanx.data import TRAIN
from phalanx.errors import ConfigError, ModelError, lost_a_peer
from phalanx.feed import Ahead
from phalanx.hooks import build_hooks
from phalanx.hooks.base import Hook, TrainingTerminated
from phalanx.hooks.calling import Calls, standing
from phalanx.hooks.profiler import Profile
from phalanx.hooks.variables import flat_variables
from phalanx.losses import StepLosses
from phalanx.objects import Objects
from phalanx.parts import build_feed, build_parts
from phalanx.runstate import STREAM, HookStates, Part, RunState
from phalanx.signals import GracefulStop, Interrupted
from phalanx.strategies.base import Micros, Outcome, Strategy
from phalanx.view import RunView

log = logging.getLogger("phalanx")


class _Interrupted(Exception):
    pass


class Trainer:
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
        self.strategy = strategy = strategy or strategies.create(cfg)
        if strategy.serving:
            raise ConfigError(
                "this process serves the others (parallel.strategy=param_server, rank "
                f"{strategy.rank}): it trains nothing, so it builds no Trainer; build what it "
                "serves with phalanx.worker.build_server and call strategy.serve"
            )
        # loader workers kept between epochs; not for one evaluation (eval, predict), which
        # nothing would end
        self.feed = build_feed(cfg, self.search_dirs, strategy, objects, not inference)
        self.dataset = self.feed.dataset
        parts = build_parts(
            cfg, self.search_dirs, strategy, self.feed, objects.model, inference, run_dir
        )
        self.precision, self.keyed, self.engine = parts.precision, parts.keyed, parts.engine
        self.module, self.model, self.forward = parts.module, parts.model, parts.forward
        self.optimizer, self.schedulers = parts.optimizer, parts.schedulers
        self.epoch_data: dict[str, dict[str, Any]] = {}
        # the numbers of the last evaluation round, as "stream.variable"
        self.metrics: dict[str, float] = {}
        # seconds this process spent: waiting for data; forward and backward (with the all-reduce
        # that overlaps backward); communication after backward; the optimizer; hooks; evaluation
        self.times = timeline.LoopTimes(cuda=strategy.device.type == "cuda")
        self.profile = self.times.total
        self.losses = StepLosses()
        self.last_batch_size = 0
        # the first step's gradients are looked at once: a model whose loss reaches none of the
        # parameters the optimizer trains would otherwise train nothing, silently
        self._unchecked = strategy.local_gradients
        # True while after_batch follows an optimizer step (not an evaluation)
        self.training = False
        self.stop = GracefulStop()
        own = list(hooks) if hooks is not None else build_hooks(cfg, self.search_dirs)
        if cfg.profile is not None and hooks is None:
            own.append(
                Profile(cfg.profile.start_step, cfg.profile.steps, cfg.profile.record_shapes)
            )
        self.hooks = [*own, *objects.hooks]
        # what a checkpoint holds of the run beside the model: each part's state, by name
        held: dict[str, Part] = {"hooks": HookStates(self.hooks), STREAM: self.feed}
        held["grad_norms"] = self.engine.norms
        self.state = RunState(cfg, run_dir, self.search_dirs, strategy, parts, self.feed, held)
        self.checkpoints, self.background = self.state.checkpoints, self.state.background
        # what hooks see of the run
        self.view = RunView(self)
        # the steps done and whether training: a strategy names a hung rank's step by it, and one
        # whose processes do not step together (param_server) numbers its steps by it
        strategy.watch(lambda: (self.state.step, self.training))
        self.calls = Calls(self.hooks, self.view, strategy)

    # --- the run's counters and state, held by `state`

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.state.epoch = value

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def step_in_epoch(self) -> int:
        return self.state.step_in_epoch

    @property
    def rounds(self) -> int:
        return self.state.rounds

    @property
    def stored_checkpoints(self) -> Any:
        return self.state.stored_checkpoints

    def save_checkpoint(self, best: dict | None = None) -> Path | None:
        """Save the whole training state at the current step. Every rank calls it; rank 0 writes."""
        return self.state.save(best)

    def restore(self, step: int, weights_only: bool = False, previous: dict | None = None) -> None:
        """Continue from checkpoint `step` (see `RunState.restore`)."""
        self.state.restore(step, weights_only, previous)

    def initialise_from(self) -> None:
        """A new run's start from the weights `model.init_from` names."""
        self.state.initialise_from()

    def join(self, steps: int, epoch_open: bool) -> None:
        """Start where the servers are, in place of a worker that died (see `RunState.join`)."""
        self.state.join(steps, epoch_open)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank: decisions that end the loop are taken by all alike."""
        return self.state.any_rank(flag)

    @property
    def streams(self) -> list[str]:
        return self.feed.streams

    def stream(self, name: str) -> Any:
        """Stream `name` of the dataset, asked of `streams()` once."""
        return self.feed.stream(name)

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in an epoch; None for an iterable stream that does not say its length."""
        return self.feed.steps_per_epoch

    # --- the main loop -------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the configured epochs end or a hook stops; returns the process exit code."""
        with self.strategy.working():
            return self._run()

    def _run(self) -> int:
        state = self.state
        if state.step and state.epoch >= self.cfg.main_loop.epochs:
            # a finished run resumed as it was: nothing to train, so no hook starts (a writer's
            # new file, a checkpoint saved again) and the run's trace stays as it ended
            return 0
        self.stop.install()
        success, code, interrupted = True, 0, False
        state.trace("started", epoch=state.epoch, step=state.step)
        try:
            self.feed.open_streams()
            with self.stop.starting():
                stop = self.calls.emit("before_training")
            if stop is not None:
                raise stop
            # a user's hook's state that a checkpoint cannot hold is said now, not at the epoch's
            # end (the built-in hooks' are JSON; some combine theirs over the ranks to give it)
            HookStates([h for h in self.hooks if not _built_in(h)]).state_dict()
            if not self.cfg.main_loop.skip_zeroth_epoch and state.step == 0:
                self._evaluation_epoch(0, self.streams)
            every = self.cfg.main_loop.eval_every_n_steps
            # saved on a beat, before its round
            if every is not None and state.step // every > state.rounds:
                self._evaluation_round(every)
            while state.epoch < self.cfg.main_loop.epochs:
                self._train_epoch()
        except TrainingTerminated as stop:
            success, code = stop.success, 0 if stop.success else 1
            (log.info if success else log.error)("training stopped: %s", stop.reason)
        except _Interrupted:
            state.save()
            success, code, interrupted = False, self.stop.exit_code(), True
        # while the hooks started: nothing trained, nothing to save
        except Interrupted:
            log.warning("interrupted before the first step of this run")
            state.trace("interrupted", epoch=state.epoch, step=state.step, before_first_step=True)
            self._finish(False)
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            # a worker's guard logs its traceback; in the command's own process, the command
            # prints it, and the run's log keeps it too
            if not strategies.in_worker():
                logs.in_run_log_only(logging.ERROR, f"training failed at step {state.step}", True)
            # a consequence: another rank or machine ended first
            if lost_a_peer(error):
                state.trace("failed", step=state.step, error=error, cause="lost another rank")
            else:
                state.trace("failed", step=state.step, error=error)
            self._finish(False)
            raise
        # a resume that ended without a step (a hook stopped it at once): its overrides were taken
        state.keep_config()
        committed = self._finish(success)
        if interrupted and self.strategy.is_main:
            self._say_interrupted(committed)
        diverged = success and state.unsaved_step == state.step
        if diverged:
            if self.strategy.is_main:
                self._say_diverged()
            success, code = False, 1
        state.trace(
            "interrupted" if code > 128 else "finished" if success else "failed",
            epoch=state.epoch,
            step=state.step,
            **({"error": "the weights are not finite"} if diverged else {}),
        )
        return code

    def _say_diverged(self) -> None:
        """A run that trained to its end with weights that are not finite: its end was not saved,
        so it did not finish."""
        kept = self.state.stored_checkpoints.steps() if self.state.checkpoints else []
        log.error(
            "training diverged: the weights are not finite at the last step, %d, so the run's end "
            "is not saved (%s); lower the learning rate, clip the gradients "
            "(optimizer.max_grad_norm), or list StopOnNaN to stop at the first loss that is not "
            "finite",
            self.state.step,
            f"the last sound step saved is {kept[-1]}" if kept else "no step is saved",
        )

    def _say_interrupted(self, committed: bool) -> None:
        """Said once the step is committed, not before."""
        saved = "saved" if committed else "its checkpoint could not be written (see above)"
        if self.stop.reforming:
            log.info(
                "the job re-formed at step %d (%s); its workers start again from it",
                self.step,
                saved,
            )
        else:
            log.warning(
                "interrupted at step %d; %s. Continue with: phalanx resume %s",
                self.step,
                saved,
                self.run_dir,
            )

    def _finish(self, success: bool) -> bool:
        """End the run's parts; whether its last checkpoint was committed (a background write may
        still have been under way)."""
        self.stop.restore()
        self.feed.close()
        self.calls.emit("after_training", success)
        # the last checkpoint is committed before the run ends
        if self.background is not None:
            try:
                self.background.wait()
            # a failed run's own error is the one to raise
            except Exception as e:  # noqa: BLE001
                if success:
                    raise
                log.error("the last checkpoint could not be written: %s", e)
                return False
        return True

    def _train_epoch(self, end: bool = True) -> None:
        state = self.state
        epoch = state.epoch + 1
        self.epoch_data = {s: {} for s in self.streams}
        self.losses.begin_epoch()
        profile = self.times.begin_epoch()
        try:
            self._train_steps(self.feed.steps(epoch, state.step_in_epoch), profile)
        # also when a hook or a signal ends the epoch early
        finally:
            self.times.end_epoch(profile)
        state.epoch, state.step_in_epoch = epoch, 0
        self.engine.end_epoch()
        self.strategy.end_epoch()
        if not end:
            return
        every = self.cfg.main_loop.eval_every_n_steps
        if every is None:
            self._evaluation_epoch(epoch, self.cfg.main_loop.extra_streams, profile)
        # the end of training, off the beat
        elif state.epoch == self.cfg.main_loop.epochs and state.step % every:
            state.rounds = state.step // every + 1
            self._evaluation_epoch(state.rounds, self.cfg.main_loop.extra_streams, self.times.round)

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

    def _train_steps(self, steps: Iterator, profile: dict[str, float]) -> None:
        listeners = self.calls.listeners["after_batch"]
        clock, stop, state = time.perf_counter, self.stop, self.state
        # `train_step`'s two lines, without its frame on every step
        engine, strategy_step, losses = self.engine, self.strategy.train_step, self.losses
        every = self.cfg.main_loop.eval_every_n_steps
        device = self.times.device
        # seconds fetching, computing, communicating, optimizing and in hooks, since they were last
        # added to the epoch's `profile`
        live = self.times.begin_steps()
        # a resume's config, written once its first step and that step's hooks have gone through
        pending = state.config_pending
        self.strategy.agree_when(self.calls.loss_due(state, every, self.steps_per_epoch))
        ahead = Ahead(steps)
        self.strategy.meanwhile(ahead.fetch if self.feed.reads_ahead else None)
        self.training = True
        try:
            t0 = clock()
            # planning and fetching the step count as data time
            for k, fetched in ahead:
                t1 = clock()
                if device is not None:
                    device.begin()
                engine.step = state.step
                try:
                    result = strategy_step(engine, fetched, stop.requested)
                except RuntimeError as e:
                    refused = _not_differentiable(e)
                    if refused is None:
                        raise
                    raise refused from e
                if device is not None:
                    device.end()
                if self._unchecked:
                    self._check_gradients()
                losses.add(result.loss, result.settle, result.agreed)
                self.last_batch_size = fetched[0][0].global_size
                state.step, state.step_in_epoch = state.step + 1, k + 1
                t2 = clock()
                terminated = self.calls.after_batch(listeners, TRAIN, result.parts)
                t3 = clock()
                communication, optimizer = result.communication_s, result.optimizer_s
                # the next step's batch, where it was read during this one
                read_ahead, ahead.seconds = ahead.seconds, 0.0
                live[0] += t1 - t0 + read_ahead
                live[1] += t2 - t1 - communication - optimizer - read_ahead
                live[2] += communication
                live[3] += optimizer
                live[4] += t3 - t2
                if pending:
                    pending = False
                    state.keep_config()
                if terminated is not None:
                    raise terminated
                if result.stop:
                    raise _Interrupted
                # an evaluation round, inside the epoch
                if every is not None and state.step % every == 0:
                    self.times.add(profile)
                    self._evaluation_round(every)
                    t3 = clock()
                t0 = t3
        except (TrainingTerminated, _Interrupted):
            losses.settle()  # no agreement in flight outlives the steps
            raise
        except BaseException:
            # a failure's own error stands: what is in flight may never come (a link it closed),
            # and what is not sent yet no other process may come to
            self.strategy.agree_when(None, drop=True)
            with contextlib.suppress(Exception):
                losses.settle()
            raise
        else:
            losses.settle()
        finally:
            try:
                self.strategy.meanwhile(None)
                self.strategy.agree_when(None)  # (sent while the run says it trains)
                self.times.add(profile)
            finally:
                self.training = False

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

    @property
    def epoch_loss_so_far(self) -> torch.Tensor | None:
        """`epoch_loss` over the steps whose agreement has been sent (see `RunView`)."""
        return self.losses.epoch_mean(sent_only=True)

    # --- evaluation

    def _evaluation_round(self, every: int) -> None:
        """Evaluate the extra streams after every `main_loop.eval_every_n_steps` (`every`) optimizer
        steps, and end an evaluation round: the after_epoch events, with the round's number
        (steps // N) as their epoch, and the training variables of the steps since the last
        round."""
        training, self.training = self.training, False
        self.state.rounds = self.step // every
        try:
            self._evaluation_epoch(self.rounds, self.cfg.main_loop.extra_streams, self.times.round)
            self.epoch_data = {s: {} for s in self.streams}
        finally:
            self.training = training

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
        # the norms of the epoch's steps
        if epoch and self.engine.max_grad_norm is not None:
            self.epoch_data.setdefault(TRAIN, {}).update(self.engine.norms.variables())
            self.engine.norms.reset()
        start = time.perf_counter()
        stop = self.calls.emit("after_epoch", epoch, self.epoch_data)
        profile["after_epoch"] = time.perf_counter() - start
        extra = self.cfg.main_loop.extra_streams
        stop = standing(stop, self.calls.emit("after_epoch_profile", epoch, profile, TRAIN, extra))
        self.metrics = flat_variables(self.epoch_data)
        if self.cfg.main_loop.eval_every_n_steps is None:
            self.state.trace("epoch", epoch=epoch, step=self.step, metrics=self.metrics)
        else:
            self.state.trace(
                "epoch", epoch=self.epoch, step=self.step, round=epoch, metrics=self.metrics
            )
        if stop is not None:
            raise stop
        if self.any_rank(self.stop.requested):
            raise _Interrupted

    def evaluate(self, name: str) -> None:
        """Run stream `name` through the model, every sample exactly once, calling after_batch."""
        listeners = self.calls.listeners["after_batch"]
        for size, batch in self.feed.eval_batches(name):
            self.last_batch_size = size
            outputs = None if batch is None else self.eval_step(batch)
            stop = self.calls.after_batch(listeners, name, [outputs])
            if stop is not None:
                raise stop

    # --- training driven from Python, epoch by epoch or step by step ----------------------------

    def begin_training(self) -> None:
        """Start the hooks, as run() does before its first step (before_training: writers open,
        trackers connect), for a loop of the caller's own over `train_epoch` or `train_step`; end it
        with `end_training`. A hook that stops training raises its TrainingTerminated here, once the
        later hooks have started too."""
        self.feed.open_streams()
        stop = self.calls.emit("before_training")
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
            stop = self.calls.after_batch(self.calls.listeners["after_batch"], stream, parts)
        finally:
            self.training = was
        if stop is not None:
            raise stop

    def add_hook(self, hook: Hook) -> None:
        """Call `hook` at its events from now on, after the hooks the trainer was built with: a hook
        that the code driving a built trainer (a benchmark's timer, say) adds itself."""
        self.calls.add(hook)

    def train_step(self, micros: Micros, stop: bool = False, read: bool = True) -> Outcome:
        """One optimizer step over a global batch's fetched micro-batches (`stop`: this rank's wish
        to stop, agreed among ranks), as the strategy runs it; no hook is called. Where the
        outcome's `settle` is set (fsdp, mesh, pipeline), its `loss` holds the global loss only
        once `settle()` has returned, and its `stop` comes from the step before's agreement.

        `read=False`: the caller will not read this step's loss before a later step that it does
        read (every process alike). The pipeline then sends this step's agreement with the next
        steps', up to `parallel.pipeline.agree_every` of them, in one message, and its `stop`
        comes from the window of steps before; the outcome's `agreed` is False until a step sends
        the window, and `settle()` on a step not sent sends it (a collective: on every process at
        the same step)."""
        self.engine.step = self.state.step
        self.strategy.agree_when(_read if read else _unread)
        return self.strategy.train_step(self.engine, micros, stop)

    def eval_step(self, batch: Mapping) -> dict:
        """The model's outputs on an evaluation batch (this process's shard), as the strategy runs
        it."""
        return self.strategy.evaluate(self.engine, batch)


def _read() -> bool:
    return True


def _unread() -> bool:
    return False


def _built_in(hook: Hook) -> bool:
    return type(hook).__module__.startswith("phalanx.")


def _not_differentiable(error: RuntimeError) -> ModelError | None:
    """The error to give where backward found a loss that autograd does not track (a loss
    detached, or computed under no_grad, or of no parameter's): else None."""
    if "does not require grad" not in str(error):
        return None
    return ModelError(
        "the loss does not depend on anything autograd tracks, so backward has nothing to "
        "differentiate: compute it from the model's outputs in forward, not from tensors detached "
        "from them (.detach(), .item(), numpy) nor under torch.no_grad()"
    )
