"""Stopping hooks: StopAfter, StopOnNaN, StopOnPlateau."""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.errors import ConfigError
from phalanx.hooks.base import Hook, TrainingTerminated, reads_no_loss
from phalanx.hooks.variables import (
    check_computed,
    check_mode,
    improved,
    lookup,
    saved,
    split_name,
)
from phalanx.overrides import name_of

if TYPE_CHECKING:
    from phalanx.losses import Later

log = logging.getLogger("phalanx")


class StopAfter(Hook):
    """Stop after `epochs` epochs, `steps` optimizer steps or `minutes` of training, whichever is
    first.

    With several processes and `minutes`, the ranks agree every `AGREE_EVERY` steps (an agreement is
    a collective of its own): the first whose clock has run out stops them all at the same step."""

    gathers = False
    reads_epoch_only = True
    AGREE_EVERY = 10

    def __init__(
        self,
        epochs: int | None = None,
        steps: int | None = None,
        minutes: float | None = None,
        clock=time.monotonic,
    ):
        if epochs is None and steps is None and minutes is None:
            raise ConfigError("StopAfter: give at least one of epochs, steps, minutes")
        for key, limit in (("epochs", epochs), ("steps", steps), ("minutes", minutes)):
            if limit is not None and not (
                isinstance(limit, numbers.Real) and not isinstance(limit, bool) and limit > 0
            ):
                raise ConfigError(f"StopAfter: {key} must be a positive number, got {limit!r}")
        if not callable(clock):
            raise ConfigError(
                f"StopAfter: clock is a function giving seconds (time.monotonic), got {clock!r}"
            )
        self.epochs, self.steps, self.minutes, self.clock = epochs, steps, minutes, clock
        self._start = None

    def reads_loss(self, step: int) -> bool:
        """It reads no loss, but ends the run after its last step: there the pipeline's window of
        steps agreed on together ends, so that the run ends with every step's loss agreed (and
        `StopOnNaN` checks them before it ends)."""
        return self.steps is not None and step == math.ceil(self.steps)

    def before_training(self) -> None:
        """A run resumed at or past its limit stops before its first step, and says how to go on."""
        self._start = self.clock()
        run = self.trainer
        if self.steps is not None and run.step >= self.steps:
            self._stop_at_once(f"{run.step} steps done", "steps", self.steps, run.step)
        if self.epochs is not None and run.epoch >= self.epochs and not run.step_in_epoch:
            self._stop_at_once(f"{run.epoch} epochs done", "epochs", self.epochs, run.epoch)

    def _stop_at_once(self, done: str, key: str, limit: int, reached: int) -> None:
        stopped = f"{done} (StopAfter {key}={limit}), before this run's first step"
        if sum(name_of(h) == "StopAfter" for h in self.trainer.cfg.hooks or []) != 1:
            raise TrainingTerminated(f"{stopped}; to train on, give StopAfter a higher {key}")
        where = f"phalanx resume {self.trainer.run_dir} " if self.trainer.run_dir else ""
        raise TrainingTerminated(
            f"{stopped}; to train on, raise the limit "
            f"({where}hooks.StopAfter.{key}={max(2 * limit, reached + 1)}) or drop the hook "
            f"({where}~hooks.StopAfter)"
        )

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if not self.trainer.training:
            return
        if self.steps is not None and self.trainer.step >= self.steps:
            raise TrainingTerminated(f"{self.steps} steps done (StopAfter)")
        if self.minutes is None:
            return
        if self.trainer.strategy.world_size > 1 and self.trainer.step % self.AGREE_EVERY:
            return
        if self.trainer.any_rank(self.clock() - self._start >= 60 * self.minutes):
            raise TrainingTerminated(f"{self.minutes} minutes passed (StopAfter)")

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self.epochs is not None and epoch >= self.epochs:
            raise TrainingTerminated(f"{self.epochs} epochs done (StopAfter)")


class StopOnNaN(Hook):
    """Fail the run as soon as the training loss is NaN or infinite (checked every `every_n_steps`
    steps; the failure names the step), or a variable of the epoch's data is after an epoch.

    Under the pipeline the processes agree on several steps' losses in one message
    (`parallel.pipeline.agree_every`): a step's loss is checked when the message holding it is sent
    (that step waits for it to come), and the run fails up to a window after the step. On a GPU a
    loss comes to the host behind its step and is read at the next check, when the steps before
    have run (the kernels queued since are not waited for): the run fails one check later. At an
    epoch's last step and the step before an evaluation round every check so far is read, so that
    neither the evaluation nor the epoch's end follows a loss that was not finite (an epoch of a
    stream that does not say its length: after its evaluation and the after_epoch of the hooks
    listed before this one). A run that another hook stops as planned has its last losses read as
    it ends, and one that was not finite is logged as an error (the hook that stopped it says how
    it ended); on the CPU, `StopAfter`'s last step is checked before the run ends, and fails it. A
    run that failed or was interrupted reads none (what is in flight may never come)."""

    # reads each step's loss once its agreement has been sent: no step's is sent for this hook
    reads_loss = reads_no_loss
    reads_epoch_only = True

    # reads the trainer's global loss, the same on every rank
    gathers = False

    def __init__(self, variables: Sequence[str] = ("loss",), every_n_steps: int = 1):
        self.variables, self.every = list(variables), max(1, every_n_steps)
        # the checks whose loss's agreement has not been sent (the pipeline's), in step order:
        # (the loss, its step)
        self._unsent: list[tuple[Later, int]] = []
        # the losses of the last checks on a GPU, on their way to the host
        self._pending: _OnItsWay | None = None

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        run = self.trainer
        if not run.training:
            return
        if run.step % self.every == 0:
            later = run.last_loss_later  # of the step this batch came from
            if later is not None:
                self._unsent.append((later, run.step))
        due = []
        while self._unsent and self._unsent[0][0].sent:
            due.append(self._unsent.pop(0))
        if due:
            self._check(due, self._waits_here())
        elif self._pending is not None and self._waits_here():  # (every_n_steps > 1)
            pending, self._pending = self._pending, None
            self._fail_if(pending.check())

    def _check(self, entries: list[tuple[Later, int]], now: bool) -> None:
        """The losses of `entries` checked, the earlier ones on their way first; on a GPU they
        come to the host behind the step, unless `now`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._fail_if(pending.check())
        losses = _stacked([later.read() for later, _ in entries])
        steps = [step for _, step in entries]
        if _read_behind(losses) and not now:
            self._pending = _OnItsWay(losses, steps)
        else:
            self._fail_if(_not_finite(losses, steps))

    def _fail_if(self, nan: TrainingTerminated | None) -> None:
        """Fail the run with `nan`, where there is one: the later checks are not read."""
        if nan is not None:
            self._unsent, self._pending = [], None
            raise nan

    def _waits_here(self) -> bool:
        """Whether the run evaluates or ends its epoch after this step: there the check waits.
        The same on every process (a signal's request is not: a check that waited on one process
        alone would fail it a check before the others)."""
        run = self.trainer
        rounds = run.cfg.main_loop.eval_every_n_steps
        return run.step_in_epoch == run.steps_per_epoch or (
            rounds is not None and run.step % rounds == 0
        )

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        # what an epoch of a stream that does not say its length left (sent by its end)
        entries, self._unsent = self._unsent, []
        if entries:
            self._check(entries, now=True)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._fail_if(pending.check())
        for stream, values in epoch_data.items():
            for var in self.variables:
                value = values.get(var)
                if isinstance(value, float) and not math.isfinite(value):
                    raise TrainingTerminated(
                        f"{stream}.{var} is {value} after epoch {epoch} (StopOnNaN)", success=False
                    )

    def after_training(self, success: bool) -> None:
        """A run that another hook stopped as planned within an epoch: its last checks are still
        read, and a loss that was not finite said (the run has ended: it can no longer fail it). A
        run that failed or was interrupted reads none: what is in flight may never come."""
        pending, self._pending = self._pending, None
        entries, self._unsent = self._unsent, []
        if not success:
            return
        nan = pending.check() if pending is not None else None
        sent = [(later, step) for later, step in entries if later.sent]
        if nan is None and sent:
            nan = _not_finite(_stacked([later.read() for later, _ in sent]), [s for _, s in sent])
        if nan is not None:
            log.error("%s, read after the run had stopped", nan.reason)


def _read_behind(loss: torch.Tensor) -> bool:
    """Whether a loss is read behind its step: on a GPU (reading it there waits for the step)."""
    return loss.device.type == "cuda"


def _stacked(losses: list[torch.Tensor]) -> torch.Tensor:
    """Steps' losses as one vector (one loss: a view of it)."""
    return losses[0].reshape(1) if len(losses) == 1 else torch.stack(losses)


def _not_finite(values: torch.Tensor, steps: list[int]) -> TrainingTerminated | None:
    """The failure that the first of the steps' losses `values` that is not finite makes, naming
    its step; None where every one is finite."""
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return None
    k = int((~finite).nonzero()[0, 0])
    return TrainingTerminated(
        f"the training loss is not finite ({float(values[k])}) at step {steps[k]} (StopOnNaN)",
        success=False,
    )


class _OnItsWay:
    """Losses on a GPU copied to the host behind their steps, and the event that says they are
    there."""

    def __init__(self, losses: torch.Tensor, steps: list[int]):
        self.steps = steps
        self.host = losses.detach().to("cpu", non_blocking=True)  # pinned: the copy does not wait
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(losses.device))  # where the copy was queued

    def check(self) -> TrainingTerminated | None:
        """The failure a loss that was not finite makes (their copy waited for, if not there
        yet)."""
        self.done.synchronize()
        return _not_finite(self.host, self.steps)


class StopOnPlateau(Hook):
    """Stop when `variable` has not improved by `min_delta` for `patience` epochs."""

    reads_epoch_only = True

    def __init__(
        self,
        variable: str = "valid.loss",
        mode: str = "min",
        patience: int = 5,
        min_delta: float = 0.0,
    ):
        split_name(variable, "StopOnPlateau")
        if patience < 1:
            raise ConfigError(f"StopOnPlateau: patience must be >= 1, got {patience}")
        self.variable, self.mode = variable, check_mode(mode, "StopOnPlateau")
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.waited = 0

    def before_training(self) -> None:
        check_computed(self.variable, "StopOnPlateau", self)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        value = lookup(epoch_data, self.variable, "StopOnPlateau")
        if improved(value, self.best, self.mode, self.min_delta):
            self.best, self.waited = value, 0
        else:
            self.waited += 1
            if self.waited >= self.patience:
                raise TrainingTerminated(
                    f"{self.variable} has not improved for {self.patience} epochs "
                    f"(best {self.best:.6g}; StopOnPlateau)"
                )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = saved(state, "best", "StopOnPlateau", (float, int))
        self.waited = saved(state, "waited", "StopOnPlateau", (int,)) or 0
