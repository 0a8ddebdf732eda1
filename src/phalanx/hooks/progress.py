"""ShowProgress: a live progress bar per epoch with ETA, samples/s and the running loss."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from phalanx.hooks.base import Hook
from phalanx.logs import console


class ShowProgress(Hook):
    """The bar is drawn on a terminal only; logs and files are unaffected. The loss shown is the
    mean of the epoch's training steps so far, refreshed at most every `refresh_s` seconds."""

    gathers = False  # reads the trainer's global loss and batch size

    def __init__(self, refresh_s: float = 0.2):
        self.refresh_s = refresh_s
        self._progress: Progress | None = None
        self._tasks: dict[str, tuple[Any, dict[str, Any]]] = {}

    def before_training(self) -> None:
        if not self.trainer.strategy.is_main or not console.is_terminal:
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
        progress = self._progress
        if progress is None:
            return
        task, state = self._tasks.get(stream) or self._new_task(progress, stream)
        state["samples"] += self.trainer.last_batch_size
        state["batches"] += 1
        now = time.monotonic()
        fields: dict[str, Any] = {}  # the columns' fields, beside update's own keywords
        if now - state["shown"] >= self.refresh_s:
            state["shown"] = now
            rate = state["samples"] / max(now - state["start"], 1e-9)
            fields = {"rate": f"{rate:,.0f} samples/s"}
            loss = self.trainer.epoch_loss if self.trainer.training else None
            if loss is not None:  # read when shown: a loss agreed behind the step is not waited for
                fields["loss"] = f"{float(loss):.4f}"
        progress.update(task, advance=1, **fields)

    def _new_task(self, progress: Progress, stream: str) -> tuple[Any, dict[str, Any]]:
        if self.trainer.training:
            total = self.trainer.steps_per_epoch
            completed = self.trainer.step_in_epoch - 1
            description = f"epoch {self.trainer.epoch + 1}/{self.trainer.cfg.main_loop.epochs}"
        else:
            total, completed, description = None, 0, f"  {stream}"
        task = progress.add_task(
            description, total=total, completed=max(completed, 0), rate="", loss="-"
        )
        state = {
            "samples": 0,
            "batches": 0,
            "start": time.monotonic(),
            "shown": 0.0,
        }
        self._tasks[stream] = (task, state)
        return task, state

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self._progress is not None:
            for task, _ in self._tasks.values():
                self._progress.stop_task(task)
        self._tasks.clear()

    def after_training(self, success: bool) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
