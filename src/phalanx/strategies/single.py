"""`single`: one process, one device."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.strategies.base import DataParallel, ModelOptions, OneProcess, Replicated, prepare


class Single(OneProcess, Replicated, DataParallel):
    def __init__(self, device: torch.device):
        self.device = device
        self.devices = (device,)

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module  # preparing it keeps the same object: its methods change it in place
        return prepare(module, options, lambda m: m.to(self.device)), self.model

    def shutdown(self) -> None:
        pass
