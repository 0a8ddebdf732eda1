"""`ddp`: one process per device; gradients reduced by DistributedDataParallel's bucketed,
overlapped all-reduce.

Each rank scales its local loss sum by 1/B_k (B_k the global batch), so the reduction must *sum*.
DDP's built-in reduction averages, so each rank also multiplies its objective by the world size
(the scale it passes to `Engine.forward`). Gradients are views into DDP's buckets (`gradient_as_bucket_view`): no copy back
after each reduction, and no second copy of them in memory.

Beside the model sits the carrier, a two-element parameter whose gradient is the rank's share of the
loss and its stop flag: DDP adds it over ranks with the gradients, so every rank learns the global
loss and whether any rank asked to stop without a collective of its own. Its gradient is written
directly and DDP's reducer told it is ready, so it costs the step no autograd work; where the
installed torch lacks that entry point, the carrier reaches the reducer through autograd instead.
Steps where some rank's shard is empty skip DDP's reducer on every rank and reduce by hand instead,
so that rank can join with zero weight without running its model.

Each collective this strategy enters is counted (`progress`), and a background thread publishes the
count and the step to the process group's store: when a collective times out, the error names the
ranks that never arrived and their step.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.errors import ConfigError
from phalanx.strategies import progress
from phalanx.strategies.base import Micros, ModelOptions, Replicated, prepare
from phalanx.strategies.syncbn import convert_sync_batchnorm

if TYPE_CHECKING:
    from phalanx.engine import Engine

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_SYNCHRONISED = contextlib.nullcontext()  # the micro-batch whose backward reduces (it holds no state)
DEFAULT_TIMEOUT_S = {"cpu": 300.0, "cuda": 600.0}


class _Carried(nn.Module):
    """The user's module and, beside it, the carrier (see the module's docstring). The carrier is
    this module's own parameter, so it comes first in `parameters()`: DDP's reducer knows it as
    parameter 0."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.module = module
        self.carrier = nn.Parameter(torch.zeros(2, dtype=dtype, device=device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _carrier_dtype(module: nn.Module) -> torch.dtype:
    """The parameters' dtype, so that the carrier shares their bucket; float32 where that is a
    16-bit type, which would round the loss to 3 digits."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class DDP(Replicated):
    def __init__(self, accelerator: str, timeout_s: float | None = None, sync_batchnorm: bool = False,
                 carry_through_autograd: bool = False, backend: str = "auto", bucket_cap_mb: float | None = None):
        """`carry_through_autograd`: carry the step's loss and stop flag to the reducer through
        autograd, as on a torch without the reducer's direct entry point (for tests). `backend`:
        nccl or gloo; auto picks nccl on GPUs and gloo on CPUs. `bucket_cap_mb`: DDP's gradient bucket size."""
        self.carry_through_autograd = carry_through_autograd
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if accelerator == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.devices = (self.device,)
        self.sync_batchnorm, self.bucket_cap_mb = sync_batchnorm, bucket_cap_mb
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S[self.device.type]
        if not dist.is_initialized():
            if backend == "auto":
                backend = "nccl" if accelerator == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.data_rank, self.data_world_size = self.rank, self.world_size
        # what this rank is doing, for naming the rank that did not arrive when a collective times out
        self.progress = progress.start(self.rank, self.world_size, self.timeout_s, _default_store())
        self.scale = float(self.world_size)  # DDP averages: each rank's objective times the world size sums
        self.carrier: nn.Parameter | None = None
        self._ddp: DistributedDataParallel | None = None
        self._mark_ready: Callable[[int], None] | None = None  # the reducer's "this gradient is ready"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def watch(self, where: Callable[[], tuple[int, bool]]) -> None:
        """`where()` tells the run's steps done and whether it is training, for naming a hung rank's step."""
        self.progress.where = where

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module
        return prepare(module, options, self._wrap), self.model

    def _wrap(self, module: nn.Module) -> nn.Module:
        module = module.to(self.device)
        self.progress.enter("the broadcast of the initial parameters")
        if self.sync_batchnorm:
            module = self.model = convert_sync_batchnorm(module)
        carried = _Carried(module, _carrier_dtype(module), self.device)
        # DDP broadcasts rank 0's parameters and buffers at construction; buffers are not
        # re-broadcast every forward, so a rank that skips a forward never stalls the others.
        with warnings.catch_warnings():  # its successor still syncs buffers at init, which is what we want
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            extra = {} if self.bucket_cap_mb is None else {"bucket_cap_mb": self.bucket_cap_mb}
            ddp = DistributedDataParallel(carried, device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                                          broadcast_buffers=False, gradient_as_bucket_view=True, **extra)
        self._check_identical(module)
        self.carrier = carried.carrier
        self._ddp = ddp
        # the stop flag as the carrier's gradient holds it, for either answer
        self._flags = {flag: torch.tensor(float(flag) * self.scale, dtype=self.carrier.dtype, device=self.device)
                       for flag in (False, True)}
        self._pending_stop: tuple[torch.Tensor, Any] | None = None
        # A private entry point, the one DDP's own mixed precision uses when autograd does not reach
        # the reducer. Without it, `carry` goes through autograd: the same values, more work per step.
        self._mark_ready = None if self.carry_through_autograd else getattr(ddp.reducer, "_autograd_hook", None)
        return ddp

    def forward_backward(self, engine: Engine, micros: Micros, stop: bool) -> tuple[list[dict | None], torch.Tensor,
                                                                                     bool, float]:
        """Every micro-batch but the last runs without synchronising; the last one's backward reduces
        the gradients and, through the carrier, the loss and the stop flag. Where some rank's shard is
        empty, no rank lets backward synchronise: they reduce by hand, and a rank with nothing to do
        joins with zero weight without running its model."""
        by_hand = micros[0][0].any_empty
        last, scale, ddp = len(micros) - 1, self.scale, self._ddp
        total, parts = None, []  # total: this rank's part of the global batch's mean loss (times the scale)
        for i, (micro, batch) in enumerate(micros):
            if batch is None:
                parts.append(None)
                continue
            sync = i == last and not by_hand
            with _SYNCHRONISED if sync else ddp.no_sync():
                loss, gradient, part, data = engine.forward(micro, batch, scale)
                total = part if total is None else total + part
                engine.backward(loss, gradient, self._carry(self._values(total, stop)) if sync else None)
            parts.append(data)
        communication = 0.0
        if by_hand:
            start = time.perf_counter()
            self._reduce_by_hand(self._values(total, stop))
            communication = time.perf_counter() - start
        loss, flags = self._carried().unbind()  # the sums over ranks of the loss parts and of the stop flags
        return parts, loss, self._agreed_stop(flags), communication

    def _values(self, total: torch.Tensor | None, stop: bool) -> torch.Tensor:
        """What this rank adds to the carrier's gradient: its part of the loss and its stop flag,
        both times the scale the reduction divides by."""
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

    def agree(self, loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        values = torch.stack((loss.detach().to(torch.float64), torch.tensor(float(stop), dtype=torch.float64,
                                                                            device=loss.device)))
        total, flags = self.reduce(values).unbind()
        return total, bool(flags > 0)

    def _check_identical(self, module: nn.Module) -> None:
        digest = hashlib.sha256()
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.gather(digest.hexdigest())
        if len(set(digests)) != 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(f"initial parameters differ on ranks {differing} after the broadcast")

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone()
        self.progress.enter("an all-reduce")
        dist.all_reduce(out, op=_OPS[op])
        return out

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

    def _carried(self) -> torch.Tensor:
        # a copy: the gradient is a view into DDP's bucket, which the next step overwrites
        return self.carrier.grad.clone()

    def _reduce_by_hand(self, values: torch.Tensor) -> None:
        """DDP's reduction by hand: the gradients averaged over ranks (the carrier's too)."""
        self.progress.enter("the gradient all-reduce")
        self.carrier.grad = values
        params = [p for p in self._ddp.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for p in params:
            summed = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = summed.to(p.dtype, copy=True)
            else:
                p.grad.copy_(summed)

    def backward_communication(self) -> tuple[float, float] | None:
        """DDP's own sampled averages (it times some iterations: the first ten, then one in a hundred)."""
        if self._ddp is None:
            return None
        data = self._ddp._get_ddp_logging_data()
        comm = data.get("avg_backward_comm_time") or 0
        if comm <= 0:
            return None
        return comm / 1e9, (data.get("avg_backward_compute_comm_overlap_time") or 0) / 1e9

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.progress.enter("a gather")
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self.progress.enter("a broadcast")
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.progress.enter("a barrier")
        dist.barrier()

    def shutdown(self) -> None:
        """After a successful run: every rank leaves the group together. A rank that tore its group
        down while another still talked to it could abort at exit in gloo's threads ("terminate
        called without an active exception"), failing a run that had succeeded."""
        progress.stop()
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()


def _default_store() -> Any:
    """The process group's store (where ranks publish their progress), or None where torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, hung ranks are not named
        return None


def check_same_config(strategy: Any, resolved: dict, versions: dict) -> None:
    """Every rank must run the same resolved config and library versions."""
    mine = _flatten({"config": resolved, "versions": versions})
    every = strategy.gather(mine)
    differing = sorted({k for other in every for k in set(other) | set(mine) if other.get(k) != mine.get(k)})
    if differing:
        shown = ", ".join(differing[:8]) + (" ..." if len(differing) > 8 else "")
        raise ConfigError(f"ranks run different configs or versions; differing keys: {shown}. "
                          "Give every node the same config file and phalanx, torch versions")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): repr(tree)}
