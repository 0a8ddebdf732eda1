"""Hooks that report an epoch: LogVariables, LogProfile, WriteCSV, WriteTensorBoard, PlotLines.

All of them write on the main process only, into the run directory.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.errors import StorageError
from phalanx.files import write_text_atomic, writing
from phalanx.hooks.base import Hook, reads_no_loss
from phalanx.hooks.variables import flat_variables

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from phalanx.plots import Painter

log = logging.getLogger("phalanx")


class _Writer(Hook):
    """A hook that writes only on the main process, into the run directory."""

    reads_epoch_only = True

    @property
    def active(self) -> bool:
        return self.trainer.strategy.is_main and self.trainer.run_dir is not None

    @property
    def _run_dir(self) -> Path:
        """The run directory, which an active writer writes into."""
        run_dir = self.trainer.run_dir
        if run_dir is None:
            raise RuntimeError(f"{type(self).__name__}: this run has no directory to write into")
        return run_dir

    def _say_unknown(self, epoch_data: dict, variables: list[str] | None) -> None:
        """The `variables` asked for (`var` or `stream.var`) that the first epoch's data does not
        hold (a typo shows nothing), said once."""
        names = flat_variables(epoch_data)
        known = set(names) | {name.partition(".")[2] for name in names}
        unknown = [v for v in variables or [] if v not in known]
        if unknown:
            log.warning(
                "%s: no stream has %s; the epoch's variables are %s",
                type(self).__name__,
                ", ".join(map(repr, unknown)),
                ", ".join(names) or "none",
            )


class LogVariables(_Writer):
    """One line per epoch on the console and in `log.txt`: every variable of every stream, or those
    `variables` names (`var`, in every stream, or `stream.var`)."""

    def __init__(self, variables: list[str] | None = None):
        self.variables = variables
        self._checked = False

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if not self.trainer.strategy.is_main:
            return
        if not self._checked:
            self._checked = True
            self._say_unknown(epoch_data, self.variables)
        parts = []
        for stream, values in epoch_data.items():
            shown = [
                f"{var} {value:.6g}"
                for var, value in values.items()
                if isinstance(value, (int, float))
                and (
                    self.variables is None
                    or var in self.variables
                    or f"{stream}.{var}" in self.variables
                )
            ]
            if shown:
                parts.append(f"{stream}: {', '.join(shown)}")
        log.info(
            "epoch %d (step %d) | %s", epoch, self.trainer.step, " | ".join(parts) or "no variables"
        )


class LogProfile(_Writer):
    """Where an epoch's time went: waiting for data, forward and backward (with the gradient
    all-reduce that overlaps backward), communication after backward (gradients summed by hand on
    steps where a process has no sample), the optimizer, hooks, evaluation; each with its share.

    With several processes, also the gradient all-reduce inside backward per step and how much of
    it computation hid. Those figures are DDP's own: running averages over the steps it sampled in
    the whole run so far (the first 10, then 1 in 100), not this epoch's; they are labelled so and
    logged only when a new sample changed them.

    And once a run of several processes, after its first steps (the `JUDGED` after `WARM`, or the
    first epoch where it is shorter): the share of a step spent communicating, with a warning and
    one device's estimate where it is more than half."""

    reads_loss = reads_no_loss

    gathers = False
    # steps: the first ones (allocations, first calls) are not judged
    WARM, JUDGED = 5, 20

    def __init__(self) -> None:
        self._reported: tuple[float, float] | None = None
        # whether the communication share was said (once a run)
        self._judged = False
        self._steps = 0  # training steps this run has seen
        self._warm: dict[str, float] | None = None  # the times after the WARM steps

    def after_batch(self, stream: str, batch: dict) -> None:
        if self._judged or not self.trainer.training:
            return
        self._steps += 1
        if self._steps == self.WARM:
            self._warm = self.trainer.profile
        elif self._steps == self.WARM + self.JUDGED and self._warm is not None:
            self._judged = True
            strategy = self.trainer.strategy
            if strategy.is_main and strategy.world_size > 1:
                now, warm = self.trainer.profile, self._warm
                times = {k: v - warm.get(k, 0.0) for k, v in now.items() if k in _STEP_TIMES}
                self._judge(times, self._sample_communication(), self.JUDGED)

    def after_epoch_profile(
        self, epoch: int, profile: dict[str, float], train_stream: str, extra_streams: list[str]
    ) -> None:
        if not self.trainer.strategy.is_main:
            return
        total = sum(profile.values()) or 1.0
        parts = [
            f"{name} {seconds:.2f}s ({100 * seconds / total:.0f}%)"
            for name, seconds in profile.items()
        ]
        log.info("epoch %d time | %s", epoch, ", ".join(parts))
        strategy = self.trainer.strategy
        sampled = self._sample_communication()
        if not self._judged and strategy.world_size > 1:  # an epoch shorter than the first steps
            self._judged = True
            steps = max(self.trainer.step_in_epoch or self.trainer.steps_per_epoch, 1)
            self._judge(profile, sampled, steps)
        if sampled is not None and sampled != self._reported:
            self._reported = sampled
            comm, overlap = sampled
            log.info(
                "gradient all-reduce in backward, DDP's sampled average over the run so far (the "
                "first 10 steps, then 1 in 100) | %.2f ms per step, %.0f%% of it hidden behind "
                "computation, %.2f ms waited",
                1e3 * comm,
                100 * min(overlap / comm, 1.0) if comm > 0 else 100.0,
                1e3 * max(comm - overlap, 0.0),
            )

    def _sample_communication(self) -> tuple[float, float] | None:
        return self.trainer.strategy.backward_communication()

    def _judge(
        self, profile: dict[str, float], sampled: tuple[float, float] | None, steps: int
    ) -> None:
        """The share of `steps` training steps of several processes spent communicating (after
        backward, and the part of backward's all-reduce that computation did not hide), and where
        it is more than half, a warning with what one device would take."""
        waited = max(sampled[0] - sampled[1], 0.0) * steps if sampled is not None else 0.0
        training = {k: v for k, v in profile.items() if k in _STEP_TIMES}
        computing = max(training.get("forward_backward", 0.0) - waited, 0.0)
        communicating = training.get("communication", 0.0) + waited
        total = sum(training.values()) or 1.0
        share = communicating / total
        log.info(
            "communication | %.0f%% of the training time (%.2f ms a step)",
            100 * share,
            1e3 * communicating / steps,
        )
        if share <= 0.5:
            return
        n = self.trainer.strategy.world_size
        one = (n * computing + training.get("optimizer", 0.0)) / steps
        here = total / steps
        log.warning(
            "more than half of each step waits for communication (%.0f%%): one device would "
            "take about %.1f ms a step (this process's computation times %d, no communication), "
            "%.2fx this run's speed of %.1f ms; `phalanx plan` prices every setup",
            100 * share,
            1e3 * one,
            n,
            here / one if one else 0.0,
            1e3 * here,
        )


_STEP_TIMES = ("data", "forward_backward", "communication", "optimizer", "hooks")


class WriteCSV(_Writer):
    """`metrics.csv` in the run directory: a row per epoch (or evaluation round, with
    `main_loop.eval_every_n_steps`), a column per `stream.variable`.

    On resume, rows after the restored epoch (or round) are dropped, so the file matches the run's
    history.
    """

    def __init__(self, path: str = "metrics.csv"):
        self.path = path
        self._rows: list[dict[str, Any]] = []

    def before_training(self) -> None:
        if not self.active:
            return
        file = self._run_dir / self.path
        if file.is_file():
            with open(file, newline="") as f:
                done = (
                    self.trainer.epoch
                    if self.trainer.cfg.main_loop.eval_every_n_steps is None
                    else self.trainer.rounds
                )
                self._rows = [r for r in csv.DictReader(f) if int(r["epoch"]) <= done]
            self._write()

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if not self.active:
            return
        self._rows.append({"epoch": epoch, "step": self.trainer.step, **flat_variables(epoch_data)})
        self._write()

    def _write(self) -> None:
        columns = ["epoch", "step"]
        for row in self._rows:
            columns += [k for k in row if k not in columns]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(self._rows)
        write_text_atomic(self._run_dir / self.path, text.getvalue())


class WriteTensorBoard(_Writer):
    """TensorBoard event files under `tensorboard/`: every epoch variable, the learning rate, and
    the training loss (and gradient norm, where it is clipped) every `every_n_steps` steps. The
    x-axis is the optimizer step throughout, so that a resumed run drops the events it is about to
    write again. A write the system refuses (a full disk: tensorboard's writer thread raises it at
    the next call) is a StorageError naming the folder."""

    gathers = False

    def __init__(self, log_dir: str = "tensorboard", every_n_steps: int = 50):
        self.log_dir, self.every = log_dir, every_n_steps
        self._writer: SummaryWriter | None = None

    def reads_loss(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def before_training(self) -> None:
        if self.active:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

            with writing(self._run_dir / self.log_dir):
                self._writer = SummaryWriter(
                    str(self._run_dir / self.log_dir),
                    purge_step=self.trainer.step + 1 if self.trainer.step else None,
                )

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        step = self.trainer.step
        if not (
            self._writer is not None
            and self.trainer.training
            and self.every
            and step % self.every == 0
        ):
            return
        # the loss of a training step; read only when written
        loss = self.trainer.last_loss
        if loss is not None:
            with writing(self._run_dir / self.log_dir):
                self._writer.add_scalar("train/step_loss", float(loss), step)
                if self.trainer.last_grad_norm is not None:
                    self._writer.add_scalar(
                        "train/step_grad_norm", self.trainer.last_grad_norm, step
                    )
                for i, lr in enumerate(self.trainer.learning_rates()):
                    self._writer.add_scalar(f"lr/group{i}", lr, step)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self._writer is None:
            return
        step = self.trainer.step
        with writing(self._run_dir / self.log_dir):
            self._writer.add_scalar("epoch", epoch, step)
            for name, value in flat_variables(epoch_data).items():
                self._writer.add_scalar(name.replace(".", "/", 1), value, step)
            self._writer.flush()

    def after_training(self, success: bool) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with writing(self._run_dir / self.log_dir):
                writer.close()


class PlotLines(_Writer):
    """A PNG learning curve per variable under `plots/`, one line per stream, drawn by a process of
    its own (see `phalanx.plots`): training goes on while it draws. At the end of training, the
    plots are complete."""

    def __init__(self, variables: list[str] | None = None, path: str = "plots"):
        self.variables, self.path = variables, path
        self.history: dict[str, list[list[float]]] = {}
        self._painter: Painter | None = None

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if not self.active:
            return
        for name, value in flat_variables(epoch_data, self.variables).items():
            self.history.setdefault(name, []).append([epoch, value])
        if self._painter is None:
            from phalanx.plots import Painter

            self._painter = Painter()
            self._say_unknown(epoch_data, self.variables)
        self._painter.submit(self._run_dir / self.path, self.history)

    def after_training(self, success: bool) -> None:
        painter, self._painter = self._painter, None
        if painter is None:
            return
        # after a signal (a preemption's grace period runs) or a failure, the run's end waits for
        # the drawing process briefly, then draws the last picture itself: the plots are whole
        stopped = self.trainer.stop_requested
        try:
            painter.close(
                self._run_dir / self.path,
                self.history,
                wait_s=1.0 if stopped or not success else None,
            )
        except StorageError as e:
            if success:
                raise
            # a failed run's own error is the one to raise
            log.error("%s", e)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = state["history"]
