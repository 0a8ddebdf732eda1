"""The hook protocol: objects called at the main loop's events, in the order the config lists them.

Events follow emloop: `before_training`, `after_batch` (after every batch of every stream),
`after_epoch` (with the epoch's shared dict, `epoch_data[stream][variable]`, which hooks fill and
read in order), `after_epoch_profile` (where the epoch's time went) and `after_training`.
A hook stops training by raising `TrainingTerminated`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from phalanx.strategies.base import Strategy
from phalanx.strategies.single import Single
from phalanx.view import RunView

_ONE_PROCESS = Single(torch.device("cpu"))


class TrainingTerminated(Exception):
    """Raised by a hook to end training; `success=False` marks the run failed."""

    def __init__(self, reason: str, success: bool = True):
        super().__init__(reason)
        self.reason, self.success = reason, success


class Hook:
    """Base of every hook. Override the events you need; the others cost nothing."""

    # the run, read-only: its state, its strategy's collectives, save_checkpoint, any_rank
    trainer: RunView

    #: Whether `after_batch` needs the global batch. With several processes such a hook receives
    # : every rank's data gathered in dataset order (only the `gather_keys`, if given), on every
    # rank.
    #: A hook that reduces its own sums across ranks sets it False and receives this rank's shard.
    gathers: bool = True
    gather_keys: tuple[str, ...] | None = None
    #: Whether its `after_epoch` only reads the epoch's data (writers, savers, stoppers): it puts
    # : no variable there (see `computes`).
    reads_epoch_only: bool = False

    @property
    def strategy(self) -> Strategy:
        """The trainer's strategy, for hooks that combine values across ranks; one process if
        unattached."""
        trainer = getattr(self, "trainer", None)
        return trainer.strategy if trainer is not None else _ONE_PROCESS

    def attach(self, run: RunView) -> None:
        """Called once, before any event, with a view of the run the hook serves."""
        self.trainer = run

    def before_training(self) -> None:
        pass

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        pass

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        pass

    def after_epoch_profile(
        self, epoch: int, profile: dict[str, float], train_stream: str, extra_streams: list[str]
    ) -> None:
        pass

    def after_training(self, success: bool) -> None:
        pass

    def reads_loss(self, step: int) -> bool:
        """Whether `after_batch` reads the training loss (`last_loss`, `epoch_loss`) after optimizer
        step `step`, the same on every process. The pipeline sends the processes' agreements on
        several steps' losses as one message; a step whose loss a hook reads ends such a window at
        once, so that the hook sees the loss one process would. Every step, unless the hook says
        otherwise (`reads_no_loss`, or the steps it reads at)."""
        return True

    def computes(self, stream: str) -> Collection[str] | None:
        """The variables this hook puts into `epoch_data[stream]` in `after_epoch`, so that a hook
        listed after it can check the name it reads before training, not after the first epoch;
        None where it cannot say (the default for a hook with an after_epoch of its own: override
        this to have such names checked)."""
        if self.reads_epoch_only or not self.overrides("after_epoch"):
            return ()
        return None

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state saved in checkpoints (best value so far, running sums ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def overrides(self, event: str) -> bool:
        """Whether this hook implements `event` (the loop skips the others)."""
        return getattr(type(self), event) is not getattr(Hook, event)


def reads_no_loss(hook: Hook, step: int) -> bool:
    """`Hook.reads_loss` of a hook whose after_batch never reads the training loss."""
    return False


def loss_reads(hook: Hook) -> Callable[[int], bool] | None:
    """At which steps `hook`'s after_batch reads the loss (None: never). What a class says holds
    for its own after_batch: a subclass that brings an after_batch of its own and says nothing
    reads it at every step."""
    mro = type(hook).__mro__
    said = next(c for c in mro if "reads_loss" in c.__dict__)
    listens = next(c for c in mro if "after_batch" in c.__dict__)
    if listens is not said and issubclass(listens, said):
        return Hook.reads_loss.__get__(hook)
    return None if type(hook).reads_loss is reads_no_loss else hook.reads_loss
