"""Numeric precision: fp32, fp64 (parameters and inputs in float64), bf16 and fp16 autocast.

fp16 scales the loss with a GradScaler so small gradients do not underflow; bf16 needs no scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # reusable: it holds no state

try:  # the autograd engine's entry that `torch.autograd.backward` ends in
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a torch without it: the public path, always
    _engine_run_backward = None  # type: ignore[assignment]
_has_torch_function = torch._C._has_torch_function_unary
_transforming = torch._C._are_functorch_transforms_active


class Precision:
    def __init__(self, name: str, device: torch.device, channels_last: bool = False):
        self.name, self.device, self.channels_last = name, device, channels_last
        self.autocast_dtype = _AUTOCAST.get(name)
        # batches arrive from the DataLoader on the CPU: there, nothing needs converting
        self.passes_through = device.type == "cpu" and name != "fp64" and not channels_last
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        if name == "fp16" and device.type == "cpu":
            raise ConfigError("precision: fp16 needs a CUDA device; on CPU use bf16 or fp32")

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.name != "fp64":
            return module
        from phalanx.keras_models import KerasModule

        if isinstance(module, KerasModule):  # its layers compute in their own dtype
            module.check_dtype("float64", "precision=fp64")
        return module.double()

    def convert_batch(
        self, batch: Mapping[str, Any], device: torch.device | None = None
    ) -> dict[str, Any]:
        """The batch on the device (or on `device`); floating tensors in float64 under fp64."""
        if self.passes_through and device is None and isinstance(batch, dict):
            return batch
        device = device or self.device
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
                if self.name == "fp64" and value.is_floating_point():
                    value = value.double()
                if self.channels_last and value.dim() == 4:
                    value = value.contiguous(memory_format=torch.channels_last)
            out[key] = value
        return out

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(
        self,
        loss: torch.Tensor,
        gradient: torch.Tensor | None = None,
        unscaled: torch.Tensor | None = None,
    ) -> None:
        """Back-propagate `loss` (scaled under fp16; a vector takes `gradient`), and with it
        `unscaled`, a scalar whose gradients must come out as they are (the strategy's carrier)."""
        if self.scaler:
            loss = self.scaler.scale(loss)
        if unscaled is not None:
            torch.autograd.backward((loss, unscaled), (gradient, None))
        elif gradient is None or not _plain_backward(loss, gradient):
            loss.backward(gradient)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def _plain_backward(loss: torch.Tensor, gradient: torch.Tensor) -> bool:
    """`loss.backward(gradient)` handed straight to the autograd engine, where `loss` is a plain
    tensor (no subclass, no mode, no transform to defer to) and `gradient` a tensor of its shape
    and dtype: what torch's public path checks before it calls the engine, checked here in a few
    comparisons. Its own checks cost a small model's step about 50,000 instructions (BENCHMARKS.md).
    False, having done nothing, for anything else: the public path then runs, with its errors."""
    if (
        _engine_run_backward is None
        or type(loss) is not torch.Tensor
        or type(gradient) is not torch.Tensor
        or loss.is_nested
        or _has_torch_function(loss)
        or _transforming()
        or gradient.dtype != loss.dtype
        or gradient.shape != loss.shape
    ):
        return False
    _engine_run_backward(
        (loss,), (gradient,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )
    return True
