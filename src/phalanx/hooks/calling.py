"""The hooks as the loop calls them: each event's listeners (the hooks that override it, in order),
a hook that stops training letting the later ones run first (a later one's failure stands over
its end as planned), and after_batch's outputs gathered over the ranks for the hooks that see the
global batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.engine import concat
from phalanx.hooks.base import Hook, TrainingTerminated, loss_reads

if TYPE_CHECKING:
    from phalanx.runstate import RunState
    from phalanx.strategies.base import Strategy
    from phalanx.view import RunView

EVENTS = ("before_training", "after_batch", "after_epoch", "after_epoch_profile", "after_training")


class Calls:
    """The run's hooks, attached to `view`, and the listeners of each event."""

    def __init__(self, hooks: list[Hook], view: RunView, strategy: Strategy):
        self.hooks, self.view, self.strategy = hooks, view, strategy
        for hook in hooks:
            hook.attach(view)
        self.listeners = {event: [h for h in hooks if h.overrides(event)] for event in EVENTS}
        self._gatherers, self._gather_keys = _gathering(self.listeners["after_batch"])
        self.loss_readers = _loss_readers(self.listeners["after_batch"])

    def add(self, hook: Hook) -> None:
        """Call `hook` at its events from now on, after the others."""
        hook.attach(self.view)
        self.hooks.append(hook)
        for event in EVENTS:
            if hook.overrides(event):
                self.listeners[event].append(hook)
        self._gatherers, self._gather_keys = _gathering(self.listeners["after_batch"])
        self.loss_readers[:] = _loss_readers(self.listeners["after_batch"])

    def loss_due(self, state: RunState, every: int | None, last: int | None) -> Callable[[], bool]:
        """Whether the loss of the step about to run is read: by an after_batch hook (each says at
        which steps; one of the user's that does not, at every step), at an evaluation round after
        it (every `every` steps), or at the epoch's end (its step `last`; None: an epoch of
        unknown length). The same on every process."""
        readers = self.loss_readers  # kept as hooks are added

        def due() -> bool:
            step = state.step + 1
            return (
                state.step_in_epoch + 1 == last
                or (every is not None and step % every == 0)
                or any(read(step) for read in readers)
            )

        return due

    def emit(self, event: str, *args: Any) -> TrainingTerminated | None:
        """Call every hook on `event`; a hook that stops training lets the later ones run first."""
        stop = None
        for hook in self.listeners[event]:
            try:
                getattr(hook, event)(*args)
            except TrainingTerminated as t:
                stop = standing(stop, t)
        return stop

    def after_batch(
        self, listeners: list[Hook], stream: str, parts: Sequence[dict | None]
    ) -> TrainingTerminated | None:
        """Call after_batch with this rank's data, or the gathered global batch for hooks that need
        it."""
        if not listeners:
            return None
        local = concat(parts)
        merged = (
            self.strategy.gather_outputs(list(parts), self._gather_keys)
            if self._gatherers and self.strategy.world_size > 1
            else local
        )
        stop = None
        for hook in listeners:
            # empty where this rank had no samples
            view = merged if hook.gathers else local
            try:
                hook.after_batch(stream, view)
            except TrainingTerminated as t:
                stop = standing(stop, t)
        return stop


def standing(
    stop: TrainingTerminated | None, new: TrainingTerminated | None
) -> TrainingTerminated | None:
    """Of two hooks' ends of training, the one that stands: the first, unless the later one fails
    the run where the first ended it as planned (a hook that stops at a step whose loss another
    finds not finite)."""
    if stop is None or (new is not None and stop.success and not new.success):
        return new
    return stop


def _loss_readers(listeners: list[Hook]) -> list[Any]:
    """Each after_batch hook's `reads_loss` that may say yes (see `loss_reads`)."""
    return [r for r in map(loss_reads, listeners) if r is not None]


def _gathering(listeners: list[Hook]) -> tuple[list[Hook], set[str] | None]:
    """The after_batch hooks that see the gathered global batch, and the keys to gather: those they
    list, or all (None) where one lists none."""
    gatherers = [h for h in listeners if h.gathers]
    listed = [h.gather_keys for h in gatherers if h.gather_keys is not None]
    keys = {k for named in listed for k in named} if len(listed) == len(gatherers) else None
    return gatherers, keys
