"""`single`: one process, one device."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


class Single:
    rank = 0
    world_size = 1
    sum_factor = 1.0
    carrier = None

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def is_main(self) -> bool:
        return True

    def watch(self, where) -> None:
        pass

    def setup(self, module: nn.Module) -> nn.Module:
        return module.to(self.device)

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def carry(self, values: torch.Tensor) -> torch.Tensor | None:
        return None

    def carried(self) -> torch.Tensor:
        raise RuntimeError("one process carries nothing: it has no other rank to agree with")

    def reduce_gradients(self, module: nn.Module, values: torch.Tensor) -> None:
        pass

    def backward_communication(self) -> tuple[float, float] | None:
        return None

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module

    def shutdown(self) -> None:
        pass
