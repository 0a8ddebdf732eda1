"""The training steps' losses, tallied: the last step's and the epoch's mean. A strategy may agree
on a step's loss behind the step (the pipeline, param_server): such a loss is settled (waited for)
only when it is read, and at most `UNSUMMED` of them wait to be added up. The pipeline sends the
agreements of several steps as one message: a loss whose message has not been sent is read (which
sends it, a collective) only where every process reads it, and a display reads the epoch's mean of
the steps whose message has gone (`epoch_mean(sent_only=True)`).

The settled losses are added up a group of `GROUP` steps at a time, by one stack and one sum: on a
GPU, two kernel launches a group where adding each loss to a running sum would launch one every
step. The groups are counted from the epoch's first step (or the resumed one), whenever the
losses are read and whether or not they were agreed behind the step, so the epoch's losses are
added in the same order whatever the strategy, and in at least single precision: a half-precision
sum of an epoch's losses would lose them (2.0 a step comes to 0.8 over 20,000 bf16 steps) or
overflow."""

from __future__ import annotations

from collections.abc import Callable

import torch

# steps whose losses may wait to be added up (settled) until one is read
UNSUMMED = 64
# steps whose settled losses are added up together
GROUP = 32
# what a half-precision loss is added up in
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _there() -> None:
    """A loss that is there already."""


class StepLosses:
    """The losses of an epoch's steps: `add` each step's, read `last` and `epoch_mean`."""

    def __init__(self) -> None:
        self._last: torch.Tensor | None = None
        # the last step's loss while its agreement is in flight
        self._settle: Callable[[], object] | None = None
        # the sum of the epoch's whole groups, the settled losses of the group being filled, and
        # the losses not yet settled
        self._sum: torch.Tensor | None = None
        self._group: list[torch.Tensor] = []
        self._unsummed: list[tuple[torch.Tensor, Callable[[], object]]] = []
        self._sent = 0  # the first unsummed losses whose agreement has been sent
        self.steps = 0
        self.epochs = 0  # epochs begun (a `Later` of an epoch before has been sent)

    def begin_epoch(self) -> None:
        self._sum, self._group, self._unsummed, self._sent, self.steps = None, [], [], 0, 0
        self.epochs += 1

    def add(
        self, loss: torch.Tensor, settle: Callable[[], object] | None, sent: bool = True
    ) -> None:
        """A step's global mean loss; `settle` waits for it, where it is agreed behind the step
        (`sent`: its agreement, and those of the steps before, have been sent)."""
        self._last, self._settle = loss, settle
        self.steps += 1
        if settle is None and not self._unsummed:  # there already
            self._gather(loss)
            return
        self._unsummed.append((loss, settle or _there))
        if sent:
            self._sent = len(self._unsummed)
        if len(self._unsummed) > UNSUMMED:
            self.settle(UNSUMMED // 2)

    @property
    def last(self) -> torch.Tensor | None:
        """The last step's loss, waited for where it is agreed behind the step."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle()  # (its agreement sent, and so every step's before it)
            self._sent = len(self._unsummed)
        return self._last

    def later(self) -> Later | None:
        """The last step's loss, to read once its agreement has been sent (None before the
        epoch's first step)."""
        return None if self._last is None or not self.steps else Later(self)

    @property
    def sent_steps(self) -> int:
        """The epoch's steps whose agreement has been sent: their loss is read without sending
        one."""
        return self.steps - len(self._unsummed) + self._sent

    def epoch_mean(self, sent_only: bool = False) -> torch.Tensor | None:
        """The mean of the epoch's step losses so far, None before its first step; `sent_only`:
        of the steps whose agreement has been sent (it sends none)."""
        self.settle(self._sent if sent_only else None)
        steps = self.steps - len(self._unsummed)
        if not steps:
            return None
        total = self._sum
        if self._group:  # added up for this read alone: the group fills on
            part = _summed(self._group)
            total = part if total is None else total + part
        assert total is not None
        return total / steps

    def settle(self, count: int | None = None) -> None:
        """The first `count` unsummed losses (all: None) settled and added up; the newest of them
        settles first (one request can settle the ones before it)."""
        count = len(self._unsummed) if count is None else count
        due, self._unsummed = self._unsummed[:count], self._unsummed[count:]
        self._sent = max(0, self._sent - count)
        for _, settle in reversed(due):
            settle()
        for loss, _ in due:
            self._gather(loss)
        if not self._unsummed:
            self._settle = None

    def _gather(self, loss: torch.Tensor) -> None:
        """A settled loss into its group, the group added to the sum once whole."""
        group = self._group
        group.append(loss)
        if len(group) == GROUP:
            total = _summed(group)
            self._sum = total if self._sum is None else self._sum + total
            self._group = []


class Later:
    """A step's loss that may still be on its way (agreed behind the step, in a window of steps
    that go as one message under the pipeline): `sent` once its agreement has been sent, so that
    `read()` waits at most for its arrival and sends nothing; elsewhere it is sent as it comes."""

    __slots__ = ("_losses", "_epoch", "_step", "_loss", "_settle")

    def __init__(self, losses: StepLosses):
        self._losses, self._epoch, self._step = losses, losses.epochs, losses.steps
        self._loss, self._settle = losses._last, losses._settle

    @property
    def sent(self) -> bool:
        losses = self._losses
        return losses.epochs != self._epoch or losses.sent_steps >= self._step

    def read(self) -> torch.Tensor:
        """The loss, waited for. Where its agreement has not been sent, reading it sends it: a
        collective, so every process must read it at the same step."""
        assert self._loss is not None  # (`StepLosses.later` gives none before a step)
        if self._settle is not None:
            self._settle()
        return self._loss


def _summed(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses' sum, in at least single precision."""
    stacked = torch.stack(losses)
    return stacked.sum(dtype=_WIDER.get(stacked.dtype))
