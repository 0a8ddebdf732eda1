"""A model's weights as a checkpoint step holds them: a safetensors file (a tied weight kept under
one of its names, the others in its metadata) or a strategy's `shards/` folder; read whole, or
loaded into a module, with a CheckpointError for a file that does not parse and a
CheckpointMismatch for the weights of another model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model
from torch import nn

from phalanx.errors import CheckpointError, CheckpointMismatch
from phalanx.shards import load_shards, read_shards_model

WEIGHTS = "model.safetensors"
# a sharded model's and optimizer's state, as torch.distributed.checkpoint writes it
SHARDS = "shards"

# where a checkpoint's weights go: a module, or a function that loads them from the weights file or
# the shards folder (a strategy's, which may also load the optimizer's state from the shards)
Weights = nn.Module | Callable[[Path], None]


def weights_path(folder: Path) -> Path:
    """A checkpoint step's weights: its shards folder, or its safetensors file."""
    return folder / SHARDS if (folder / SHARDS).is_dir() else folder / WEIGHTS


def load_into(weights: Weights, path: Path) -> None:
    """The weights of `path` (a safetensors file or a shards folder) into a module, or handed to a
    strategy's function that loads them."""
    if not isinstance(weights, nn.Module):
        weights(path)
    elif path.name == SHARDS:
        load_shards(path, weights)
    else:
        load_weights(weights, path)


def whole_state(path: Path) -> dict[str, torch.Tensor]:
    """Every name of a model's state dict from a safetensors file or a shards folder, as CPU
    tensors. A tied weight, which saving kept under one of its names, is put back under the others
    as the same tensor: however many names a file's metadata ties, they cost no memory."""
    if path.name == SHARDS:
        return read_shards_model(path)
    try:
        state = load_file(str(path))
        # names save_model dropped as duplicates: dropped -> kept
        with safe_open(str(path), "pt") as f:
            for dropped, kept in (f.metadata() or {}).items():
                if kept in state and dropped not in state:
                    state[dropped] = state[kept]
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    return state


def untie_weights(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """`state` with a copy of a tied weight under each of its names but the first (a safetensors
    file holds no shared tensors). A model ties a few weights (an embedding and its head), so the
    copies may hold at most as many bytes as `path` holds: more is a damaged or crafted file, whose
    metadata would make a small file a huge one."""
    # each tensor of the file (by identity): its bytes
    held: dict[int, int] = {}
    tied = set()
    for name, tensor in state.items():
        if id(tensor) in held:
            tied.add(name)
        held[id(tensor)] = tensor.nbytes
    extra, stored = sum(state[name].nbytes for name in tied), sum(held.values())
    if extra > stored:
        raise CheckpointError(
            f"{path} ties {len(tied)} more names to its tensors, whose copies would hold "
            f"{extra:,} bytes, more than the {stored:,} it holds; the checkpoint is damaged"
        )
    return {name: t.clone() if name in tied else t for name, t in state.items()}


def load_weights(module: nn.Module, path: Path) -> None:
    """Weights from a safetensors file: a file that does not parse is a CheckpointError, weights
    of another model a CheckpointMismatch."""
    try:
        load_model(module, str(path), strict=True, device="cpu")
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}); the checkpoint is damaged"
        ) from None
    except RuntimeError as e:
        lines = " ".join(str(e).split())
        raise CheckpointMismatch(
            f"{path} does not fit this model ({lines[:300]}); was it saved from "
            "another model config?"
        ) from None
