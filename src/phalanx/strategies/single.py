"""`single`: one process, one device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.strategies.base import Micros, ModelOptions, Replicated, prepare

if TYPE_CHECKING:
    from phalanx.engine import Engine


class Single(Replicated):
    rank = data_rank = 0
    world_size = data_world_size = 1

    def __init__(self, device: torch.device):
        self.device = device
        self.devices = (device,)

    @property
    def is_main(self) -> bool:
        return True

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module  # preparing it keeps the same object: its methods change it in place
        return prepare(module, options, lambda m: m.to(self.device)), self.model

    def forward_backward(self, engine: Engine, micros: Micros, stop: bool) -> tuple[list[dict | None], torch.Tensor,
                                                                                     bool, float]:
        total, parts = None, []
        for micro, batch in micros:  # one process: no shard is ever empty
            loss, gradient, part, data = engine.forward(micro, batch, 1.0)
            engine.backward(loss, gradient)
            total = part if total is None else total + part
            parts.append(data)
        return parts, total, stop, 0.0

    def agree(self, loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        return loss, stop

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
