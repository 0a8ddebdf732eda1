"""The run's state in and out of checkpoints: the trainer's counters, random generators, sample
order and hooks' state (`state_dict`), a step saved (`save_checkpoint`) and restored (`restore`), a
new run's start from trained weights (`initialise_from`). A part of the trainer (`Trainer` takes it
in), kept apart from the main loop; the layouts on disk are `checkpoint`'s, how each process holds
the model is the strategy's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
from phalanx.data import TRAIN
from phalanx.engine import Engine
from phalanx.errors import CheckpointError, CheckpointMismatch
from phalanx.hooks.base import Hook
from phalanx.precision import Precision
from phalanx.strategies.base import RandomStreams, Serves, Strategy

log = logging.getLogger("phalanx")


class Checkpointing:
    """What the trainer's state needs of the trainer: its parts and counters, set by `Trainer`."""

    cfg: Config
    run_dir: Path | None
    search_dirs: list[Path]
    strategy: Strategy
    model: nn.Module
    precision: Precision
    engine: Engine
    schedulers: list
    hooks: list[Hook]
    checkpoints: Checkpoints | None
    background: Background | None
    epoch: int
    step: int
    step_in_epoch: int
    rounds: int
    order: str
    _positioned: bool  # an iterable training stream restored its own position from a checkpoint
    _warned_position: bool

    def stream(self, name: str) -> Any:
        raise NotImplementedError  # the trainer's

    @property
    def steps_per_epoch(self) -> int | None:
        raise NotImplementedError  # the trainer's

    def any_rank(self, flag: bool) -> bool:
        raise NotImplementedError  # the trainer's

    def _trace(self, event: str, **fields: Any) -> None:
        if self.run_dir is not None and self.strategy.is_main:
            rundir.trace(self.run_dir, event, **fields)

    @property
    def stored_checkpoints(self) -> Checkpoints:
        """The run's checkpoints; a trainer without a run directory has none."""
        if self.checkpoints is None:
            raise RuntimeError("this trainer has no run directory, so no checkpoints to read")
        return self.checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Trainer state as JSON: counters, the sampler cursor, every RNG of every rank and the
        hooks' state. Every rank calls it: the RNG states are gathered, and hooks combine their
        running values across ranks."""
        rng = rng_state()
        if isinstance(self.strategy, RandomStreams):
            rng["devices"] = self.strategy.stream_states()
        state = {
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "batch_size": self.cfg.dataset.batch_size,
            "seed": self.cfg.seed,
            "order": self.order,
            "rounds": self.rounds,
            "rng": rng,
            "hooks": {_hook_key(i, h): h.state_dict() for i, h in enumerate(self.hooks)},
            "grad_norms": self.engine.norms.state_dict(),
        }
        position = self._stream_position()
        if position is not None:
            state["stream"] = position
        if self.strategy.world_size > 1:
            state["rng_ranks"] = self.strategy.gather(rng)
        return state

    def initialise_from(self) -> None:
        """A new run's start from the trained weights `model.init_from` names (every rank reads
        them; a sharded model keeps its shards of them). Not on resume: the checkpoint holds the
        weights."""
        spec = self.cfg.model.init_from
        if spec is None:
            return
        path, state = initial_weights(spec.path, spec.checkpoint)
        try:  # each process keeps its part: a replica, its shards, its stages
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

    def _stream_position(self) -> Any:
        """Where an iterable training stream that can say so stands (`state_dict()`, as JSON)."""
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

    def save_checkpoint(self, best: dict | None = None) -> Path | None:
        """Save the whole training state at the current step. Every rank calls it; rank 0 writes."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            return None
        optimizer = self.engine.trained_optimizer
        # a diverged run's weights: a resume would only diverge again, and retention would drop the
        # last sound steps for them
        if self.any_rank(not finite_weights(optimizer)):
            if self.strategy.is_main:
                kept = checkpoints.steps()
                log.error(
                    "the weights are not finite at step %d: it is not saved; %s",
                    self.step,
                    f"a resume goes on from step {kept[-1]}" if kept else "no step is saved yet",
                )
            return None
        state = self.state_dict()  # on every rank: hooks combine their running values across ranks
        rest = {
            "schedulers": [s.state_dict() for s, _ in self.schedulers],
            "scaler": self.precision.state_dict(),
        }
        path = checkpoints.save_state(
            self.step, self.strategy, optimizer, rest, state, best, self.background
        )
        if path is not None and self.background is None:  # the writer's thread traces its own
            self._trace("checkpoint", step=self.step, best=best is not None)
        return path

    def join(self, steps: int, epoch_open: bool) -> None:
        """Start where the servers of a run whose other workers go on are: `steps` applied, and
        `epoch_open` where the epoch they complete has still to end (its evaluation and hooks).
        The model comes from the servers at the first step; the schedulers step to where theirs
        are."""
        per_epoch = self.steps_per_epoch
        assert per_epoch  # param_server refuses a stream of unknown length
        epochs, into = divmod(steps, per_epoch)
        if epoch_open and steps and not into:  # the epoch's steps are done, its end is not
            epochs, into = epochs - 1, per_epoch
        self.epoch, self.step, self.step_in_epoch = epochs, steps, into
        for _ in range(steps):
            self.engine.step_schedulers()
        for _ in range(epochs):
            self.engine.end_epoch()

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
        if not finite_weights(optimizer):  # this process's part; the caller agrees over the ranks
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
        # step_in_epoch = steps_per_epoch: saved after the epoch's last step, before its end (its
        # evaluation)
        if self.steps_per_epoch is not None and state["step_in_epoch"] > self.steps_per_epoch:
            raise CheckpointError(
                f"{path} says step {state['step_in_epoch']} of an epoch that has "
                f"{self.steps_per_epoch} steps; the checkpoint is damaged or of another dataset"
            )
        self.epoch, self.step, self.step_in_epoch = (
            state["epoch"],
            state["step"],
            state["step_in_epoch"],
        )
        self.rounds = state.get("rounds", 0)
        self.order = state.get(
            "order", data.RANDPERM
        )  # checkpoints that name none predate the Feistel order
        if self.order not in data.ORDERS:
            raise CheckpointError(
                f"{path} names the sample order {self.order!r}, which this version of phalanx does "
                f"not know (it knows {', '.join(data.ORDERS)}); resume it with the version that "
                "saved it"
            )
        if self.order != data.FEISTEL and self.strategy.is_main:
            log.info(
                "this run keeps the sample order it started with (%s, from an older version of "
                "phalanx)",
                self.order,
            )
        settings, schedules = (
            self._replayed_schedule()
            if resuming.affects_schedule(changed)
            else (None, optimizer_state["schedulers"])
        )
        try:
            if optimizer_state["optimizer"] is not None:
                self.strategy.load_optimizer_state(optimizer, optimizer_state["optimizer"])
            for group, new in zip(
                optimizer.param_groups, settings or [], strict=settings is not None
            ):
                group.update(
                    new
                )  # the new settings at this step, over the saved moments and counts
            for (scheduler, _), saved in zip(self.schedulers, schedules, strict=True):
                scheduler.load_state_dict(saved)
            self.precision.load_state_dict(optimizer_state["scaler"])
            self._restore_rng(state)
            self._restore_hooks(state["hooks"], step)
            if "grad_norms" in state:
                self.engine.norms.load_state_dict(state["grad_norms"])
            if (
                "stream" in state and state["step_in_epoch"]
            ):  # the iterable stream goes on from where it stood
                self.stream(TRAIN).load_state_dict(state["stream"])
                self._positioned = True
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError) as e:
            raise CheckpointError(
                f"{path.parent} does not fit this run ({type(e).__name__}: {e}); the checkpoint "
                "is damaged or was saved from another config"
            ) from None

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
        )
        schedulers = build_schedulers(self.cfg, optimizer, self.search_dirs, self.steps_per_epoch)
        resuming.replay_schedule(schedulers, self.step, self.epoch, self.steps_per_epoch)
        settings = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        return settings, [scheduler.state_dict() for scheduler, _ in schedulers]

    def _restore_rng(self, state: dict[str, Any]) -> None:
        """Each rank's own random streams where the process count is the checkpoint's; on another
        count, streams re-derived from the seed, the step and the rank."""
        saved = state.get("rng_ranks") or [state["rng"]]
        rank, world_size = self.strategy.rank, self.strategy.world_size
        if isinstance(self.strategy, Serves):  # the workers' streams alone were saved
            world_size = self.strategy.data_world_size
            if self.strategy.serving:  # a server draws nothing
                seed_everything(derived_seed(self.cfg.seed, self.step, rank))
                return
        if len(saved) == world_size:
            set_rng_state(saved[rank])
            self._restore_streams(saved[rank].get("devices"))
            return
        seed_everything(derived_seed(self.cfg.seed, self.step, rank))
        self._restore_streams(None)
        if self.strategy.is_main:
            log.info(
                "random streams re-derived from the seed, the step and the rank: the checkpoint "
                "was saved by %d process(es), this run has %d",
                len(saved),
                world_size,
            )

    def _restore_streams(self, states: list[str] | None) -> None:
        """Towers' own streams, after the process's (which set every CUDA device's generator)."""
        if isinstance(self.strategy, RandomStreams):
            self.strategy.load_stream_states(states, self.cfg.seed, self.step)

    def _restore_hooks(self, saved_hooks: dict[str, Any], step: int) -> None:
        for i, hook in enumerate(self.hooks):
            key = _hook_key(i, hook)
            if key in saved_hooks:
                hook.load_state_dict(saved_hooks[key])
            else:
                log.warning("hook %s has no saved state in step-%d; it starts afresh", key, step)


def finite_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this process's part of the trained weights (a DTensor's shard) is finite: one
    read-back for each device that holds some."""
    found: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this process's shard
            if local.is_floating_point() or local.is_complex():
                found.setdefault(local.device, []).append(torch.isfinite(local).all())
    return all(bool(torch.stack(flags).all()) for flags in found.values())


def _hook_key(index: int, hook: Hook) -> str:
    return f"{index}:{type(hook).__name__}"
