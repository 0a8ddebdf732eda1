"""The pipeline's agreements on its steps' losses and stop flags, several steps' in one message
(`Window`), running behind the steps (`StepsAgreement`): only the last stage computes the loss,
so every process learns it, and whether any process asked to stop, from an all-reduce; a message
costs the processes' transport about as much whatever it holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.errors import ModelError
from phalanx.strategies.distributed import Behind


class Window:
    """The agreements of consecutive steps, each a row of (loss part, weight sum, weighted, stop),
    sent as one message (`dispatch`, which gives `sent_as` the collective's work) when the last of
    them ends: a message costs the processes' transport about as much whatever its size, so that
    fewer of them bring a step nearer a hand-written one's time. A row's stop flag is any of the
    window's steps' so far (the last row's stands for the window). A step's loss is read once the
    window's message has come (`settled`)."""

    def __init__(self, size: int, device: torch.device, dispatch: Callable[[Window], None]):
        self._values = torch.zeros(size, 4, dtype=torch.float64, device=device)
        self._dispatch = dispatch
        self._steps = 0
        self._stop = False
        self._dropped = False
        self.sent: StepsAgreement | None = None  # the message, once sent

    @property
    def full(self) -> bool:
        return self._steps == len(self._values)

    def next(self, stop: bool) -> torch.Tensor:
        """The next step's row, its stop flag set."""
        row = self._values[self._steps]
        self._steps += 1
        self._stop = self._stop or stop
        row[3] = float(self._stop)
        return row

    def rows(self) -> torch.Tensor:
        """The steps' rows, one after the other: the message, summed in place."""
        return self._values[: self._steps].view(-1)

    def sent_as(self, work: Any) -> None:
        """The rows are being summed over every process by `work`, behind the step."""
        self.sent = StepsAgreement(self.rows(), work)

    def settled(self) -> None:
        """A step's loss is read: the message sent, where the window has not been (every process
        reads it at the same step: the loop's end, or a hook's read at a step it did not say it
        reads), and waited for."""
        if self.sent is None:
            if self._dropped:
                return
            self._dispatch(self)
        assert self.sent is not None
        self.sent.settled()

    def drop(self) -> None:
        """Never to be sent (the run failed)."""
        self._dropped = self.sent is None


class StepsAgreement(Behind):
    """A window's agreement on its steps' losses and stop flags, running behind the steps: (loss
    part, weight sum, weighted, stop) a step."""

    def _check(self, values: list[float]) -> None:
        if any(weighted > 0 for weighted in values[2::4]):
            raise ModelError(
                "the model's loss became weighted (it returned loss_weight) after steps "
                "without weights; return loss_weight from every step, or from none"
            )
