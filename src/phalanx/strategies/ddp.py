"""`ddp`: one process per device; gradients reduced by DistributedDataParallel's bucketed,
overlapped all-reduce.

Each rank scales its local loss sum by 1/B_k (B_k the global batch), so the reduction must *sum*.
DDP's built-in reduction averages, so each rank also multiplies its objective by the world size (the
scale of its `Replica`). Gradients are views into DDP's buckets
(`gradient_as_bucket_view`): no copy back after each reduction, and no second copy of them in
memory.

Beside the model sits the carrier, a four-element parameter whose gradient is the rank's share of
the loss (a weighted loss's two sums: of w_i l_i and of w_i), whether the loss is weighted, and its
stop flag: DDP adds it over ranks with the gradients, so every rank learns the global loss and
whether any rank asked to stop without a collective of its own. Its gradient is written directly and
DDP's reducer told it is ready, so it costs the step no autograd work; where the installed torch
lacks that entry point, the carrier reaches the reducer through autograd instead. Steps where some
rank's shard is empty skip DDP's reducer on every rank and reduce by hand instead, so that rank can
join with zero weight without running its model.

On CPUs the reducer's wait for the gradient all-reduce, which blocks the process at the end of
backward, moves out of backward: a communication hook starts each bucket's reduction and hands the
bucket back at once (`_reduce_later`), and the step reads its next batch (`meanwhile`) before it
waits for the reductions, ahead of the optimizer's step. The sums are the reducer's own, so the
training is the same to the bit; the wait is the step's communication in the profile. On GPUs the
reducer waits by itself: its wait only orders the GPU's streams.

The process group, its collectives and the naming of hung ranks are `distributed.ProcessGroup`'s.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import Field, StrictFloat
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.costs import (
    ONE_DEVICE,
    Measured,
    Prediction,
    Setup,
    link_of,
    made,
    mb_text,
    ms,
    rate,
    whole_bytes,
)
from phalanx.engine import Replica
from phalanx.errors import ConfigError
from phalanx.settings import StrategySettings
from phalanx.strategies import in_worker
from phalanx.strategies.base import (
    Agreed,
    DataParallel,
    Micros,
    ModelOptions,
    Outcome,
    Replicated,
    prepare,
)
from phalanx.strategies.distributed import ProcessGroup, sum_gradients
from phalanx.strategies.pricing import compute_of
from phalanx.strategies.registry import Family, get, register
from phalanx.strategies.syncbn import PerDeviceStatistics, convert_sync_batchnorm

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.data import Micro
    from phalanx.engine import Engine

_SYNCHRONISE_BATCHNORM = "set parallel.sync_batchnorm: true to normalise over the whole micro-batch"
# the micro-batch whose backward reduces (it holds no state)
_SYNCHRONISED = contextlib.nullcontext()


class _Carried(nn.Module):
    """The user's module and, beside it, the carrier (see the module's docstring). The carrier is
    this module's own parameter, so it comes first in `parameters()`: DDP's reducer knows it as
    parameter 0.

    Calling it calls the user's module, as a call of that module: this wrapper has no hooks of
    its own to run, and every step would pay for a second module call and an attribute lookup."""

    _inner: nn.Module

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.module = module
        self.carrier = nn.Parameter(torch.zeros(4, dtype=dtype, device=device))
        # the same module, found as a plain attribute (not one of the registered children)
        object.__setattr__(self, "_inner", module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner(*args, **kwargs)

    __call__ = forward


def _reduce_later(in_flight, bucket):
    """DDP's reduction of a bucket (its average over ranks, in place), started and left running:
    the reducer takes the bucket as it is, and the step waits for the reduction (`DDP._agree`)
    before anything reads a gradient. On the CPU, where waiting inside backward would block the
    process, the step can read its next batch meanwhile. (Unannotated: DDP checks a hook's
    annotations against its own types, which this module's postponed annotations are not.)"""
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size())  # as the reducer divides, to the bit
    in_flight.append(dist.all_reduce(tensor, async_op=True))
    done = torch.futures.Future()
    done.set_result(tensor)
    return done


def _carrier_dtype(module: nn.Module) -> torch.dtype:
    """The parameters' dtype, so that the carrier shares their bucket; float32 where that is a
    16-bit type, which would round the loss to 3 digits."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class DDP(ProcessGroup, Replicated, DataParallel):
    carrier: nn.Parameter  # made by `setup`, beside the user's module
    # where the agreed values are read behind the step (on a GPU: see `_agreed_stop`)
    _reads_behind = False

    def __init__(
        self,
        accelerator: str,
        timeout_s: float | None = None,
        sync_batchnorm: bool = False,
        carry_through_autograd: bool = False,
        backend: str = "auto",
        bucket_cap_mb: float | None = None,
        wait_in_backward: bool | None = None,
    ):
        """`carry_through_autograd`: carry the step's loss and stop flag to the reducer through
        autograd, as on a torch without the reducer's direct entry point (for tests). `backend`:
        nccl or gloo; auto picks nccl on GPUs and gloo on CPUs. `bucket_cap_mb`: DDP's gradient
        bucket size. `wait_in_backward`: the gradient all-reduce waited for inside backward, as
        DDP's reducer does by itself; by default only on GPUs, where that wait does not hold the
        process up (on CPUs the step reads its next batch while the reduction runs)."""
        super().__init__(accelerator, timeout_s, backend)
        self.wait_in_backward = (
            self.device.type == "cuda" if wait_in_backward is None else wait_in_backward
        )
        self.carry_through_autograd = carry_through_autograd
        self.sync_batchnorm, self.bucket_cap_mb = sync_batchnorm, bucket_cap_mb
        # DDP averages: each rank's objective times the world size sums
        self.scale = float(self.world_size)
        self.replica = Replica(scale=self.scale)
        self._by_hand = False  # whether this step reduces by hand (some rank's shard is empty)
        self._reads_behind = self.device.type == "cuda"
        self._ddp: DistributedDataParallel | None = None
        # the reducer's "this gradient is ready"
        self._mark_ready: Callable[[int], None] | None = None
        # on the CPU: the step's bucket all-reduces in flight, and what to do while they run
        self._in_flight: list[Any] = []
        self._read_ahead: Callable[[], None] | None = None

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module
        return prepare(module, options, self._wrap), self.model

    def _wrap(self, module: nn.Module) -> nn.Module:
        module = module.to(self.device)
        self.progress.enter("the broadcast of the initial parameters")
        if self.sync_batchnorm:
            module = self.model = convert_sync_batchnorm(module)
        self._statistics = PerDeviceStatistics(
            module, self.world_size, self.is_main, _SYNCHRONISE_BATCHNORM
        )
        carried = _Carried(module, _carrier_dtype(module), self.device)
        # DDP broadcasts rank 0's parameters and buffers at construction; buffers are not
        # re-broadcast every forward, so a rank that skips a forward never stalls the others.
        # its successor still syncs buffers at init, which is what we want
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*broadcast_buffers.*", category=FutureWarning
            )
            extra: dict[str, Any] = (
                {} if self.bucket_cap_mb is None else {"bucket_cap_mb": self.bucket_cap_mb}
            )
            ddp = DistributedDataParallel(
                carried,
                device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
                **extra,
            )
        self.check_identical(module)
        self.carrier = carried.carrier
        self._ddp = ddp
        self._rows = self._carried_rows()
        self._pending_stop: tuple[torch.Tensor, Any] | None = None
        # A private entry point, the one DDP's own mixed precision uses when autograd does not reach
        # the reducer. Without it, `carry` goes through autograd: the same values, more work per
        # step.
        self._mark_ready = (
            None if self.carry_through_autograd else getattr(ddp.reducer, "_autograd_hook", None)
        )
        if not self.wait_in_backward:
            ddp.register_comm_hook(self._in_flight, _reduce_later)
        return ddp

    def meanwhile(self, read_ahead: Callable[[], None] | None) -> None:
        self._read_ahead = read_ahead

    @property
    def _wrapper(self) -> DistributedDataParallel:
        """DDP's wrapper around the user's module, which `setup` made."""
        if self._ddp is None:
            raise RuntimeError("the ddp strategy's setup() has not run: it has no module to train")
        return self._ddp

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        """Every micro-batch but the last runs without synchronising; the last one's backward
        reduces the gradients and, through the carrier, the loss and the stop flag. Where some
        rank's shard is empty, no rank lets backward synchronise: they reduce by hand, and a rank
        with nothing to do joins with zero weight without running its model."""
        self._by_hand = micros[0][0].any_empty
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
        with _SYNCHRONISED if final and not self._by_hand else self._wrapper.no_sync():
            return super()._micro(engine, micro, batch, total, stop, final)

    def _in_backward(self, total: torch.Tensor, stop: bool) -> torch.Tensor | None:
        return None if self._by_hand else self._carry(self._values(total, stop))

    def _agree(self, total: torch.Tensor | None, stop: bool) -> Agreed:
        communication = 0.0
        if self._by_hand:
            start = time.perf_counter()
            self._reduce_by_hand(self._values(total, stop))
            communication = time.perf_counter() - start
        in_flight = self._in_flight
        if in_flight:  # on the CPU: the next step's batch read while the gradients are reduced
            try:
                if self._read_ahead is not None:
                    self.progress.what = "reading the next batch, the gradient all-reduce running"
                    self._read_ahead()
                    self.progress.what = "the gradient all-reduce"
            finally:  # (an interruption too: no reduction is left behind)
                start = time.perf_counter()
                try:
                    for work in in_flight:
                        work.wait()
                finally:
                    in_flight.clear()
                communication = time.perf_counter() - start
        # the sums over ranks of the loss parts, weighted flags and stop flags
        carried = self.carrier.grad
        assert carried is not None  # the step's backward, or its reduction by hand, has set it
        # a rank knows whether the loss is weighted from its own forward, unless it ran none this
        # step (None: it did not)
        own = None if self._by_hand or total is None else total.dim() > 0
        if self._reads_behind:
            # a copy: the gradient is a view into DDP's bucket, which the next step overwrites
            carried = carried.clone()
            weighted = bool(carried[2] > 0) if own is None else own
            loss = carried[:2] if weighted else carried[0]
            return loss, self._agreed_stop(carried[3]), communication, None
        # on the CPU the four values are read at once, and the loss is a tensor of its own
        values = carried.tolist()
        weighted = values[2] > 0 if own is None else own
        loss = (
            torch.tensor(values[:2], dtype=carried.dtype)
            if weighted
            else torch.scalar_tensor(values[0], dtype=carried.dtype)
        )
        return loss, values[3] > 0, communication, None

    def _carried_rows(self) -> dict[tuple[bool, bool], tuple[torch.Tensor, torch.Tensor]]:
        """The carrier's gradient as this rank gives it, by (weighted, stop flag), times the scale:
        (loss part, weight 0, not weighted, flag) for a plain loss, (the weighted loss's two sums,
        weighted, flag) for a weighted one; each with its view where the step's loss part goes.
        Written in place every step: the reducer copies the gradient into its bucket when it is
        marked ready."""
        rows = {}
        for weighted in (False, True):
            for flag in (False, True):
                row = torch.tensor(
                    [
                        0.0,
                        *([0.0, self.scale] if weighted else [0.0, 0.0]),
                        float(flag) * self.scale,
                    ],
                    dtype=self.carrier.dtype,
                    device=self.device,
                )
                rows[weighted, flag] = row, row[:2] if weighted else row[0]
        return rows

    def _values(self, total: torch.Tensor | None, stop: bool) -> torch.Tensor:
        """What this rank adds to the carrier's gradient: its part of the loss, whether it is
        weighted, and its stop flag, all times the scale the reduction divides by."""
        if total is None:
            row, part = self._rows[False, stop]
            part.zero_()
        else:
            row, part = self._rows[total.dim() > 0, stop]
            part.copy_(total)  # in the carrier's dtype
        return row

    def _agreed_stop(self, flags: torch.Tensor) -> bool:
        """Whether any rank asked to stop, on a GPU: reading the flag now would wait for the whole
        step to finish, so it is copied to the host behind the step and read a step later, the
        same step on every rank."""
        pending, done = self._pending_stop, torch.cuda.Event()
        self._pending_stop = flags.to("cpu", non_blocking=True), done
        done.record()
        if pending is None:
            return False
        pending[1].synchronize()
        return pending[0].item() > 0

    def _carry(self, values: torch.Tensor) -> torch.Tensor | None:
        """The values become the carrier's gradient. Called between a synchronising forward and its
        backward, when the reducer expects every gradient; marking the carrier ready there costs no
        autograd work (it must not be marked twice: DDP's `find_unused_parameters` would)."""
        carrier = self.carrier
        self.progress.enter("the gradient all-reduce")
        if self._mark_ready is None:
            carrier.grad = None
            return torch.dot(carrier, values)
        carrier.grad = values
        self._mark_ready(0)  # the carrier's index in the reducer (see _Carried)
        return None

    def _reduce_by_hand(self, values: torch.Tensor) -> None:
        """DDP's reduction by hand: the gradients averaged over ranks (the carrier's too)."""
        self.progress.enter("the gradient all-reduce")
        self.carrier.grad = values.clone()  # reduced in place; `values` is written every step
        params = [p for p in self._wrapper.module.parameters() if p.requires_grad]
        sum_gradients(params, divide=self.world_size)

    def backward_communication(self) -> tuple[float, float] | None:
        """DDP's own sampled averages (it times some iterations: the first ten, then one in a
        hundred). None where backward only starts the reduction: the step's wait for it is then
        its communication after backward."""
        if self._ddp is None or not self.wait_in_backward:
            return None
        data = self._ddp._get_ddp_logging_data()
        comm = data.get("avg_backward_comm_time") or 0
        if comm <= 0:
            return None
        return comm / 1e9, (data.get("avg_backward_compute_comm_overlap_time") or 0) / 1e9


# --- the strategy as the config names it ---------------------------------------------------


# what a strategy that does not support a setting suggests instead
INSTEAD = "parallel.strategy=ddp"


class DDPSettings(StrategySettings):
    """`parallel.ddp`: settings of the `ddp` strategy."""

    bucket_cap_mb: StrictFloat | None = Field(
        None, gt=0, description="size of DDP's gradient buckets in MiB; default DDP's own (25)"
    )


def build(cfg: Config, accelerator: str, devices: int) -> DDP:
    if not in_worker():
        raise ConfigError(
            "parallel.strategy=ddp needs several processes; set parallel.devices to 2 or more "
            "(phalanx starts them), or start phalanx under torchrun"
        )
    return DDP(
        accelerator,
        cfg.parallel.timeout_s,
        cfg.parallel.sync_batchnorm,
        backend=cfg.parallel.backend,
        bucket_cap_mb=cfg.parallel.section("ddp", DDPSettings).bucket_cap_mb,
    )


def price(m: Measured, setup: Setup) -> Prediction:
    """Each device computes its share of each micro-batch; the all-reduce of the gradients that
    the backward does not hide is exposed."""
    n = setup.devices
    micro = math.ceil(m.batch / (m.accumulation * n))
    one = compute_of(m, setup).time(micro) * m.crowding
    compute = m.accumulation * one
    reduce = link_of(m, n).time(m.grad_bytes)
    hidden = min(reduce, m.overlap * m.compute.backward_share * one)
    exposed = reduce - hidden
    memory = whole_bytes(m) + m.activation_bytes_per_sample * micro
    # one process driving every GPU (towers) sums the gradients itself
    together = get(setup.strategy).process_per_device
    what = "the all-reduce" if together else "the gradients' sum over the GPUs"
    if exposed > compute:
        reason = (
            f"{what} of {mb_text(m.grad_bytes)} at {rate(m.grad_bytes, reduce)} takes "
            f"{ms(reduce)}, longer than the {ms(compute)} of computing each device's "
            f"{micro} samples that it would overlap"
        )
    else:
        reason = (
            f"each device computes {micro} samples in {ms(compute)}; {what} of "
            f"{mb_text(m.grad_bytes)} takes {ms(reduce)}, {ms(exposed)} of it not hidden"
        )
    parts = {"compute": compute, "communication": exposed + m.sync_s, "optimizer": m.optimizer_s}
    return made(m, setup, parts, memory, reason)


register(
    Family(
        "ddp",
        build,
        "one process per device, gradients all-reduced by DistributedDataParallel",
        process_per_device=True,
        settings=DDPSettings,
        field=Field(default_factory=DDPSettings, description="the ddp strategy's"),
        auto="several",
        general=True,
        setups=lambda m, devices: [Setup("ddp", n) for n in range(2, devices + 1)],
        cost=price,
        unplanned=lambda m, devices: ONE_DEVICE if devices < 2 else None,
    )
)
