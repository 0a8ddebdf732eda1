"""Checkpoints written in the background (`checkpoints.async: true`): the state copied to host
memory, then written and committed by a thread of its own while training goes on."""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint import Checkpoints, saves_shards

log = logging.getLogger("phalanx")


class Background:
    """Checkpoints written by a thread of their own, one at a time: `submit` waits for the one in
    flight (raising its error, if it failed), then hands the writer a copy of the state in host
    memory, so that training goes on while the files are written. A step is committed as every
    step is (manifest, rename): a process killed during the write leaves no trace of it."""

    def __init__(self, checkpoints: Checkpoints, committed: Callable[[int, bool], None]):
        self.checkpoints, self.committed = checkpoints, committed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def for_run(
        cls, checkpoints: Checkpoints, strategy: Any, committed: Callable[[int, bool], None]
    ) -> Background | None:
        """The writer for a run's checkpoints under `strategy`: a thread on the main process, where
        the whole state is gathered there; none where every rank writes its own shards (they are
        saved as they are taken) and on the other processes."""
        if saves_shards(strategy):
            log.info(
                "checkpoints.async: every rank writes its own shards at once; they are saved "
                "as they are taken"
            )
            return None
        return cls(checkpoints, committed) if strategy.is_main else None

    def submit(
        self,
        step: int,
        weights: nn.Module | dict[str, torch.Tensor],
        optimizer_state: dict,
        trainer_state: dict,
        best: dict | None = None,
    ) -> Path:
        self.wait()
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        staged = (
            _host_copy(weights),
            _host_copy(optimizer_state),
            json.loads(json.dumps(trainer_state)),
        )
        self._thread = threading.Thread(
            target=self._write, args=(step, *staged, best), name="phalanx-checkpoint"
        )
        self._thread.start()
        return self.checkpoints.path(step)

    def wait(self) -> None:
        """Until the write in flight is committed; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(
        self,
        step: int,
        weights: dict,
        optimizer_state: dict,
        trainer_state: dict,
        best: dict | None,
    ) -> None:
        try:
            self.checkpoints.save(step, weights, optimizer_state, trainer_state, best)
            self.committed(step, best is not None)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread, at the next save or the end
            self._error = e


def _host_copy(value: Any) -> Any:
    """`value` with every tensor copied to CPU memory (a copy where it is on the CPU already)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)
