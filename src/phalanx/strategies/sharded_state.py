"""The state of a model whose parameters are split over processes (DTensors: FSDP's shards, a tensor
group's slices): gathered whole to the main process, loaded whole by every process (each keeping
its part), or saved and read as each process's shards (torch.distributed.checkpoint). The
optimizer's state goes by parameter index, as torch's own optimizers key theirs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from phalanx.errors import CheckpointMismatch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType


def model_state(model: nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """The whole model's state on the main process (gathered, on the CPU); empty elsewhere. A
    collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    # a full state dict holds whole tensors (gathered and moved to the CPU), no DTensor
    return cast(dict[str, torch.Tensor], state) if is_main else {}


def load_model_state(
    model: nn.Module, path: Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """A checkpoint's weights: its shards' folder (each process reads the parts its own shards
    need, the optimizer's too), or a whole safetensors file."""
    from safetensors.torch import load_file

    from phalanx.checkpoint import SHARDS
    from phalanx.shards import load_shards

    if path.name == SHARDS:
        load_shards(path, model, optimizer, collective=True)
        return
    try:
        missing, unexpected = load_state(model, load_file(str(path)))
        if missing or unexpected:
            raise KeyError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    except (RuntimeError, KeyError, ValueError) as e:
        lines = " ".join(str(e).split())
        raise CheckpointMismatch(
            f"{path} does not fit this model ({lines[:300]}); was it saved from another "
            "model config?"
        ) from None


def load_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The whole state, of which every process keeps its parts; the keys missing and unexpected."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    whole: dict[str, ValueType] = dict(state)
    result = set_model_state_dict(
        model, whole, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    return list(result.missing_keys), list(result.unexpected_keys)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool) -> dict:
    """The whole optimizer state on the main process, keyed by parameter index; empty elsewhere. A
    collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    named = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return _by_index(named, _names(model)) if is_main else {}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A whole optimizer state keyed by parameter index, every process keeping its parts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    if not state["state"]:
        # an optimizer that keeps no tensors (SGD without momentum): torch's loader places the
        # state where its first tensor is, and refuses one without; its groups' settings are all
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    set_optimizer_state_dict(
        model,
        optimizer,
        _by_name(state, _names(model)),
        options=StateDictOptions(full_state_dict=True),
    )


def _names(model: nn.Module) -> list[str]:
    """The trainable parameters' names, in the order the optimizer holds them."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter names, as torch's own optimizers key theirs: by
    index."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def _by_name(state: dict, names: list[str]) -> dict:
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }
