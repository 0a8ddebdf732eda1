"""The pipeline's agreements on its steps' losses and stop flags (`StepAgreements`), several
steps' in one message (`Window`), running behind the steps (`StepsAgreement`): only the last stage
computes the loss, so every process learns it, and whether any process asked to stop, from an
all-reduce; a message costs the processes' transport about as much whatever it holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.errors import ModelError
from phalanx.strategies.distributed import Behind, LastAgreement

# sums `values` over every process, in place, behind the caller (the collective's work)
Send = Callable[[torch.Tensor], Any]


class StepAgreements:
    """Each step's agreement among the processes: (loss part, weight sum, weighted, stop), summed.
    A weighted loss's waits for it (the optimizer's step needs its weights' sum), as does the first
    step's, from which every process learns whether the loss is weighted (only the last stages see
    it); a plain one's runs behind the step, gathered into windows of up to `agree_every` steps
    sent as one message when the step that ends one has run (`when`)."""

    def __init__(self, device: torch.device, agree_every: int, send: Send):
        self.device, self.agree_every, self._send = device, agree_every, send
        self.weighted: bool | None = None  # whether the model weighs its loss, from the first step
        self._behind = LastAgreement()  # the last window's agreement, behind it
        # in the steps loop, whether the step about to run ends the window; None: every step does
        self._due: Callable[[], bool] | None = None
        self._window: Window | None = None  # the steps gathered since the last message
        self._stopped = False  # the last stop flag taken, for the next step's outcome

    def when(self, due: Callable[[], bool] | None, drop: bool = False) -> None:
        """`due()` says whether the step about to run ends its window (its loss is read); None:
        every step's goes at once, and a window not sent goes now, or is dropped where `drop` (a
        failed run's: no other process may come to it)."""
        window = self._window
        if due is None and window is not None and window.sent is None:
            if drop:
                window.drop()
                self._window = None
            else:
                self._dispatch(window)
        self._due = due

    def step(self, stop: bool, parts: list[torch.Tensor]) -> tuple[torch.Tensor, Window | None]:
        """This step's agreement on its loss `parts` (this process's) and `stop`: the summed
        values, waited for (no window), or the step's loss alone and the window it goes in."""
        if self.weighted is False:
            window = self._window
            if window is None or window.sent is not None:  # (sent by a read between steps)
                size = self.agree_every if self._due is not None else 1
                window = self._window = Window(size, self.device, self._dispatch)
            loss = window.next(stop, parts)
            if window.full or self._due is None or self._due():
                self._dispatch(window)
            return loss, window
        values = torch.zeros(4, dtype=torch.float64, device=self.device)
        values[3] = float(stop)
        if parts:
            total = torch.stack(parts).sum(0).to(torch.float64).reshape(-1)
            values[: len(total)] = total
            values[2] = float(parts[0].dim() > 0)  # a weighted loss's parts are pairs
        self._send(values).wait()
        self.weighted = bool(values[2] > 0)
        return values, None

    def stopped(self) -> bool:
        """Whether any process asked to stop, as the last window sent says (a window late on every
        process alike); taken once."""
        stopped, self._stopped = self._stopped, False
        return stopped

    def check(self) -> None:
        """The last window's agreement read on the host and checked, where no next one takes it."""
        self._behind.check()

    def _dispatch(self, window: Window) -> None:
        """`window`'s message sent, to run on behind the step; the window before's has ended by
        now (every stage's part of the steps since needed the others'), and gives the stop flag."""
        window.sent_as(self._send(window.rows()))
        if self._window is window:
            self._window = None
        self._stopped = self._behind.swap(window.sent) or self._stopped


class Window:
    """The agreements of consecutive steps, each a row of (loss part, weight sum, weighted, stop),
    sent as one message (`dispatch`, which gives `sent_as` the collective's work) when the last of
    them ends: a message costs the processes' transport about as much whatever its size, so that
    fewer of them bring a step nearer a hand-written one's time. A row's stop flag is any of the
    window's steps' so far (the last row's stands for the window). A step's loss is read once the
    window's message has come (`settled`).

    A step adds nothing to the device: its loss parts and flags are kept as they are, and the
    message is written from them when it is sent (a few operations a window, none a step)."""

    def __init__(self, size: int, device: torch.device, dispatch: Callable[[Window], None]):
        self._values = torch.zeros(size, 4, dtype=torch.float64, device=device)
        # each step's loss: a view of its row, which the message fills
        self._losses = self._values[:, 0].unbind()
        self._dispatch = dispatch
        self._parts: list[list[torch.Tensor]] = []  # each step's loss parts (this process's)
        self._weighted: list[int] = []  # the steps whose loss came weighted
        self._stopped_at: int | None = None  # the first step that asked to stop
        self._message: torch.Tensor | None = None  # the rows, once written
        self._dropped = False
        self.sent: StepsAgreement | None = None  # the message, once sent

    @property
    def full(self) -> bool:
        return len(self._parts) == len(self._values)

    def next(self, stop: bool, parts: list[torch.Tensor]) -> torch.Tensor:
        """The next step, its loss `parts` (this process's: none where it holds no last stage) and
        whether it asked to stop; its loss, as the message will have it."""
        k = len(self._parts)
        if stop and self._stopped_at is None:
            self._stopped_at = k
        if parts and parts[0].dim():  # a weighted loss's parts are pairs
            self._weighted.append(k)
            parts = []
        self._parts.append(list(parts))  # (the caller's list may grow: an evaluation's)
        return self._losses[k]

    def rows(self) -> torch.Tensor:
        """The steps' rows, one after the other: the message, summed in place (written once)."""
        if self._message is None:
            self._message = self._write()
        return self._message

    def _write(self) -> torch.Tensor:
        n = len(self._parts)
        values = self._values[:n]
        sizes = {len(parts) for parts in self._parts}
        if len(sizes) == 1 and 0 not in sizes:  # as many parts a step: one sum for the window
            flat = torch.stack([part for parts in self._parts for part in parts])
            values[:, 0] = flat.view(n, -1).sum(1)  # each step's, summed as the step's own
        elif sizes != {0}:
            for row, parts in zip(values, self._parts, strict=True):
                if parts:
                    row[0] = torch.stack(parts).sum(0)
        for k in self._weighted:
            values[k, 2] = 1.0
        if self._stopped_at is not None:
            values[self._stopped_at :, 3] = 1.0
        return values.view(-1)

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
