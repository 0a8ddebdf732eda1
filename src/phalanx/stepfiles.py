"""A checkpoint step's small files read back, each checked for the shape a resume relies on:
`manifest.json` (each file's size and SHA-256), `trainer.json` (counters, random generators, hooks'
state) and `optimizer.pt` (through `torch.load(weights_only=True)`). Anything else, a file nested
too deep to parse included, is a CheckpointError naming the file, so that a resume falls back to
the step before.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError, first_line
from phalanx.files import read_json

FORMAT = 1


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """A step's `manifest.json`: its files, each with a whole-number size and a SHA-256 as text.
    Anything else is a CheckpointError naming it."""
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is missing or unreadable ({first_line(e, os_reason=True)}); the checkpoint is "
            "incomplete or damaged"
        ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"{path} holds a {type(manifest).__name__}, not a manifest; the checkpoint is damaged"
        )
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r}; this phalanx reads {FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(meta, dict)
        and type(meta.get("size")) is int
        and meta["size"] >= 0
        and isinstance(meta.get("sha256"), str)
        for meta in files.values()
    ):
        raise CheckpointError(
            f"{path} does not list its files, each with a size and a SHA-256; the checkpoint is "
            "damaged"
        )
    return files


# The trainer state's counters: each a whole number, at least this much.
_COUNTERS = {"epoch": 0, "step": 0, "step_in_epoch": 0, "batch_size": 1}


def read_trainer_state(path: Path) -> dict[str, Any]:
    """`trainer.json`, checked for the keys and counters a resume relies on."""
    try:
        state = read_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is not readable JSON ({e}); the checkpoint is damaged"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__}, not the trainer state; the checkpoint is "
            "damaged"
        )
    missing = [k for k in (*_COUNTERS, "seed", "rng", "hooks") if k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; the checkpoint is damaged")
    for key, least in _COUNTERS.items():
        value = state[key]
        if type(value) is not int or value < least:
            raise CheckpointError(
                f"{path} says {key}={value!r}, not a whole number >= {least}; the checkpoint is "
                "damaged"
            )
    # every epoch takes one step at least
    if state["step"] < state["epoch"] + state["step_in_epoch"]:
        raise CheckpointError(
            f"{path} says step {state['step']} after {state['epoch']} epochs and "
            f"{state['step_in_epoch']} steps into the next; the checkpoint is damaged"
        )
    if not isinstance(state["rng"], dict) or not isinstance(state["hooks"], dict):
        raise CheckpointError(
            f"{path} has malformed rng or hooks entries; the checkpoint is damaged"
        )
    malformed = [key for key, fits in _OPTIONAL.items() if key in state and not fits(state[key])]
    if malformed:
        raise CheckpointError(
            f"{path} has malformed {', '.join(malformed)} entries; the checkpoint is damaged"
        )
    return state


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0


# The trainer state's entries that older steps may lack, each with the shape a resume relies on:
# training goes on with them, where a wrong one would fail a step instead of the resume.
_OPTIONAL: dict[str, Callable[[Any], bool]] = {
    "order": lambda v: isinstance(v, str),
    "rounds": _whole,
    "rng_ranks": lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v),
    "grad_norms": lambda v: (
        isinstance(v, dict)
        and all(_number(v.get(k)) for k in ("sum", "max"))
        and all(_whole(v.get(k)) for k in ("count", "nonfinite"))
    ),
}


def read_optimizer_state(path: Path) -> dict[str, Any]:
    """`optimizer.pt` through `torch.load(weights_only=True)`: tensors and plain containers only."""
    try:
        # torch warns of a pickle it may not read before it fails to: the error below says it all
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever the unpickler makes of the bytes, the file is unusable
        raise CheckpointError(
            f"{path} cannot be read as optimizer state ({_unpickling_error(e)}); "
            "the checkpoint is damaged"
        ) from None
    for warning in warned:  # a load that went through keeps what torch said of it
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if not isinstance(state, dict) or not {"optimizer", "schedulers", "scaler"} <= set(state):
        raise CheckpointError(
            f"{path} does not hold optimizer, scheduler and scaler state; the checkpoint is damaged"
        )
    return state


def _unpickling_error(e: Exception) -> str:
    """The gist of torch.load's error: for a refused pickle, what the restricted unpickler
    refused."""
    text = str(e).split("WeightsUnpickler error:", 1)[-1].strip()
    first = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
