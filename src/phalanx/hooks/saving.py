"""Checkpoint hooks: SaveEvery, SaveBest, SaveLatest. All write through the trainer, which keeps the
last `checkpoints.keep_last` steps and the best one."""

from __future__ import annotations

from typing import Any

from phalanx.errors import ConfigError
from phalanx.hooks.base import Hook, reads_no_loss
from phalanx.hooks.variables import (
    check_computed,
    check_mode,
    improved,
    lookup,
    saved,
    split_name,
)


class SaveEvery(Hook):
    """Save every `epochs` epochs, or every `steps` optimizer steps."""

    reads_loss = reads_no_loss

    gathers = False
    reads_epoch_only = True

    def __init__(self, epochs: int | None = 1, steps: int | None = None):
        if steps is not None:
            epochs = None
        if (epochs or 0) < 1 and (steps or 0) < 1:
            raise ConfigError(
                f"SaveEvery: give epochs >= 1 or steps >= 1 (got epochs={epochs}, steps={steps})"
            )
        self.epochs, self.steps = epochs, steps

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if self.steps and self.trainer.training and self.trainer.step % self.steps == 0:
            self.trainer.save_checkpoint()

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self.epochs and epoch and epoch % self.epochs == 0:
            self.trainer.save_checkpoint()


class SaveLatest(Hook):
    """Save after every epoch and when training ends, so that the latest state can resume."""

    reads_epoch_only = True

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if epoch:
            self.trainer.save_checkpoint()

    def after_training(self, success: bool) -> None:
        if success:
            self.trainer.save_checkpoint()


class SaveBest(Hook):
    """Save when `variable` (STREAM.VARIABLE) reaches its best value so far."""

    reads_epoch_only = True

    def __init__(self, variable: str = "valid.loss", mode: str = "min"):
        split_name(variable, "SaveBest")
        self.variable, self.mode = variable, check_mode(mode, "SaveBest")
        self.best: float | None = None

    def before_training(self) -> None:
        check_computed(self.variable, "SaveBest", self)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        value = lookup(epoch_data, self.variable, "SaveBest")
        if epoch and improved(value, self.best, self.mode):
            self.best = value
            self.trainer.save_checkpoint(
                best={"variable": self.variable, "value": value, "epoch": epoch}
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = saved(state, "best", "SaveBest", (float, int))
