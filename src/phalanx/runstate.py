"""The run's state: its counters and the parts a checkpoint holds, saved (`save`) and restored
(`restore`) by this one owner; a new run's start from trained weights (`initialise_from`), and a
rejoining worker's start where the others are (`join`).

The parts: the model and the optimizer (held by the strategy, written by the checkpoint store), the
schedulers and the gradient scaler, the gradient norms, the hooks' state, the feed's position in an
iterable stream, and the random streams (the process's, and the strategy's own where it keeps some,
`Strategy.stream_states`). The layouts on disk are `checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from phalanx import data, resuming, rundir
from phalanx.background import Background
from phalanx.build import (
    build_optimizer,
    build_schedulers,
    derived_seed,
    rng_state,
    seed_everything,
    set_rng_state,
)
from phalanx.checkpoint import Checkpoints, initial_weights
from phalanx.config import Config
from phalanx.config import dump as config_dump
from phalanx.errors import CheckpointError, CheckpointMismatch, ModelError
from phalanx.feed import Feed
from phalanx.files import write_text_atomic
from phalanx.hooks.base import Hook
from phalanx.parts import ModelParts
from phalanx.strategies.base import Strategy

log = logging.getLogger("phalanx")


class Part(Protocol):
    """What a checkpoint holds of a part of the run: its state as JSON, and back."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def _check_json(hook: str, state: Any) -> None:
    """A hook's state is what JSON holds (a checkpoint keeps it as JSON): else one error naming the
    hook and the value, before anything of the step is written."""
    try:
        json.dumps(state, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ModelError(
            f"hook {hook}'s state_dict() holds what JSON cannot: {e}; a hook's state is saved as "
            "JSON: numbers, strings, lists and dicts with string keys (a tensor's .item() or "
            ".tolist())"
        ) from None


class HookStates:
    """The hooks' state, each under its place and class; a hook that the checkpoint lacks starts
    afresh, with a warning."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for i, hook in enumerate(self.hooks):
            state = states[_hook_key(i, hook)] = hook.state_dict()
            _check_json(type(hook).__name__, state)
        return states

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for i, hook in enumerate(self.hooks):
            key = _hook_key(i, hook)
            if key in saved:
                hook.load_state_dict(saved[key])
            else:
                log.warning("hook %s has no saved state in the checkpoint; it starts afresh", key)


class RunState:
    """The counters of a run (epochs and steps done, the step within the epoch, evaluation rounds
    begun) and its checkpointable parts. `parts`: name -> part, each saved in the step's trainer
    state under its name (an iterable stream's position, the hooks', the gradient norms')."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None,
        search_dirs: list[Path],
        strategy: Strategy,
        model: ModelParts,
        feed: Feed,
        parts: dict[str, Part],
    ):
        """`model`: the model, its optimizer (through the strategy), schedulers and scaler."""
        self.cfg, self.run_dir, self.search_dirs = cfg, run_dir, search_dirs
        self.strategy, self.model, self.engine = strategy, model.model, model.engine
        self.schedulers, self.precision, self.feed = model.schedulers, model.precision, feed
        self.parts = parts
        self.epoch, self.step, self.step_in_epoch = 0, 0, 0
        # evaluation rounds begun, with main_loop.eval_every_n_steps
        self.rounds = 0
        # the step whose weights were not finite, and so not saved, last (None: none was refused)
        self.unsaved_step: int | None = None
        # a resume's config with its overrides, written once the resume is sure to go on
        # (`keep_config`)
        self._config_to_keep: tuple[Config, list[str]] | None = None
        self.checkpoints = (
            Checkpoints(run_dir / "checkpoints", cfg.checkpoints.keep_last) if run_dir else None
        )
        # checkpoints.async: a writer thread on the main process, where the whole state is saved
        self.background = (
            Background.for_run(
                self.checkpoints,
                strategy,
                lambda step, best: self.trace("checkpoint", step=step, best=best),
            )
            if cfg.checkpoints.async_ and self.checkpoints is not None
            else None
        )

    @property
    def steps_per_epoch(self) -> int | None:
        return self.feed.steps_per_epoch

    def trace(self, event: str, **fields: Any) -> None:
        """An event of the run, in its trace (on the main process)."""
        if self.run_dir is not None and self.strategy.is_main:
            rundir.trace(self.run_dir, event, **fields)

    def keep_config_later(self, cfg: Config, overrides: list[str]) -> None:
        """Write `cfg`, a resume's config with its `overrides`, into the run directory once the
        resume is sure to go on (`keep_config`), not before: a resume refused for its overrides
        (a hook's check before the first step, a name the first batch lacks) leaves the run's
        config as it was, so the next resume starts from it."""
        self._config_to_keep = (cfg, overrides)

    @property
    def config_pending(self) -> bool:
        """Whether a resume's config waits to be written (`keep_config_later`)."""
        return self._config_to_keep is not None

    def keep_config(self) -> None:
        """The config `keep_config_later` holds, written (on the main process): after the resume's
        first step, before its first checkpoint, or when it ends without a step."""
        if self._config_to_keep is None:
            return
        cfg, overrides = self._config_to_keep
        self._config_to_keep = None
        if self.run_dir is not None and self.strategy.is_main:
            write_text_atomic(self.run_dir / rundir.CONFIG, config_dump(rundir.resolved(cfg)))
            rundir.trace(self.run_dir, "overrides", values=overrides)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank: decisions that end the loop are taken by all alike."""
        if self.strategy.world_size == 1:
            return flag
        flags = torch.tensor([float(flag)], device=self.strategy.device)
        return bool(self.strategy.reduce(flags, "max") > 0)

    @property
    def stored_checkpoints(self) -> Checkpoints:
        """The run's checkpoints; a trainer without a run directory has none."""
        if self.checkpoints is None:
            raise RuntimeError("this trainer has no run directory, so no checkpoints to read")
        return self.checkpoints

    # --- saving

    def state_dict(self) -> dict[str, Any]:
        """The run's state as JSON: counters, the sample order, every rank's random streams and the
        parts'. Every rank calls it: the random states are gathered, and hooks combine their
        running values across ranks."""
        rng = rng_state()
        devices = self.strategy.stream_states()
        if devices is not None:
            rng["devices"] = devices
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "batch_size": self.cfg.dataset.batch_size,
            "seed": self.cfg.seed,
            "order": self.feed.order,
            "rounds": self.rounds,
            "rng": rng,
        }
        for name, part in self.parts.items():
            saved = part.state_dict()
            if saved is not None:
                state[name] = saved
        if self.strategy.world_size > 1:
            state["rng_ranks"] = self.strategy.gather(rng)
        return state

    def save(self, best: dict | None = None) -> Path | None:
        """Save the whole training state at the current step. Every rank calls it; rank 0 writes."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            return None
        self.strategy.meet("save_checkpoint", self.step)
        # the step is this config's
        self.keep_config()
        optimizer = self.engine.trained_optimizer
        # a diverged run's weights: a resume would only diverge again, and retention would drop the
        # last sound steps for them
        if self.any_rank(not finite_weights(optimizer)):
            # said once a step, however many hooks save it
            if self.strategy.is_main and self.unsaved_step != self.step:
                kept = checkpoints.steps()
                log.error(
                    "the weights are not finite at step %d: it is not saved; %s",
                    self.step,
                    f"a resume goes on from step {kept[-1]}" if kept else "no step is saved yet",
                )
            self.unsaved_step = self.step
            return None
        # on every rank: hooks combine their running values across ranks
        state = self.state_dict()
        rest = {
            "schedulers": [s.state_dict() for s, _ in self.schedulers],
            "scaler": self.precision.state_dict(),
        }
        path = checkpoints.save_state(
            self.step, self.strategy, optimizer, rest, state, best, self.background
        )
        # the writer's thread traces its own
        if path is not None and self.background is None:
            self.trace("checkpoint", step=self.step, best=best is not None)
        return path

    # --- starting

    def initialise_from(self) -> None:
        """A new run's start from the trained weights `model.init_from` names (every rank reads
        them; a sharded model keeps its shards of them). Not on resume: the checkpoint holds the
        weights."""
        spec = self.cfg.model.init_from
        if spec is None:
            return
        path, state = initial_weights(spec.path, spec.checkpoint)
        # each process keeps its part: a replica, its shards, its stages
        try:
            missing, unexpected = self.strategy.load_state(state)
        except (RuntimeError, ValueError, KeyError) as e:
            lines = " ".join(str(e).split())
            raise CheckpointMismatch(
                f"model.init_from: {path} does not fit this model ({lines[:400]})"
            ) from None
        listed = "; ".join(
            f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''} ({len(keys)})"
            for what, keys in (("the weights lack", missing), ("the model lacks", unexpected))
            if keys
        )
        if listed and spec.strict:
            raise CheckpointMismatch(
                f"model.init_from: {path} does not hold this model's weights ({listed}); set "
                "model.init_from.strict: false to start the missing ones from their initial "
                "values and ignore the others"
            )
        if self.strategy.is_main:
            log.info(
                "weights from %s: %d tensors%s; the optimizer starts afresh",
                path,
                len(state) - len(unexpected),
                f" ({listed})" if listed else "",
            )

    def join(self, steps: int, epoch_open: bool) -> None:
        """Start where the servers of a run whose other workers go on are: `steps` applied, and
        `epoch_open` where the epoch they complete has still to end (its evaluation and hooks).
        The model comes from the servers at the first step; the schedulers step to where theirs
        are."""
        per_epoch = self.steps_per_epoch
        assert per_epoch  # param_server refuses a stream of unknown length
        epochs, into = divmod(steps, per_epoch)
        # the epoch's steps are done, its end is not
        if epoch_open and steps and not into:
            epochs, into = epochs - 1, per_epoch
        self.epoch, self.step, self.step_in_epoch = epochs, steps, into
        for _ in range(steps):
            self.engine.step_schedulers()
        for _ in range(epochs):
            self.engine.end_epoch()

    # --- restoring

    def restore(self, step: int, weights_only: bool = False, previous: dict | None = None) -> None:
        """Continue from checkpoint `step`: weights, and unless `weights_only`, everything else.
        `previous`: the run's resolved config before this resume's overrides, which are checked
        against the checkpoint and, where they change the optimizer or the schedule, applied."""
        checkpoints = self.stored_checkpoints
        if weights_only:
            checkpoints.load_weights(step, self.strategy.load_model_state)
            return
        optimizer = self.engine.trained_optimizer
        path = checkpoints.path(step) / "trainer.json"
        # a sharded step's optimizer state is in its shards, loaded with the model's
        optimizer_state, state = checkpoints.load(
            step, lambda weights: self.strategy.load_model_state(weights, optimizer)
        )
        # this process's part; the caller agrees over the ranks
        if not finite_weights(optimizer):
            raise CheckpointError(
                f"{path.parent} holds weights that are not finite (the run had diverged by then); "
                "a resume from it would diverge again"
            )
        changed = (
            resuming.changed_keys(previous, rundir.resolved(self.cfg))
            if previous is not None
            else {}
        )
        resuming.check(changed, state, self.cfg.dataset.batch_size)
        self._restore_counters(state, path)
        settings, schedules = (
            self._replayed_schedule()
            if resuming.affects_schedule(changed)
            else (None, optimizer_state["schedulers"])
        )
        try:
            if optimizer_state["optimizer"] is not None:
                self.strategy.load_optimizer_state(optimizer, optimizer_state["optimizer"])
            # the new settings at this step, over the saved moments and counts
            for group, new in zip(
                optimizer.param_groups, settings or [], strict=settings is not None
            ):
                group.update(new)
            for (scheduler, _), saved in zip(self.schedulers, schedules, strict=True):
                scheduler.load_state_dict(saved)
            self.precision.load_state_dict(optimizer_state["scaler"])
            self._restore_rng(state)
            self._restore_parts(state)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError) as e:
            raise CheckpointError(
                f"{path.parent} does not fit this run ({type(e).__name__}: {e}); the checkpoint "
                "is damaged or was saved from another config"
            ) from None

    def _restore_counters(self, state: dict[str, Any], path: Path) -> None:
        # step_in_epoch = steps_per_epoch: saved after the epoch's last step, before its end (its
        # evaluation)
        per_epoch = self.steps_per_epoch
        if per_epoch is not None and state["step_in_epoch"] > per_epoch:
            raise CheckpointError(
                f"{path} says step {state['step_in_epoch']} of an epoch that has "
                f"{per_epoch} steps; the checkpoint is damaged or of another dataset"
            )
        self.epoch, self.step = state["epoch"], state["step"]
        self.step_in_epoch = state["step_in_epoch"]
        self.rounds = state.get("rounds", 0)
        # checkpoints that name none predate the Feistel order
        order = state.get("order", data.RANDPERM)
        if order not in data.ORDERS:
            raise CheckpointError(
                f"{path} names the sample order {order!r}, which this version of phalanx does "
                f"not know (it knows {', '.join(data.ORDERS)}); resume it with the version that "
                "saved it"
            )
        self.feed.order = order
        if order != data.FEISTEL and self.strategy.is_main:
            log.info(
                "this run keeps the sample order it started with (%s, from an older version of "
                "phalanx)",
                order,
            )

    def _restore_parts(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            # an iterable stream's position at an epoch's end: the next epoch starts it afresh
            if name == STREAM and not state["step_in_epoch"]:
                continue
            if name in state:
                part.load_state_dict(state[name])

    def _replayed_schedule(self) -> tuple[list[dict], list[dict]]:
        """The optimizer's settings and the schedulers' states that the config gives at this step: a
        fresh optimizer and schedulers, built from the config and stepped as far as training
        went."""
        optimizer = build_optimizer(
            self.cfg.optimizer,
            self.model,
            self.search_dirs,
            self.cfg.dataset.batch_size,
            fused=self.strategy.device.type == "cuda",
            scaled=self.cfg.precision == "fp16",
        )
        per_epoch = self.steps_per_epoch
        schedulers = build_schedulers(self.cfg, optimizer, self.search_dirs, per_epoch)
        resuming.replay_schedule(schedulers, self.step, self.epoch, per_epoch)
        settings = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        return settings, [scheduler.state_dict() for scheduler, _ in schedulers]

    def _restore_rng(self, state: dict[str, Any]) -> None:
        """Each rank's own random streams where the process count is the checkpoint's; on another
        count, streams re-derived from the seed, the step and the rank."""
        saved = state.get("rng_ranks") or [state["rng"]]
        strategy, seed = self.strategy, self.cfg.seed
        rank, world_size = strategy.rank, strategy.random_processes
        # a process that serves the others draws nothing
        if strategy.serving:
            seed_everything(derived_seed(seed, self.step, rank))
            return
        if len(saved) == world_size:
            set_rng_state(saved[rank])
            strategy.load_stream_states(saved[rank].get("devices"), seed, self.step)
            return
        seed_everything(derived_seed(seed, self.step, rank))
        strategy.load_stream_states(None, seed, self.step)
        if strategy.is_main:
            log.info(
                "random streams re-derived from the seed, the step and the rank: the checkpoint "
                "was saved by %d process(es), this run has %d",
                len(saved),
                world_size,
            )


# the name of the feed's part: an iterable training stream's position
STREAM = "stream"


def finite_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this process's part of the trained weights (a DTensor's shard) is finite: one
    read-back for each device that holds some."""
    found: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            # a DTensor: this process's shard
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point() or local.is_complex():
                found.setdefault(local.device, []).append(torch.isfinite(local).all())
    return all(bool(torch.stack(flags).all()) for flags in found.values())


def _hook_key(index: int, hook: Hook) -> str:
    return f"{index}:{type(hook).__name__}"
