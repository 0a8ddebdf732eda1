"""Measurements of a run: FLOPs of a training step, the device's peak, MFU, memory, scaling.

FLOPs are counted once, by torch.utils.flop_counter on a copy of the model on the meta device,
so counting touches neither the real weights, nor their gradients, nor any random generator.
"""

from __future__ import annotations

import copy
import functools
import logging
import resource
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger("phalanx")

# Dense bf16/fp16 tensor-core peak per GPU, FLOP/s (vendor datasheets, without sparsity). Matched
# by substring of torch.cuda.get_device_name(); override with LogThroughput(peak_flops=...).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "T4": 65e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's peak FLOP/s from the table, or None (CPUs and unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_FLOPS[key]
    return None


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs performed by `fn()` (matrix products and convolutions, as torch counts them)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def training_flops(
    module: nn.Module,
    forward: Callable[[nn.Module, Mapping], torch.Tensor],
    batch: Mapping[str, Any],
    warn: bool = True,
) -> int | None:
    """FLOPs of one forward and backward of `module` on `batch`, counted on meta tensors.

    `forward(module, batch)` returns the scalar to differentiate. None when the model cannot run on
    the meta device (data-dependent shapes, for one): throughput is still measured, MFU is not;
    where `warn`, the log says why (one process of a job says it for all).
    """
    try:
        meta = copy.deepcopy(module).to("meta")
        meta_batch = {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }
        return count_flops(lambda: forward(meta, meta_batch).backward())
    except Exception as e:  # noqa: BLE001 - any failure only means no MFU figure
        if warn:
            log.warning(
                "could not count the model's FLOPs on the meta device (%s: %s); MFU is not "
                "reported",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
        return None


def on_meta(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device: its structure and shapes, for measuring it, made
    without copying a value of its parameters or buffers (tied ones stay tied)."""
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        is_parameter = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if is_parameter else meta
    return copy.deepcopy(module, memo)


def memory(*devices: torch.device) -> dict[str, float]:
    """Peak and current memory in GiB: the devices' allocator on CUDA (of several devices, each
    figure the largest of theirs), the process's RSS on CPU."""
    gpus = {d for d in devices if d.type == "cuda"}
    if gpus:
        return {
            "memory_gib": max(torch.cuda.memory_allocated(d) for d in gpus) / 2**30,
            "memory_peak_gib": max(torch.cuda.max_memory_allocated(d) for d in gpus) / 2**30,
        }
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"memory_peak_gib": peak_kib / (2**30 if sys.platform == "darwin" else 2**20)}


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the model's state that this process holds: its parameters, their gradients (one per
    trainable parameter, as backward leaves them; the same size) and the optimizer's state. Where a
    strategy shards them, each counts this process's shard only."""
    parameters = gradients = 0
    for p in module.parameters():
        size = _local_bytes(p)
        parameters += size
        gradients += size if p.requires_grad else 0
    held = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {"parameters": parameters, "gradients": gradients, "optimizer": held}


def summary(module: nn.Module, children: int = 8) -> str:
    """One line about a model: its class, parameters (all, trainable), their size, and its largest
    top-level parts (a sharded model counts its whole parameters)."""

    def count(m: nn.Module) -> tuple[int, int, int]:
        total = trainable = size = 0
        for p in m.parameters():
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
            size += p.numel() * p.element_size()
        return total, trainable, size

    total, trainable, size = count(module)
    parts = sorted(
        ((count(child)[0], name, _class_name(child)) for name, child in module.named_children()),
        reverse=True,
    )
    shown = ", ".join(f"{name} ({kind}) {n:,}" for n, name, kind in parts[:children] if n)
    more = f", and {len(parts) - children} more" if len(parts) > children else ""
    return (
        f"model {_class_name(module)}: {total:,} parameters ({trainable:,} trainable), "
        f"{_size(size)}" + (f"; {shown}{more}" if shown else "")
    )


def _class_name(module: nn.Module) -> str:
    """The user's class name (fsdp makes each sharded module's class a subclass named
    FSDP<name>)."""
    classes = type(module).__mro__
    if any(c.__name__ == "FSDPModule" for c in classes):
        return next(c.__name__ for c in classes[1:] if c.__name__ != "FSDPModule")
    return classes[0].__name__


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _local_bytes(tensor: torch.Tensor) -> int:
    # a DTensor: this process's shard
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def gpu_utilization(device: torch.device) -> float | None:
    """GPU utilisation in percent through NVML (nvidia-ml-py), when it is installed."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        return float(pynvml.nvmlDeviceGetUtilizationRates(_nvml_handle(device.index or 0)).gpu)
    except Exception:  # noqa: BLE001 - not installed, or no driver: the figure is simply absent
        return None


@functools.cache
def _nvml_handle(index: int) -> Any:
    import pynvml

    pynvml.nvmlInit()  # once per process: it costs milliseconds
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def scaling(rows: list[dict[str, float]]) -> list[dict[str, float | None]]:
    """Scaling efficiency of each device count: throughput_N / (N * throughput_1), from rows holding
    `devices` and `samples_per_s`; 1.0 is perfect scaling, below 1 more devices pay less than in
    full."""
    base = next((r for r in rows if r["devices"] == 1), None)
    out: list[dict[str, float | None]] = []
    for row in rows:
        eff = row["samples_per_s"] / (row["devices"] * base["samples_per_s"]) if base else None
        out.append(
            {
                **row,
                "speedup": row["samples_per_s"] / base["samples_per_s"] if base else None,
                "efficiency": eff,
            }
        )
    return out
