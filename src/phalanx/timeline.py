"""Where the training loop's time goes (`LoopTimes`): waiting for data, the step (forward and
backward, communication after backward, the optimizer) and the hooks, by epoch, by evaluation round
and in all; on a GPU, on the device's own timeline.

Where a GPU's time goes: CUDA events around each training step.

On a GPU the host queues a step's kernels and moves on; the host's clock then charges the queued
work to whatever first waits for the device (a hook reading the loss), and calls the step cheap.
The device's own timeline does not lie: an event recorded before and after each step completes
when the GPU reaches it, so the time between the two is the GPU's time in the step, and the time
between one step's end and the next one's start is the GPU's time outside the steps (waiting for
data, for hooks, or doing the hooks' own work). The events are read behind the steps, once they
have completed (`query`, which does not wait), and at an epoch's end, which waits for the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

# steps between two looks at which events have completed: events in flight stay bounded
_FOLD_EVERY = 32


class DeviceTimeline:
    """The GPU's seconds in training steps and between them, from events recorded around each step
    on the stream the steps run on. `new_event` makes an event with `record(stream)`, `query()`,
    `synchronize()` and `elapsed_time(other)` in milliseconds (torch.cuda.Event's);
    `current_stream` gives the stream, looked up once per `take` (None: the event's own default).

    A step costs two records and, once folded, one `elapsed_time`: events on one stream complete in
    order, so a query of the newest (or of the one before it) tells whether all before it have,
    and the time between the steps is the span they cover less the time in them."""

    def __init__(
        self, new_event: Callable[[], Any], current_stream: Callable[[], Any] | None = None
    ):
        self._new_event, self._current_stream = new_event, current_stream
        self._stream: Any = None
        self._free: list[Any] = []
        # (start, end) of each step not yet read, oldest first
        self._pending: deque[tuple[Any, Any]] = deque()
        self._start: Any = None
        self._last_end: Any = None  # the newest step's end already read: the next gap starts there
        self._unfolded = 0
        self.in_steps = 0.0  # seconds, since the last `take`
        self.between_steps = 0.0

    @classmethod
    def for_cuda(cls) -> DeviceTimeline:
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.current_stream)

    def begin(self) -> None:
        """A step is about to be queued."""
        if self._stream is None and self._current_stream is not None:
            self._stream = self._current_stream()
        self._start = self._event()

    def end(self) -> None:
        """The step's work is queued."""
        self._pending.append((self._start, self._event()))
        self._unfolded += 1
        if self._unfolded >= _FOLD_EVERY:
            self._fold(wait=False)

    def take(self) -> tuple[float, float]:
        """Seconds the GPU spent in the steps, and between them, since the last take (waits for
        the last step queued). The next step's gap is counted from its own start: what comes
        between (an evaluation, an epoch's end) is timed by the host, and the stream is looked up
        again."""
        self._fold(wait=True)
        times = self.in_steps, self.between_steps
        self.in_steps = self.between_steps = 0.0
        if self._last_end is not None:
            self._free.append(self._last_end)
            self._last_end = None
        self._stream = None
        return times

    def _event(self) -> Any:
        event = self._free.pop() if self._free else self._new_event()
        event.record(self._stream)
        return event

    def _fold(self, wait: bool) -> None:
        """The completed steps' times added up, their events freed."""
        self._unfolded = 0
        pending = self._pending
        if not pending:
            return
        if wait:
            pending[-1][1].synchronize()
            done = len(pending)
        else:
            # one step completed means every one before it has: the newest, or the one before it
            # (the newest is often still running), else as many of the oldest as have
            n = len(pending)
            done = n if _done(pending, n) else n - 1 if n > 1 and _done(pending, n - 1) else 0
            if not done:
                while done < n - 2 and _done(pending, done + 1):
                    done += 1
            if not done:
                return
        last_end = pending[done - 1][1]
        anchor = pending[0][0] if self._last_end is None else self._last_end
        span = anchor.elapsed_time(last_end)
        inside = 0.0
        for _ in range(done):
            start, end = pending.popleft()
            inside += start.elapsed_time(end)
            self._free.append(start)
            if end is not last_end:
                self._free.append(end)
        self.in_steps += inside / 1e3
        self.between_steps += max(0.0, span - inside) / 1e3
        if self._last_end is not None:
            self._free.append(self._last_end)
        self._last_end = last_end


def _done(pending: deque[tuple[Any, Any]], k: int) -> bool:
    """Whether the `k`-th pending step (from 1) has completed on the device."""
    return pending[k - 1][1].query()


def split(live: list[float], in_steps: float, between_steps: float) -> None:
    """Rewrite the loop's host-timed parts `live` (data, forward_backward, communication,
    optimizer, hooks) on the device's timeline: the steps' parts sum to the GPU's time in the
    steps (communication and the optimizer keep the host's time in them, which they cannot
    exceed; forward and backward is the rest), and data and hooks share the GPU's time between
    steps in proportion to the host's time in each."""
    data, _, communication, optimizer, hooks = live
    inside = communication + optimizer
    scale = min(1.0, in_steps / inside) if inside > 0 else 1.0
    communication, optimizer = communication * scale, optimizer * scale
    outside = data + hooks
    data_share = data / outside if outside > 0 else 1.0
    live[:] = [
        between_steps * data_share,
        in_steps - communication - optimizer,
        communication,
        optimizer,
        between_steps * (1.0 - data_share),
    ]


# the parts of a training step's time, in `LoopTimes.live`'s order
TRAINING = ("data", "forward_backward", "communication", "optimizer", "hooks")


class LoopTimes:
    """Seconds the loop spent, by part: `total` over the run (with `eval`), `round` since the last
    evaluation round, `epoch` the epoch's while it runs, and `live` the steps' not yet added to
    them, which the loop itself adds to (a list, for speed). On a GPU (`cuda`) the steps' parts are
    rewritten on the device's timeline as they are added (see `DeviceTimeline`)."""

    def __init__(self, cuda: bool = False):
        self.total = dict.fromkeys((*TRAINING, "eval"), 0.0)
        self.round = dict.fromkeys(TRAINING, 0.0)
        self.epoch: dict[str, float] | None = None
        self.live = [0.0] * len(TRAINING)
        self.device = DeviceTimeline.for_cuda() if cuda else None

    def begin_epoch(self) -> dict[str, float]:
        """The epoch's own times, which `add` fills until `end_epoch`."""
        self.epoch = dict.fromkeys(TRAINING, 0.0)
        return self.epoch

    def end_epoch(self, epoch: dict[str, float]) -> None:
        self.epoch = None
        for key, seconds in epoch.items():
            self.total[key] += seconds

    def begin_steps(self) -> list[float]:
        """A new `live` list for a loop of steps to add to."""
        self.live = [0.0] * len(TRAINING)
        return self.live

    def add(self, epoch: dict[str, float]) -> None:
        """The steps' seconds since they were last added, into `epoch`'s and the round's."""
        live = self.live
        if self.device is not None:
            split(live, *self.device.take())
        for k, (key, seconds) in enumerate(zip(TRAINING, live, strict=True)):
            epoch[key] += seconds
            self.round[key] += seconds
            live[k] = 0.0

    def new_round(self) -> None:
        self.round = dict.fromkeys(TRAINING, 0.0)

    def so_far(self) -> dict[str, float]:
        """Seconds so far in the run, by part, up to the last step."""
        if self.device is not None and self.epoch is not None:
            # the steps' times exist once the device has reached them
            self.add(self.epoch)
        times = dict(self.total)
        for part in (self.epoch or {}), dict(zip(TRAINING, self.live, strict=True)):
            for key, seconds in part.items():
                times[key] = times.get(key, 0.0) + seconds
        return times
