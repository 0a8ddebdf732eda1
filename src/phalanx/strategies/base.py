"""The strategy protocol: all the trainer knows of how devices and processes are used.

The trainer never asks which strategy it runs; a new strategy is a new module behind this protocol.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn


class Strategy(Protocol):
    """How one module is trained on this process's devices: a strategy serves the one module it set up."""

    rank: int
    world_size: int
    device: torch.device
    # The factor each rank multiplies its objective by so that the gradient reduction adds the
    # ranks' gradients (DDP averages: the world size).
    sum_factor: float
    # A parameter outside the model whose gradient the reduction adds over ranks with the model's:
    # it carries each step's loss and stop flag, so that ranks agree on both without a collective of
    # their own. None with one process. Its dtype and device are those of the values `carry` takes.
    carrier: torch.Tensor | None

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs, progress and checkpoints."""

    def watch(self, where: Callable[[], tuple[int, bool]]) -> None:
        """`where()` returns the run's steps done and whether it is training: with several processes, a
        collective's timeout then names the ranks that did not arrive and their step."""

    def setup(self, module: nn.Module) -> nn.Module:
        """Place (and wrap) the module; every rank starts from the same parameters."""

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward does not synchronise gradients (all but the last micro-batch)."""

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The tensor reduced over ranks (op: sum, min or max); every rank gets the result."""

    def carry(self, values: torch.Tensor) -> torch.Tensor | None:
        """Hand this rank's values (its loss part and stop flag, times `sum_factor`) to the gradient
        reduction of the coming backward, which adds them over ranks. Returns a scalar to
        back-propagate with the loss where they must reach the reduction through autograd, else None."""

    def carried(self) -> torch.Tensor:
        """After the reduction: the carried values added over ranks, in a tensor of the caller's own."""

    def reduce_gradients(self, module: nn.Module, values: torch.Tensor) -> None:
        """Reduce the gradients and the carried `values` over ranks by hand, as backward would have,
        after backward ran without synchronising."""

    def backward_communication(self) -> tuple[float, float] | None:
        """The gradient all-reduce inside backward, as last sampled: seconds per step it took, and
        seconds of it that overlapped computation. None where there is none or no sample yet."""

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value (any picklable object), in rank order, on every rank."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value (any picklable object), on every rank."""

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module, without any wrapper the strategy put around it."""

    def shutdown(self) -> None:
        """Release process groups and devices."""
