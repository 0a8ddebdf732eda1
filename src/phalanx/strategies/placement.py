"""`placement`: one process, the model's submodules pinned to devices by name.

`parallel.placement: {user_tower: cuda:0, item_tower: cuda:1, head: cuda:0}` puts each named module
(and everything inside it) on its device, and the rest of the model on the run's device (the first
GPU, or the CPU); `cpu` keeps a module in host memory, for a model that does not fit the GPUs.
Each named module's inputs follow it to its device, and the model's outputs come back to the run's
device, where the loss is weighed: the step is `single`'s, on one copy of the model, so the contract
holds as it does on one device. The model's own forward code runs where its tensors are: code that
combines the outputs of modules placed apart (or one with the batch) moves them itself, and a
forward that does not is one error that says so. The devices take turns (one runs while the others
wait, and activations are copied between them): placement is how a model too large for one device
trains at all, not a way to train faster; `pipeline` keeps the stages busy at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import nn
from torch.utils._pytree import tree_map

from phalanx import keras_models
from phalanx.costs import (
    NO_CHAIN,
    ONE_DEVICE,
    Measured,
    Prediction,
    Setup,
    balanced_split,
    gpus_here,
)
from phalanx.errors import ConfigError, ModelError
from phalanx.strategies import in_worker, schedules
from phalanx.strategies.base import (
    DataParallel,
    Micros,
    ModelOptions,
    OneProcess,
    Outcome,
    Replicated,
    prepare,
)
from phalanx.strategies.registry import Family, register

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.engine import Engine


_MIXED_DEVICES = ("Expected all tensors to be on the same device", "is not on the expected device")


class Placement(OneProcess, Replicated, DataParallel):
    def __init__(self, device: torch.device, placement: Mapping[str, str]):
        self.device = device
        self.placement = {name: torch.device(where) for name, where in placement.items()}
        self.devices = tuple(dict.fromkeys([device, *self.placement.values()]))

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        keras_models.refuse(
            module,
            "placement",
            "it moves submodules by name, and a Keras model's layers are not torch submodules",
        )
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

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        with self._explain_device_errors():
            return super().train_step(engine, micros, stop)

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        with self._explain_device_errors():
            return super().evaluate(engine, batch)

    @contextmanager
    def _explain_device_errors(self) -> Iterator[None]:
        """torch's error for a forward that mixes devices, as what placement leaves to the model."""
        try:
            yield
        except RuntimeError as error:
            if not any(words in str(error) for words in _MIXED_DEVICES):
                raise
            where = ", ".join(f"{name} on {device}" for name, device in self.placement.items())
            raise ModelError(
                f"the model's forward combines tensors on different devices ({where}; the rest "
                f"and the batch on {self.device}): parallel.placement moves each named module's "
                "inputs to it, but code that combines the outputs of modules placed apart runs "
                "where its tensors are. Move one in the forward (x.to(other.device)), or place "
                "the module that combines them"
            ) from error

    def shutdown(self) -> None:
        pass


def _inputs_to(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(_move_to(device), args), tree_map(_move_to(device), kwargs)

    return hook


def _outputs_to(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return tree_map(_move_to(device), output)

    return hook


def _move_to(device: torch.device) -> Any:
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != device:
            return value.to(device, non_blocking=True)
        return value

    return move


def _names(module: nn.Module) -> list[str]:
    names = [name for name, _ in module.named_modules() if name and name.count(".") < 2]
    return names[:12] or ["none"]


# --- the strategy as the config names it ---------------------------------------------------


def build(cfg: Config, accelerator: str, devices: int) -> Placement:
    if in_worker():
        raise ConfigError(
            "parallel.strategy=placement runs in one process, but this is one of several; start "
            "phalanx without torchrun, or use parallel.strategy=pipeline"
        )
    placement = cfg.parallel.section("placement", dict)
    if not placement:
        raise ConfigError(
            "parallel.strategy=placement needs parallel.placement, the device of each module by "
            "name, such as parallel.placement={encoder: cuda:0, decoder: cuda:1}"
        )
    visible = torch.cuda.device_count()
    for name, where in placement.items():
        try:
            device = torch.device(where)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"parallel.placement puts {name} on {where!r}; name a device such as cuda:0, "
                "cuda:1 or cpu"
            )
        if device.type == "cuda" and (device.index or 0) >= visible:
            raise ConfigError(
                f"parallel.placement puts {name} on {where}, but {visible} GPU(s) are visible"
            )
    if cfg.compile:
        raise ConfigError("parallel.strategy=placement does not support compile; remove it")
    home = torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")
    return Placement(home, placement)


def _ignored(cfg: Config, running: str) -> list[str]:
    """A module placement that another strategy's run does not apply trains the model where the
    user did not put it: said."""
    placement = cfg.parallel.section("placement", dict)
    if not placement:
        return []
    return [
        f"parallel.placement pins {', '.join(placement)} to devices for "
        f"parallel.strategy=placement only; this run's strategy, {running}, ignores it: set "
        "parallel.strategy=placement, or remove parallel.placement"
    ]


def _setups(m: Measured, devices: int) -> list[Setup]:
    """The model's chain cut evenly by time over 2 to `devices` GPUs (one micro-batch through
    them in turn, as a pipeline of GPipe's)."""
    out = []
    for stages in range(2, devices + 1):
        split = balanced_split(m.blocks, stages)
        if m.gpus >= stages and split is not None:
            out.append(Setup("placement", stages, stages, 1, "gpipe", tuple(split)))
    return out


def _price(m: Measured, setup: Setup) -> Prediction:
    return schedules.price(m, setup, pipelined=False)


def _unplanned(m: Measured, devices: int) -> str | None:
    if devices < 2:
        return ONE_DEVICE
    if balanced_split(m.blocks, 2) is None:
        return NO_CHAIN
    if m.gpus < 2:
        return f"it pins modules to the GPUs of one process, and {gpus_here(m)}"
    return None


def _accumulation_setup(cfg: Config, devices: int) -> Callable[[Measured], Setup]:
    raise ConfigError(
        "parallel.gradient_accumulation=auto cannot price placement's devices (each holds "
        "the modules the config pins to it); give a number"
    )


register(
    Family(
        "placement",
        build,
        "one process, the model's modules pinned to devices by name",
        settings=dict[str, str],
        field=Field(
            default_factory=dict,
            description="the placement strategy's devices by module name, such as {encoder: "
            "cuda:0, decoder: cuda:1, head: cpu}; the rest of the model on the run's device",
        ),
        ignored=_ignored,
        builds_on_device=False,
        setups=_setups,
        cost=_price,
        unplanned=_unplanned,
        accumulation_setup=_accumulation_setup,
        # a config names its devices by module, which a plan's row does not
        plan_settings=lambda row: None,
    )
)
