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

Each tower draws its random numbers (dropout) from a stream of its own, seeded as ddp's rank of the
same index (see `Streams`), so that which thread runs first changes nothing.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from phalanx.build import derived_seed
from phalanx.costs import ONE_DEVICE, Measured, Setup, gpus_here
from phalanx.data import Micro
from phalanx.engine import Replica, concat
from phalanx.errors import ConfigError
from phalanx.settings import StrategySettings
from phalanx.strategies import in_worker
from phalanx.strategies.base import (
    Agreed,
    DataParallel,
    Micros,
    ModelOptions,
    OneProcess,
    Outcome,
    Replicated,
    compile_module,
    prepare,
)
from phalanx.strategies.ddp import INSTEAD
from phalanx.strategies.ddp import price as ddp_price
from phalanx.strategies.registry import PRECISION, Family, refuse, register
from phalanx.strategies.syncbn import WITH_DDP, PerDeviceStatistics

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.engine import Engine
    from phalanx.model import Forward

log = logging.getLogger("phalanx")


class Towers(OneProcess, Replicated, DataParallel):
    """One process takes each micro-batch whole (data world size 1) and shares it out among its
    towers."""

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
        self._runs: list[
            Replica
        ] = []  # each tower's adapter from a batch to its module, its device
        self._names: Forward | None = None  # the run's own adapter, whose output names hooks read
        self._training: bool | None = None
        self._streams = Streams(self.devices)

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        """The master copy on its home device, and one replica per device; with `variables_on:
        device0`, the first tower's replica is the master itself. Each tower is compiled on its
        own."""
        self.model = prepare(module, _without_compile(options), lambda m: m.to(self._home))
        for i, device in enumerate(self.devices):
            master = i == 0 and self.variables_on == "device0"
            replica = self.model if master else copy.deepcopy(self.model).to(device)
            self._replicas.append(replica)
            self._towers.append(_compile(replica, options))
        self._statistics = PerDeviceStatistics(self.model, len(self.devices), True, WITH_DDP)
        return self.model, self.model

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        self._prepare(engine, training=True)
        return super().train_step(engine, micros, stop)

    def _micro(
        self,
        engine: Engine,
        micro: Micro,
        batch: Mapping,
        total: torch.Tensor | None,
        stop: bool,
        final: bool,
    ) -> tuple[torch.Tensor, dict]:
        """The towers' shares of the micro-batch, each tower's forward and backward in its own
        thread; their gradients add up over the micro-batches, reduced after the last one."""
        done = self._run(
            lambda replica, m, b: self._tower_step(engine, replica, m, b), micro, batch
        )
        for part, _ in done:
            part = part.to(self.device)
            total = part if total is None else total + part
        assert total is not None  # a micro-batch has a sample or more
        return total, self._join_outputs([data for _, data in done])

    def _agree(self, total: torch.Tensor | None, stop: bool) -> Agreed:
        self._reduce_gradients()
        assert total is not None  # a step has one micro-batch or more
        return total, stop, 0.0, None

    @staticmethod
    def _tower_step(
        engine: Engine, replica: Replica, micro: Micro, batch: Mapping
    ) -> tuple[torch.Tensor, dict]:
        weighed = engine.forward(micro, batch, replica)
        engine.backward(weighed.loss, weighed.gradient)
        return weighed.part, weighed.data

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        self._prepare(engine, training=False)
        n = _first_dim(batch)
        done = self._run(
            lambda replica, m, b: engine.eval_forward(b, replica), Micro(list(range(n)), n), batch
        )
        return self._join_outputs(done)

    # --- the towers ---------------------------------------------------------------------------

    def _prepare(self, engine: Engine, training: bool) -> None:
        """Every replica takes the master's values and the mode asked for; the adapters are made
        once."""
        if not self._runs:
            self._names = engine.forward_fn
            self._runs = [
                Replica(engine.forward_fn.bound_to(tower), device)
                for tower, device in zip(self._towers, self.devices, strict=True)
            ]
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
        """`work(replica, micro, batch)` for each tower with a share of `batch`, each in its
        own thread; the results in tower order, which is dataset order."""
        n, jobs = len(micro.shard), []
        for i, (start, stop) in enumerate(_shares(n, len(self._towers))):
            if stop > start:
                share = Micro(micro.shard[start:stop], micro.global_size)
                jobs.append((i, self._runs[i], share, _slice(batch, start, stop, n)))
        if self._pool is None or len(jobs) == 1:
            results = [self._tower(work, *job) for job in jobs]
        else:
            futures = [self._pool.submit(self._tower, work, *job) for job in jobs]
            results = [f.result() for f in futures]
        if self._names is None:
            raise RuntimeError("towers: a batch is run before the towers are prepared")
        first = jobs[0][1].call
        assert first is not None  # each tower's replica has its own adapter (see _prepare)
        self._names.output_names = first.output_names  # what hooks read as the model's outputs
        return results

    def _tower(self, work: Callable[..., Any], i: int, replica: Replica, *share: Any) -> Any:
        """`work(replica, *share)` on tower i's device, drawing from tower i's own stream."""
        with self._streams.drawing(i):
            return _on(self.devices[i], work, replica, *share)

    # --- the towers' random streams (`Abilities`) -------------------------------

    def seed_streams(self, seed: int, step: int) -> None:
        self._streams.seed(seed, step)

    def stream_states(self) -> list[str]:
        return self._streams.states()

    def load_stream_states(self, states: list[str] | None, seed: int, step: int) -> None:
        if states is not None and len(states) == len(self.devices) - 1:
            self._streams.load(states)
            return
        self._streams.seed(seed, step)
        if len(self.devices) > 1:
            log.info(
                "each tower's random stream re-derived from the seed, the step and its index: the "
                "checkpoint holds %s, this run has %d towers",
                "no towers' streams" if states is None else f"{len(states) + 1} towers' streams",
                len(self.devices),
            )

    def _join_outputs(self, datas: list[dict]) -> dict:
        """The towers' outputs, in dataset order, on the first device."""
        device = self.device
        return concat(
            [
                {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                for d in datas
            ]
        )

    def _reduce_gradients(self) -> None:
        """Each master gradient: the sum of the replicas' (the master's own included, where it is
        a tower)."""
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


class Streams:
    """Each tower's own random stream: tower 0's is the process's (its generators, seeded and saved
    by the trainer, as one process's or ddp rank 0's), tower i's is seeded as ddp's rank i's
    (`derived_seed(seed, step, i)`), so the towers' dropout matches ddp's on as many processes.

    On CUDA each tower is a device of its own, and torch keeps one generator per device: tower i
    draws from its device's, which no other thread touches, and the towers run in parallel. (Random
    numbers a tower's model draws on the CPU still come from the process's one CPU generator.)

    On the CPU every tower draws from the one CPU generator, which nn.Dropout takes without being
    asked, and torch has no generator per thread: fork_rng and set_rng_state change it for the
    whole process. So tower i's state is kept here and swapped into that generator for the tower's
    forward and backward (whose recomputation under activation checkpointing draws again), under a
    lock: CPU towers run one at a time, each drawing from its own stream in any thread order.
    Running them at once bought little: each CPU op already uses every core."""

    def __init__(self, devices: tuple[torch.device, ...]):
        self.devices = devices
        self._on_cpu = devices[0].type != "cuda"
        self._lock = threading.Lock()
        self._cpu: list[torch.Tensor] = []  # on CPU, towers 1..N-1's generator states
        if self._on_cpu:
            self.seed(0, 0)  # until the trainer seeds them from the run's seed

    def seed(self, seed: int, step: int) -> None:
        """Towers 1..N-1's streams from the seed, the step and their index."""
        values = [derived_seed(seed, step, i) for i in range(1, len(self.devices))]
        if self._on_cpu:
            self._cpu = [torch.Generator().manual_seed(v).get_state() for v in values]
            return
        torch.cuda.init()  # torch.cuda.manual_seed before it would keep only the last device's seed
        for device, value in zip(self.devices[1:], values, strict=True):
            torch.cuda.default_generators[device.index].manual_seed(value)

    def states(self) -> list[str]:
        if self._on_cpu:
            return [_b64(state) for state in self._cpu]
        return [_b64(torch.cuda.get_rng_state(device)) for device in self.devices[1:]]

    def load(self, states: list[str]) -> None:
        if self._on_cpu:
            self._cpu = [_unb64(state) for state in states]
            return
        for device, state in zip(self.devices[1:], states, strict=True):
            torch.cuda.set_rng_state(_unb64(state), device)

    @contextlib.contextmanager
    def drawing(self, tower: int) -> Iterator[None]:
        """Tower `tower`'s random numbers drawn from its own stream while the block runs."""
        if not self._on_cpu:
            yield
            return
        with self._lock:
            if tower == 0:
                yield
                return
            process = torch.get_rng_state()
            torch.set_rng_state(self._cpu[tower - 1])
            try:
                yield
            finally:
                self._cpu[tower - 1] = torch.get_rng_state()
                torch.set_rng_state(process)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _without_compile(options: ModelOptions) -> ModelOptions:
    import dataclasses

    return dataclasses.replace(options, compile=None)


def _compile(tower: nn.Module, options: ModelOptions) -> nn.Module:
    if options.compile is None:
        return tower
    return compile_module(tower, options.compile)


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
    """Samples start..stop of a batch: tensors and lists along their first dimension, other values
    whole."""
    out: dict[Any, Any] = {}
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


# --- the strategy as the config names it ---------------------------------------------------


class TowersSettings(StrategySettings):
    """`parallel.towers`: settings of the `towers` strategy."""

    variables_on: Literal["device0", "cpu"] = Field(
        "device0",
        description="where the master copy of the variables lives and the optimizer steps: on the "
        "first device (which is also the first tower), or on the CPU",
    )


def build(cfg: Config, accelerator: str, devices: int) -> Towers:
    if in_worker():
        raise ConfigError(
            "parallel.strategy=towers drives every device from one process, but this is one of "
            "several processes; start phalanx without torchrun, or use parallel.strategy=ddp"
        )
    refuse(
        "towers",
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            PRECISION: cfg.precision == "fp16",
        },
        INSTEAD,
    )
    count = (
        [torch.device(accelerator, i) for i in range(devices)]
        if accelerator == "cuda"
        else [torch.device("cpu")] * devices
    )
    return Towers(count, cfg.parallel.section("towers", TowersSettings).variables_on)


def _unplanned(m: Measured, devices: int) -> str | None:
    if devices < 2:
        return ONE_DEVICE
    if m.gpus < 2:
        return f"it drives several GPUs from one process, and {gpus_here(m)}"
    return None


register(
    Family(
        "towers",
        build,
        "one process driving every device, a replica on each, in threads",
        settings=TowersSettings,
        field=Field(default_factory=TowersSettings, description="the towers'"),
        # priced as ddp's all-reduce, the sum made by the one process
        setups=lambda m, devices: [
            Setup("towers", n) for n in range(2, devices + 1) if m.gpus >= n
        ],
        cost=ddp_price,
        unplanned=_unplanned,
    )
)
