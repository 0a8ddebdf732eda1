"""Profile: a torch.profiler trace of a few training steps, and the operations that took the time.

Set by the config's `profile: {start_step, steps}`; the trace lands in the run directory's
`profile/` (one file per rank, for chrome://tracing or Perfetto) and the top operations are logged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

from phalanx.hooks.base import Hook, reads_no_loss

log = logging.getLogger("phalanx")


class Profile(Hook):
    """Records steps `start_step` to `start_step + steps - 1`."""

    reads_loss = reads_no_loss

    gathers = False

    def __init__(
        self, start_step: int = 10, steps: int = 5, record_shapes: bool = False, top: int = 15
    ):
        self.start, self.steps, self.record_shapes, self.top = start_step, steps, record_shapes, top
        self._profiler: profile | None = None
        # where the trace went once recorded; "" where the run has no directory to write it to
        self.trace_path: Path | str | None = None

    def before_training(self) -> None:
        if self.trainer.step + 1 >= self.start:
            self._begin()

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if not self.trainer.training:
            return
        step = self.trainer.step
        if self._profiler is None and step + 1 == self.start:
            self._begin()
        elif self._profiler is not None and step >= self.start + self.steps - 1:
            self._end()

    def after_training(self, success: bool) -> None:
        if self._profiler is not None:
            self._end()

    def _begin(self) -> None:
        if self.trace_path is not None:
            return  # recorded once per run
        activities = [ProfilerActivity.CPU]
        if self.trainer.strategy.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=self.record_shapes)
        self._profiler.__enter__()

    def _end(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        if self.trainer.run_dir is None:
            self.trace_path = ""
            return
        folder = self.trainer.run_dir / "profile"
        folder.mkdir(exist_ok=True)
        self.trace_path = trace = folder / f"trace-rank{self.trainer.strategy.rank}.json"
        profiler.export_chrome_trace(str(trace))
        if self.trainer.strategy.is_main:
            sort = (
                "self_cuda_time_total"
                if self.trainer.strategy.device.type == "cuda"
                else "self_cpu_time_total"
            )
            table = profiler.key_averages().table(sort_by=sort, row_limit=self.top)
            log.info(
                "profile of steps %d-%d (trace: %s)\n%s",
                self.start,
                self.start + self.steps - 1,
                self.trace_path,
                table,
            )
