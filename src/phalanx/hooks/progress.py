"""ShowProgress: a live progress bar per epoch with ETA, samples/s and the running loss; without a
terminal, a progress line now and then."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from phalanx.hooks.base import Hook, reads_no_loss
from phalanx.hooks.variables import check_positive
from phalanx.logs import console

log = logging.getLogger("phalanx")


class ShowProgress(Hook):
    """On a terminal, a bar per epoch and per evaluated stream; logs and files are unaffected. The
    loss shown is the mean of the epoch's training steps so far, refreshed at most every
    `refresh_s` seconds. Without a terminal (a file, a pipe, a batch job's log), a line in the log
    every `every_s` seconds of an epoch or stream, the first `every_s` seconds in: where it is, the
    rate, the loss and the time left; one shorter than that logs none. Rates are measured from the
    end of the first batch, whose time includes starting up."""

    reads_loss = reads_no_loss

    reads_epoch_only = True

    # reads the trainer's global loss and batch size
    gathers = False

    def __init__(
        self,
        refresh_s: float = 0.2,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_positive("ShowProgress", zero=True, refresh_s=refresh_s, every_s=every_s)
        self.refresh_s, self.every_s, self.clock = refresh_s, every_s, clock
        self._progress: Progress | None = None
        # progress lines in the log, without a terminal
        self._lines = False
        self._tasks: dict[str, tuple[Any, dict[str, Any]]] = {}

    def before_training(self) -> None:
        if not self.trainer.strategy.is_main:
            return
        if not console.is_terminal:
            self._lines = self.every_s > 0
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=5,
        )
        self._progress.start()

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if self._progress is None and not self._lines:
            return
        now = self.clock()
        known = self._tasks.get(stream)
        # the first batch: the rates start at its end
        if known is None:
            self._new_task(stream, now)
            return
        task, state = known
        state["samples"] += self.trainer.last_batch_size
        state["batches"] += 1
        if self._progress is None:
            if now - state["shown"] >= self.every_s:
                state["shown"] = now
                log.info("%s", self._line(stream, state, now))
            return
        # the columns' fields, beside update's own keywords
        fields: dict[str, Any] = {}
        if now - state["shown"] >= self.refresh_s and now > state["start"]:
            state["shown"] = now
            fields = {"rate": f"{_rate(state, now):,.0f} samples/s"}
            loss = self.trainer.epoch_loss_so_far if self.trainer.training else None
            # read when shown: a loss agreed behind the step is not waited for
            if loss is not None:
                fields["loss"] = f"{float(loss):.4f}"
        self._progress.update(task, advance=1, **fields)

    def _new_task(self, stream: str, now: float) -> None:
        trainer = self.trainer
        total: int | None
        if trainer.training:
            total = trainer.steps_per_epoch
            done = max(trainer.step_in_epoch, 1)  # a resumed epoch starts where it was
            description = f"epoch {trainer.epoch + 1}/{trainer.cfg.main_loop.epochs}"
        else:
            total, done, description = trainer.stream_batches(stream), 1, f"  {stream}"
        task = None
        if self._progress is not None:
            task = self._progress.add_task(
                description, total=total, completed=done, rate="", loss="-"
            )
        state = {
            "samples": 0,  # after the first batch
            "batches": done,
            "first": done,  # batches done when the rates start
            "total": total,
            "description": description.strip(),
            "start": now,
            "shown": now,
        }
        self._tasks[stream] = (task, state)

    def _line(self, stream: str, state: dict[str, Any], now: float) -> str:
        """Where the epoch or stream is, its rate, the loss so far and the time left."""
        done, total = state["batches"], state["total"]
        unit = "steps" if self.trainer.training else "batches"
        where = f"{done}/{total} {unit} ({100 * done / total:.0f}%)" if total else f"{done} {unit}"
        parts = [f"{state['description']}: {where}", f"{_rate(state, now):,.0f} samples/s"]
        loss = self.trainer.epoch_loss_so_far if self.trainer.training else None
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        if total and done > state["first"]:
            seconds = (now - state["start"]) / (done - state["first"]) * (total - done)
            parts.append(f"eta {datetime.timedelta(seconds=round(seconds))}")
        return ", ".join(parts)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self._progress is not None:
            for task, _ in self._tasks.values():
                self._progress.stop_task(task)
        self._tasks.clear()

    def after_training(self, success: bool) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _rate(state: dict[str, Any], now: float) -> float:
    """Samples a second since the end of the first batch."""
    return state["samples"] / max(now - state["start"], 1e-9)
