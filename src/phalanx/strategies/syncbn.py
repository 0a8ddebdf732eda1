"""BatchNorm over the global micro-batch: statistics summed across ranks, on CPU (gloo) and GPU.

PyTorch's own SyncBatchNorm runs on accelerators only; this one reduces with the differentiable
`torch.distributed.nn.functional.all_reduce`, so gradients flow through the statistics exactly as
they would through one BatchNorm over the whole micro-batch. On CUDA PyTorch's version is used.

Without it, each device normalises its share with the share's own statistics: `PerDeviceStatistics`
says so once, at a run's first training step.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger("phalanx")

# Its differentiable all_reduce is what this module needs; the suggested successor is private.
warnings.filterwarnings(
    "ignore", message="torch.distributed.nn.functional.all_reduce is deprecated"
)


class SyncBatchNorm(_BatchNorm):
    """Drop-in for BatchNorm1d/2d/3d; in training with several ranks, statistics are global."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        channels = x.shape[1]
        count = x.new_full((1,), x.numel() // channels)  # a kernel: a copy would wait for the GPU
        totals = dist_fn.all_reduce(torch.cat([x.sum(dims), count]))
        n = totals[-1]
        mean = totals[:channels] / n
        centered = x - mean.view(shape)
        var = dist_fn.all_reduce((centered * centered).sum(dims)) / n  # two passes: no cancellation
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(n.detach()))
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        running_mean, running_var = self.running_mean, self.running_var
        tracked = self.num_batches_tracked
        if running_mean is None or running_var is None or tracked is None:
            raise RuntimeError("SyncBatchNorm: running statistics updated where none are tracked")
        tracked.add_(1)
        momentum = 1.0 / float(tracked) if self.momentum is None else self.momentum
        unbiased = var * n / max(n - 1.0, 1.0)
        running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer replaced by one whose statistics span all ranks (weights kept)."""
    if next(module.parameters(), torch.empty(0)).is_cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device=module.running_mean.device if module.running_mean is not None else None,
            dtype=module.running_mean.dtype if module.running_mean is not None else None,
        )
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module


# What a strategy without sync_batchnorm (towers, fsdp) tells a BatchNorm model
WITH_DDP = (
    "parallel.strategy=ddp with parallel.sync_batchnorm: true normalises over the whole micro-batch"
)


class PerDeviceStatistics:
    """Where a model whose BatchNorm layers are not synchronised trains on several devices, each
    device normalises its share of a micro-batch with the share's own mean and variance, so training
    is not one device's: one warning, on the main process, at the run's first training step (an
    evaluation-only run, whose BatchNorm uses its running statistics, says nothing). Made when the
    strategy sets the model up; `fix`: how that strategy gets the whole micro-batch's statistics."""

    def __init__(
        self, module: nn.Module, devices: int, is_main: bool, fix: str, said: str | None = None
    ):
        """`said`: the warning instead of the one about devices' shares, `{layers}` where the
        layers' names go (a strategy whose statistics are partial in another way)."""
        layers = [
            name or type(m).__name__
            for name, m in module.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))
        ]
        self.message: str | None = None
        if devices > 1 and is_main and layers:
            shown = ", ".join(layers[:3]) + (
                f" and {len(layers) - 3} more" if len(layers) > 3 else ""
            )
            self.message = (
                said.format(layers=shown)
                if said is not None
                else f"BatchNorm on {devices} devices without parallel.sync_batchnorm: the "
                f"model's BatchNorm layers ({shown}) normalise each device's share of a "
                f"micro-batch with the share's own statistics, so training differs from one "
                f"device's; {fix}"
            )

    def warn_once(self) -> None:
        if self.message is not None:
            log.warning(self.message)
            self.message = None
