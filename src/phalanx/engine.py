"""One optimizer step and one evaluation batch, written once for every strategy.

Each rank scales the sum of its per-sample losses by 1/B_k, B_k the size of the whole global batch,
and the strategy's reduction sums: the reduced gradient is exactly that of the global batch's mean
loss, for uneven shards, short last batches and gradient accumulation alike.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.data import Micro
from phalanx.model import Forward, check_loss
from phalanx.precision import Precision
from phalanx.strategies.base import Strategy

_SYNCHRONISED = contextlib.nullcontext()  # the micro-batch whose backward reduces (it holds no state)


@dataclass
class StepResult:
    loss: torch.Tensor    # the global batch's mean loss, the same on every rank
    parts: list[dict]     # this rank's inputs and outputs, one dict per micro-batch
    stop: bool            # whether any rank asked to stop


class Engine:
    def __init__(self, module: nn.Module, forward: Forward, optimizer: torch.optim.Optimizer,
                 schedulers: list[tuple[Any, str]], precision: Precision, strategy: Strategy):
        self.module, self.forward, self.optimizer = module, forward, optimizer
        self.precision, self.strategy = precision, strategy
        self._schedulers = {interval: [s for s, i in schedulers if i == interval] for interval in ("step", "epoch")}
        self.seconds = (0.0, 0.0)  # the last step's time in communication (outside backward) and the optimizer
        self.carrier, self.factor = strategy.carrier, strategy.sum_factor
        if self.carrier is not None:  # the stop flag as the carrier's gradient holds it, for either answer
            self._flags = {flag: torch.tensor(float(flag) * self.factor, dtype=self.carrier.dtype,
                                              device=self.carrier.device) for flag in (False, True)}
        self._pending_stop: tuple[torch.Tensor, Any] | None = None
        self._gradients: dict[tuple, torch.Tensor] = {}

    def train_step(self, micros: list[tuple[Micro, Mapping | None]], stop: bool = False) -> StepResult:
        """Forward, backward and update over a global batch; `stop` is this rank's wish to stop,
        agreed among ranks in the gradient reduction, with the loss."""
        if not self.module.training:  # walking the module tree every step costs more than the check
            self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        strategy, carrier = self.strategy, self.carrier
        # Where some rank's shard is empty, no rank lets backward synchronise: they reduce by hand.
        by_hand = carrier is not None and micros[0][0].any_empty
        last = len(micros) - 1
        total, parts = None, []  # total: this rank's part of the global batch's mean loss (times the factor)
        for i, (micro, batch) in enumerate(micros):
            if batch is None:
                parts.append(None)
                continue
            n = len(micro.shard)
            # (n / B) * shard mean = (1 / B) * shard sum: the shard's part of the global batch's mean,
            # times the factor by which the strategy's reduction divides
            weight = n / micro.global_size * self.factor
            sync = i == last and not by_hand
            with _SYNCHRONISED if sync else strategy.no_sync(self.module):
                loss, data = self._forward(batch, n)
                if loss.dim():  # per-sample: weight / n flows back into each sample, no mean in the graph
                    part, gradient = data["loss"].mean(), self._gradient(n, weight / n, loss)
                else:
                    part, gradient = loss.detach(), None
                    if weight != 1:
                        loss = loss * weight
                if weight != 1:
                    part = part * weight
                total = part if total is None else total + part
                carried = strategy.carry(self._carried(total, stop)) if sync and carrier is not None else None
                self.precision.backward(loss, gradient, carried)
            parts.append(data)
        clock = time.perf_counter
        t0 = t1 = clock()
        if by_hand:
            strategy.reduce_gradients(self.module, self._carried(total, stop))
            t1 = clock()
        self.precision.step(self.optimizer)
        for scheduler in self._schedulers["step"]:
            scheduler.step()
        t2 = clock()
        if carrier is None:
            loss = total
        else:  # the sums over ranks of the loss parts and of the stop flags
            loss, flags = strategy.carried().unbind()
            stop = self._agreed_stop(flags)
        self.seconds = t1 - t0, t2 - t1  # communication outside backward, the optimizer
        return StepResult(loss, parts, stop)

    def _gradient(self, n: int, value: float, like: torch.Tensor) -> torch.Tensor:
        """A vector of `n` times `value`: the gradient of the objective with respect to each
        sample's loss. Kept, since the same few shapes come back every step."""
        key = (n, value, like.dtype, like.device)
        gradient = self._gradients.get(key)
        if gradient is None:
            if len(self._gradients) > 64:
                self._gradients.clear()
            gradient = self._gradients[key] = torch.full((n,), value, dtype=like.dtype, device=like.device)
        return gradient

    def _carried(self, total: torch.Tensor | None, stop: bool) -> torch.Tensor:
        """What this rank adds to the carrier's gradient: its part of the loss and its stop flag,
        both times the factor the reduction divides by."""
        carrier = self.carrier
        if total is None:
            total = carrier.new_zeros(())
        elif total.dtype != carrier.dtype:
            total = total.to(carrier.dtype)
        return torch.stack((total, self._flags[stop]))

    def _agreed_stop(self, flags: torch.Tensor) -> bool:
        """Whether any rank asked to stop. On a GPU, reading the flag now would wait for the whole
        step to finish: it is copied to the host behind the step and read a step later, the same
        step on every rank."""
        if flags.device.type != "cuda":
            return flags.item() > 0
        pending, done = self._pending_stop, torch.cuda.Event()
        self._pending_stop = flags.to("cpu", non_blocking=True), done
        done.record()
        if pending is None:
            return False
        pending[1].synchronize()
        return pending[0].item() > 0

    def eval_step(self, batch: Mapping) -> dict:
        """Outputs of the model on an evaluation batch, gradients off."""
        if self.module.training:
            self.module.eval()
        with torch.no_grad():
            _, data = self._forward(batch, None)
        return data

    def end_epoch(self) -> None:
        for scheduler in self._schedulers["epoch"]:
            scheduler.step()

    def _forward(self, batch: Mapping, n: int | None) -> tuple[torch.Tensor, dict]:
        """The model's loss, and the batch with every output, detached, for the hooks (`loss` per
        sample)."""
        precision = self.precision
        if not precision.passes_through:
            batch = precision.convert_batch(batch)
        n = n if n is not None else _first_dim(batch)
        if precision.autocast_dtype is None:
            outputs = self.forward(batch)
        else:
            with precision.autocast():
                outputs = self.forward(batch)
        loss = outputs["loss"]
        if loss.dim() != 1 or loss.shape[0] != n:  # not one value per sample: check and reduce it
            loss = check_loss(loss, n)
        data = dict(batch)
        for key, value in outputs.items():
            if key == "loss":
                data[key] = loss.detach() if loss.dim() else loss.detach().expand(n)
            else:
                data[key] = value.detach() if isinstance(value, torch.Tensor) else value
        return loss, data

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


def _first_dim(batch: Mapping) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 1


def concat(parts: list[dict | None]) -> dict:
    """Batch data joined along the batch dimension, in order; None parts (empty shards) are skipped."""
    if len(parts) == 1:  # one micro-batch: the common case, every step
        return parts[0] or {}
    parts = [p for p in parts if p]
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            out[key] = torch.cat(values)
        elif all(isinstance(v, list) for v in values):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = values[-1]
    return out
