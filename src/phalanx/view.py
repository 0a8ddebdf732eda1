"""What hooks see of a run: its state, read-only, its strategy's collectives, and the two things a
hook may ask of it (save a checkpoint, agree on a flag across ranks).

Hooks hold this view as `self.trainer`; they never import the trainer, and cannot change its
counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.losses import Later
    from phalanx.strategies.base import Strategy


class RunView:
    """A read-only view of one run (a `Trainer`), for its hooks."""

    __slots__ = ("_run",)

    def __init__(self, run: Any):
        self._run = run

    # --- where the run is
    @property
    def epoch(self) -> int:
        """Epochs finished."""
        return self._run.epoch

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self._run.step

    @property
    def rounds(self) -> int:
        """Evaluation rounds begun (with `main_loop.eval_every_n_steps`: one every N steps; their
        number is the `epoch` that after_epoch receives)."""
        return self._run.rounds

    @property
    def step_in_epoch(self) -> int:
        """Optimizer steps done in the epoch in progress."""
        return self._run.step_in_epoch

    @property
    def steps_per_epoch(self) -> int:
        return self._run.steps_per_epoch

    def stream_batches(self, name: str) -> int | None:
        """Batches in one evaluation of stream `name` (None where the stream does not say its
        length)."""
        from phalanx.data import stream_length

        run = self._run
        n = stream_length(run.stream(name))
        size = run.cfg.dataset.eval_batch_size or run.cfg.dataset.batch_size
        return None if n is None else -(-n // size)

    @property
    def training(self) -> bool:
        """Whether the batch that `after_batch` sees came from an optimizer step (not an
        evaluation)."""
        return self._run.training

    @property
    def stop_requested(self) -> bool:
        """Whether a signal (or the launcher, on one's behalf) asked the run to save and stop."""
        return self._run.stop.requested

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The last step's global mean loss, a tensor on the device. Where the ranks agree on it
        behind the step (the pipeline), reading it waits for them: read it when it is needed, at
        the steps the hook's `reads_loss` names (the pipeline agrees on the steps between in one
        message)."""
        return self._run.last_loss

    @property
    def last_loss_later(self) -> Later | None:
        """The last step's loss, to read later (None before the epoch's first step): its `sent`
        says whether the processes' agreement on it has been sent, after which its `read()` waits
        at most for it to arrive, on one process or on all. For a hook that checks each step's
        loss without ending the pipeline's windows of steps agreed on together: keep it, and read
        it once sent (by the epoch's end, and before an evaluation round, every step's has been).
        Elsewhere it is sent with its step."""
        return self._run.losses.later()

    @property
    def epoch_loss(self) -> torch.Tensor | None:
        """The mean of this epoch's training step losses so far (None before its first step);
        reading it waits for the last step's, as `last_loss`."""
        return self._run.epoch_loss

    @property
    def epoch_loss_so_far(self) -> torch.Tensor | None:
        """`epoch_loss` over the steps whose agreement among the processes has been sent, without
        sending the rest: what a display shows. The pipeline sends several steps' agreements as
        one message (`Hook.reads_loss`), so that its mean may lag the last steps; elsewhere it is
        `epoch_loss`."""
        return self._run.epoch_loss_so_far

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None unless optimizer.max_grad_norm
        is set)."""
        return self._run.engine.norms.last

    @property
    def last_batch_size(self) -> int:
        """Samples in the last batch, over every process."""
        return self._run.last_batch_size

    @property
    def profile(self) -> dict[str, float]:
        """Seconds this process spent so far in the run, by part of the loop, up to the last
        step (a copy)."""
        return self._run.times_so_far()

    def learning_rates(self) -> list[float]:
        """The optimizer's current learning rate of each parameter group."""
        return self._run.engine.learning_rates()

    # --- what the run is
    @property
    def cfg(self) -> Config:
        return self._run.cfg

    @property
    def run_dir(self) -> Path | None:
        return self._run.run_dir

    @property
    def search_dirs(self) -> list[Path]:
        """Where the config's classes are imported from."""
        return list(self._run.search_dirs)

    @property
    def strategy(self) -> Strategy:
        """Topology and collectives: rank, world size, `is_main`, reduce, gather, broadcast."""
        return self._run.strategy

    @property
    def model(self) -> nn.Module:
        """The user's module (its parameters are the live ones: read them, do not change them)."""
        return self._run.model

    @property
    def output_names(self) -> tuple[str, ...]:
        """The names of the model's outputs in a batch (the rest are the batch's own values)."""
        return tuple(self._run.forward.output_names)

    def first_samples(self, n: int) -> Mapping[str, Any]:
        """The training stream's first `n` samples (fewer where it is shorter) as one batch, as the
        dataset gives them: a batch to measure the model on (in the batch after_batch sees, a model
        output of an input's name has taken the input's place)."""
        return self._run.feed.first_samples(n)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this process holds (its shards,
        where the strategy shards them): see `metrics.state_bytes`."""
        from phalanx import metrics

        return metrics.state_bytes(self._run.model, self._run.optimizer)

    def computed_before(self, hook: object, stream: str) -> set[str] | None:
        """The variables `epoch_data[stream]` holds when `hook`'s after_epoch reads it: the run's
        own (the gradient norms, where it clips them) and those the hooks listed before it compute
        (`Hook.computes`); None where one of those cannot say."""
        from phalanx.engine import GradNorms

        run = self._run
        clips = stream == "train" and run.engine.max_grad_norm is not None
        known = set(GradNorms.NAMES if clips else ())
        for other in run.calls.hooks:
            if other is hook:
                break
            names = other.computes(stream)
            if names is None:
                return None
            known.update(names)
        return known

    # --- what a hook may ask
    def save_checkpoint(self, best: dict | None = None) -> Path | None:
        """Save the run's state at this step (every rank calls it; the main process writes)."""
        return self._run.save_checkpoint(best)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (every rank must call it at the same point)."""
        return self._run.any_rank(flag)
