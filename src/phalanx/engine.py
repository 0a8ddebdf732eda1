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
from phalanx.model import Forward, shard_loss_mean
from phalanx.precision import Precision
from phalanx.strategies.base import Strategy


@dataclass
class StepResult:
    loss: torch.Tensor    # the global batch's mean loss, the same on every rank
    parts: list[dict]     # this rank's inputs and outputs, one dict per micro-batch
    stop: bool            # whether any rank asked to stop


class Engine:
    def __init__(self, module: nn.Module, forward: Forward, optimizer: torch.optim.Optimizer,
                 schedulers: list[tuple[Any, str]], precision: Precision, strategy: Strategy):
        self.module, self.forward, self.optimizer = module, forward, optimizer
        self.schedulers, self.precision, self.strategy = schedulers, precision, strategy
        self.seconds = (0.0, 0.0)  # the last step's time in communication (outside backward) and the optimizer

    def train_step(self, micros: list[tuple[Micro, Mapping | None]], stop: bool = False) -> StepResult:
        """Forward, backward and update over a global batch; `stop` is this rank's wish to stop,
        agreed among ranks in the same reduction as the loss."""
        if not self.module.training:  # walking the module tree every step costs more than the check
            self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Where some rank's shard is empty, no rank lets backward synchronise: they reduce by hand.
        by_hand = any(micro.any_empty for micro, _ in micros)
        total, parts = None, []
        for i, (micro, batch) in enumerate(micros):
            if batch is None:
                parts.append(None)
                continue
            sync = i == len(micros) - 1 and not by_hand
            n = len(micro.shard)
            with contextlib.nullcontext() if sync else self.strategy.no_sync(self.module):
                mean, data = self._forward(batch, n)
                # (n / B) * shard mean = (1 / B) * shard sum: the shard's part of the global batch's mean
                self.precision.backward(mean if n == micro.global_size else mean * (n / micro.global_size))
            loss_sum = mean.detach() * n
            total = loss_sum if total is None else total + loss_sum
            parts.append(data)
        t0 = time.perf_counter()
        if by_hand:
            self.strategy.reduce_gradients(self.module)
        t1 = time.perf_counter()
        self.precision.step(self.optimizer)
        for scheduler, interval in self.schedulers:
            if interval == "step":
                scheduler.step()
        t2 = time.perf_counter()
        loss, stop = self._agree(total, micros[0][0].global_size, stop)
        t3 = time.perf_counter()
        self.seconds = (t1 - t0) + (t3 - t2), t2 - t1  # communication outside backward, optimizer
        return StepResult(loss, parts, stop)

    def _agree(self, total: torch.Tensor | None, global_size: int, stop: bool) -> tuple[torch.Tensor, bool]:
        if self.strategy.world_size == 1:
            return total / global_size, stop
        if total is None:  # every shard of this rank was empty: it joins with zero weight
            total = torch.zeros((), device=self.strategy.device)
        both = self.strategy.reduce(torch.stack([total.double(), torch.tensor(float(stop), dtype=torch.float64,
                                                                                  device=total.device)]))
        return both[0] / global_size, bool(both[1] > 0)

    def eval_step(self, batch: Mapping) -> dict:
        """Outputs of the model on an evaluation batch, gradients off."""
        if self.module.training:
            self.module.eval()
        with torch.no_grad():
            _, data = self._forward(batch, None)
        return data

    def end_epoch(self) -> None:
        for scheduler, interval in self.schedulers:
            if interval == "epoch":
                scheduler.step()

    def _forward(self, batch: Mapping, n: int | None) -> tuple[torch.Tensor, dict]:
        batch = self.precision.convert_batch(batch)
        n = n if n is not None else _first_dim(batch)
        with self.precision.autocast():
            outputs = self.forward(batch)
        mean = shard_loss_mean(outputs["loss"], n)
        data = dict(batch)
        for key, value in outputs.items():
            data[key] = value.detach() if isinstance(value, torch.Tensor) else value
        if data["loss"].dim() == 0:
            data["loss"] = data["loss"].expand(n)
        return mean, data

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


def _first_dim(batch: Mapping) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 1


def concat(parts: list[dict | None]) -> dict:
    """Batch data joined along the batch dimension, in order; None parts (empty shards) are skipped."""
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
