"""`placement`: one process, the model's submodules pinned to devices by name.

`parallel.placement: {user_tower: cuda:0, item_tower: cuda:1, head: cuda:0}` puts each named module
(and everything inside it) on its device, and the rest of the model on the run's device (the first
GPU, or the CPU); `cpu` keeps a module in host memory, for a model that does not fit the GPUs.
Each named module's inputs follow it to its device, and the model's outputs come back to the run's
device, where the loss is weighed: the step is `single`'s, on one copy of the model, so the contract
holds as it does on one device. The devices take turns (one runs while the others wait, and
activations are copied between them): placement is how a model too large for one device trains at
all, not a way to train faster; `pipeline` keeps the stages busy at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from phalanx.errors import ConfigError
from phalanx.strategies.base import DataParallel, ModelOptions, OneProcess, Replicated, prepare


class Placement(OneProcess, Replicated, DataParallel):
    def __init__(self, device: torch.device, placement: Mapping[str, str]):
        self.device = device
        self.placement = {name: torch.device(where) for name, where in placement.items()}
        self.devices = tuple(dict.fromkeys([device, *self.placement.values()]))

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module
        return prepare(module, options, self._place), self.model

    def _place(self, module: nn.Module) -> nn.Module:
        module.to(self.device)
        for name, device in self.placement.items():
            try:
                part = module.get_submodule(name)
            except AttributeError:
                raise ConfigError(
                    f"parallel.placement names {name!r}, which is not a module of the model; its "
                    f"modules include {', '.join(_names(module))}"
                ) from None
            part.to(device)
            part.register_forward_pre_hook(_inputs_to(device), with_kwargs=True)
        module.register_forward_hook(_outputs_to(self.device))
        return module

    def shutdown(self) -> None:
        pass


def _inputs_to(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(_moved(device), args), tree_map(_moved(device), kwargs)

    return hook


def _outputs_to(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return tree_map(_moved(device), output)

    return hook


def _moved(device: torch.device) -> Any:
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != device:
            return value.to(device, non_blocking=True)
        return value

    return move


def _names(module: nn.Module) -> list[str]:
    names = [name for name, _ in module.named_modules() if name and name.count(".") < 2]
    return names[:12] or ["none"]
