"""`towers`: one process drives several devices, each running a replica of the model (a tower) on
its share of every micro-batch, in a thread of its own.

The master copy of the variables, and the optimizer that steps it, stay in one place:
`parallel.towers.variables_on: device0` (on the first device, which is also the first tower) or
`cpu` (TensorFlow's central storage). Each step the towers take the master's values, run their
shares (contiguous, in dataset order), and their gradients are added into the master's: every
sample weighs 1/B of the global batch, whichever tower ran it, so the sum is the global batch's
gradient. Outputs come back concatenated in dataset order, on the first device.

No process is started and no collective runs: it works from a notebook. On a machine without
GPUs, `accelerator: cpu, devices: N` runs N replicas on the CPU, for tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.data import Micro
from phalanx.engine import concat
from phalanx.strategies.base import Micros, ModelOptions, OneProcess, Replicated, prepare

if TYPE_CHECKING:
    from phalanx.engine import Engine
    from phalanx.model import Forward


class Towers(OneProcess, Replicated):
    """One process takes each micro-batch whole (data world size 1) and shares it out among its towers."""

    def __init__(self, devices: list[torch.device], variables_on: str = "device0"):
        self.devices, self.device = tuple(devices), devices[0]
        self.variables_on = variables_on
        self._home = self.device if variables_on == "device0" else torch.device("cpu")
        self._pool = (
            ThreadPoolExecutor(len(devices), thread_name_prefix="phalanx-tower")
            if len(devices) > 1
            else None
        )
        self._replicas: list[
            nn.Module
        ] = []  # each tower's module (the master itself for tower 0 on device0)
        self._towers: list[
            nn.Module
        ] = []  # what each tower calls: its replica, compiled where asked
        self._calls: list[Forward] = []  # each tower's adapter from a batch to its module
        self._names: Forward | None = None  # the run's own adapter, whose output names hooks read
        self._training: bool | None = None

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        """The master copy on its home device, and one replica per device; with `variables_on:
        device0`, the first tower's replica is the master itself. Each tower is compiled on its own."""
        self.model = prepare(module, _without_compile(options), lambda m: m.to(self._home))
        for i, device in enumerate(self.devices):
            master = i == 0 and self.variables_on == "device0"
            replica = self.model if master else copy.deepcopy(self.model).to(device)
            self._replicas.append(replica)
            self._towers.append(_compiled(replica, options))
        return self.model, self.model

    def forward_backward(
        self, engine: Engine, micros: Micros, stop: bool
    ) -> tuple[list[dict | None], torch.Tensor, bool, float]:
        self._prepare(engine, training=True)
        total, parts = None, []
        for micro, batch in micros:  # the replicas' gradients add up over the micro-batches
            done = self._run(
                lambda call, device, m, b: self._tower_step(engine, call, device, m, b),
                micro,
                batch,
            )
            for part, _ in done:
                part = part.to(self.device)
                total = part if total is None else total + part
            parts.append(self._joined([data for _, data in done]))
        self._reduce_gradients()
        return parts, total, stop, 0.0

    @staticmethod
    def _tower_step(
        engine: Engine, call: Forward, device: torch.device, micro: Micro, batch: Mapping
    ) -> tuple[torch.Tensor, dict]:
        loss, gradient, part, data = engine.forward(micro, batch, 1.0, call, device)
        engine.backward(loss, gradient)
        return part, data

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        self._prepare(engine, training=False)
        n = _first_dim(batch)
        done = self._run(
            lambda call, device, m, b: engine.eval_forward(b, call, device),
            Micro(list(range(n)), n),
            batch,
        )
        return self._joined(done)

    # --- the towers ---------------------------------------------------------------------------

    def _prepare(self, engine: Engine, training: bool) -> None:
        """Every replica takes the master's values and the mode asked for; the adapters are made once."""
        if not self._calls:
            self._names = engine.forward_fn
            self._calls = [engine.forward_fn.bound_to(tower) for tower in self._towers]
        master = [*self.model.parameters(), *self.model.buffers()]
        with torch.no_grad():
            for replica in self._replicas:
                if replica is self.model:
                    continue
                for mine, theirs in zip(
                    [*replica.parameters(), *replica.buffers()], master, strict=True
                ):
                    mine.copy_(theirs, non_blocking=True)
                for p in replica.parameters():
                    p.grad = None
        if training != self._training:
            for replica in self._replicas:
                replica.train(training)
            self._training = training

    def _run(self, work: Callable[..., Any], micro: Micro, batch: Mapping) -> list[Any]:
        """`work(call, device, micro, batch)` for each tower with a share of `batch`, each in its own
        thread; the results in tower order, which is dataset order."""
        n, jobs = len(micro.shard), []
        for i, (start, stop) in enumerate(_shares(n, len(self._towers))):
            if stop > start:
                share = Micro(micro.shard[start:stop], micro.global_size)
                jobs.append((self._calls[i], self.devices[i], share, _slice(batch, start, stop, n)))
        if self._pool is None or len(jobs) == 1:
            results = [_on(device, work, call, device, m, b) for call, device, m, b in jobs]
        else:
            futures = [
                self._pool.submit(_on, device, work, call, device, m, b)
                for call, device, m, b in jobs
            ]
            results = [f.result() for f in futures]
        self._names.output_names = jobs[0][
            0
        ].output_names  # what the hooks read as the model's outputs
        return results

    def _joined(self, datas: list[dict]) -> dict:
        """The towers' outputs, in dataset order, on the first device."""
        device = self.device
        return concat(
            [
                {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                for d in datas
            ]
        )

    def _reduce_gradients(self) -> None:
        """Each master gradient: the sum of the replicas' (the master's own included, where it is a tower)."""
        others = [list(r.parameters()) for r in self._replicas if r is not self.model]
        for i, p in enumerate(self.model.parameters()):
            for grads in others:
                g = grads[i].grad
                if g is None:
                    continue
                g = g.to(p.device, non_blocking=True)
                p.grad = g if p.grad is None else p.grad.add_(g)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _without_compile(options: ModelOptions) -> ModelOptions:
    import dataclasses

    return dataclasses.replace(options, compile=None)


def _compiled(tower: nn.Module, options: ModelOptions) -> nn.Module:
    if options.compile is None:
        return tower
    return torch.compile(tower, backend=options.compile.backend, mode=options.compile.mode)


def _on(device: torch.device, work: Callable[..., Any], *args: Any) -> Any:
    """`work(*args)` with `device` as the current CUDA device of this thread."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return work(*args)
    return work(*args)


def _shares(n: int, towers: int) -> list[tuple[int, int]]:
    """Contiguous shares of n samples, in order: the first n % towers get one more."""
    base, extra = divmod(n, towers)
    bounds, start = [], 0
    for i in range(towers):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _slice(batch: Mapping, start: int, stop: int, n: int) -> dict:
    """Samples start..stop of a batch: tensors and lists along their first dimension, other values whole."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            out[key] = value[start:stop]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = value[start:stop]
        else:
            out[key] = value
    return out


def _first_dim(batch: Mapping) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
        if isinstance(value, (list, tuple)):
            return len(value)
    return 1
