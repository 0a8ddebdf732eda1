"""One optimizer step and one evaluation batch, written once for every strategy.

Each rank scales the sum of its per-sample losses by 1/B_k, B_k the size of the whole global batch,
and the strategy's reduction sums: the reduced gradient is exactly that of the global batch's mean
loss, for uneven shards, short last batches and gradient accumulation alike.
"""
from __future__ import annotations

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


@dataclass
class StepResult:
    loss: torch.Tensor    # the global batch's mean loss, the same on every rank
    parts: list[dict]     # this rank's inputs and outputs, one dict per micro-batch
    stop: bool            # whether any rank asked to stop


class Engine:
    """The contract's arithmetic for one optimizer step. The strategy decides how the micro-batches'
    forward and backward run (`Strategy.forward_backward`); it calls `forward` and `backward` here."""

    def __init__(self, module: nn.Module, forward: Forward, optimizer: torch.optim.Optimizer,
                 schedulers: list[tuple[Any, str]], precision: Precision, strategy: Strategy):
        self.module, self.forward_fn, self.optimizer = module, forward, optimizer
        self.precision, self.strategy = precision, strategy
        self._schedulers = {interval: [s for s, i in schedulers if i == interval] for interval in ("step", "epoch")}
        self.seconds = (0.0, 0.0)  # the last step's time in communication (outside backward) and the optimizer
        self._gradients: dict[tuple, torch.Tensor] = {}

    def train_step(self, micros: list[tuple[Micro, Mapping | None]], stop: bool = False) -> StepResult:
        """Forward, backward and update over a global batch; `stop` is this rank's wish to stop,
        agreed among ranks with the loss."""
        if not self.module.training:  # walking the module tree every step costs more than the check
            self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts, loss, stop, communication = self.strategy.forward_backward(self, micros, stop)
        start = time.perf_counter()
        self.precision.step(self.optimizer)
        for scheduler in self._schedulers["step"]:
            scheduler.step()
        self.seconds = communication, time.perf_counter() - start
        return StepResult(loss, parts, stop)

    def forward(self, micro: Micro, batch: Mapping, scale: float, call: Forward | None = None,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict]:
        """A micro-batch's forward: the loss to back-propagate and its gradient (per sample: each
        sample's weight, 1/B times `scale`, B the global batch), the micro-batch's part of the global
        batch's mean loss (times `scale`), and its outputs, detached, for the hooks. `call` and
        `device`: another replica of the model, and where its batch goes (a strategy's towers)."""
        n = len(micro.shard)
        # (n / B) * shard mean = (1 / B) * shard sum: the shard's part of the global batch's mean,
        # times the factor by which the strategy's reduction divides
        weight = n / micro.global_size * scale
        loss, data = self._forward(batch, n, call, device)
        if not n:  # an empty shard that the strategy runs anyway (its collectives need every rank): weight 0
            return loss.sum() * 0.0, None, loss.detach().new_zeros(()), data
        if loss.dim():  # per-sample: weight / n flows back into each sample, no mean in the graph
            part, gradient = data["loss"].mean(), self._gradient(n, weight / n, loss)
        else:
            part, gradient = loss.detach(), None
            if weight != 1:
                loss = loss * weight
        if weight != 1:
            part = part * weight
        return loss, gradient, part, data

    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None, also: torch.Tensor | None = None) -> None:
        """Back-propagate a micro-batch's loss (with `also`, a scalar of the strategy's own that must
        reach its reduction through autograd, unscaled)."""
        self.precision.backward(loss, gradient, also)

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

    def eval_step(self, batch: Mapping) -> dict:
        """Outputs of the model on an evaluation batch, as the strategy runs it."""
        return self.strategy.evaluate(self, batch)

    def eval_forward(self, batch: Mapping, call: Forward | None = None, device: torch.device | None = None) -> dict:
        """Outputs of the model (or of the replica `call`, its batch on `device`) on a batch, gradients off."""
        if self.module.training:
            self.module.eval()
        with torch.no_grad():
            _, data = self._forward(batch, None, call, device)
        return data

    def end_epoch(self) -> None:
        for scheduler in self._schedulers["epoch"]:
            scheduler.step()

    def _forward(self, batch: Mapping, n: int | None, call: Forward | None = None,
                 device: torch.device | None = None) -> tuple[torch.Tensor, dict]:
        """The model's loss, and the batch with every output, detached, for the hooks (`loss` per
        sample)."""
        precision, call = self.precision, call or self.forward_fn
        if not precision.passes_through or device is not None:
            batch = precision.convert_batch(batch, device)
        n = n if n is not None else _first_dim(batch)
        if precision.autocast_dtype is None:
            outputs = call(batch)
        else:
            with precision.autocast():
                outputs = call(batch)
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
