"""A sharded checkpoint step's `shards/` folder: the files `torch.distributed.checkpoint` writes (one
per process, and `.metadata`), read back by any strategy on any process count, or with no model at
all (`export`). torch's own reader unpickles `.metadata`, and the non-tensor items (the optimizer's
settings), without restriction; here the metadata goes through an unpickler that accepts only its
layout records, and the items through `torch.load(weights_only=True)`, as every other file is read.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.errors import CheckpointError, CheckpointMismatch
from phalanx.files import os_error, storage_error


def load_shards(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    collective: bool = False,
) -> None:
    """The model's state (and the optimizer's, if given) from a shards folder, saved by any number of
    processes. `collective`: the model is sharded over the process group and every rank calls this,
    each reading the parts its shards need; otherwise this process reads the whole state alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
    reader = _reader(folder)
    _check_fits(folder, reader.read_metadata(), state["model"])
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=_planner(), no_dist=not collective)
    except (Exception, checkpoint_exception()) as e:  # noqa: BLE001 - whatever the reader makes of the files
        raise CheckpointError(
            f"{folder} cannot be read ({_failure(e)}); the checkpoint is damaged"
        ) from None
    try:
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"{folder} does not fit this run ({type(e).__name__}: {e}); the checkpoint is damaged "
            "or was saved from another config"
        ) from None


def read_shards_model(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model's state from a shards folder, as CPU tensors, with no model to load it into."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(folder)
    metadata = reader.read_metadata()
    state = {
        key[len("model.") :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    try:
        with _quiet_single_process():
            dcp.load({"model": state}, storage_reader=reader, planner=_planner(), no_dist=True)
    except (Exception, checkpoint_exception()) as e:  # noqa: BLE001
        raise CheckpointError(
            f"{folder} cannot be read ({_failure(e)}); the checkpoint is damaged"
        ) from None
    return state


def _check_fits(folder: Path, metadata: Any, model_state: dict) -> None:
    """The saved model's names and shapes are this model's: else a CheckpointMismatch."""
    saved = {
        key[len("model.") :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    mine = {
        key: tuple(value.shape)
        for key, value in model_state.items()
        if isinstance(value, torch.Tensor)
    }
    if saved == mine:
        return
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    shapes = [
        f"{k} {saved[k]} vs {mine[k]}"
        for k in sorted(set(saved) & set(mine))
        if saved[k] != mine[k]
    ]
    what = "; ".join(
        part
        for part in (
            f"missing {', '.join(missing[:5])}" if missing else "",
            f"unexpected {', '.join(extra[:5])}" if extra else "",
            f"shapes differ: {', '.join(shapes[:5])}" if shapes else "",
        )
        if part
    )
    raise CheckpointMismatch(
        f"{folder} does not fit this model ({what}); was it saved from another model config?"
    )


class _Unpickler(pickle.Unpickler):
    """The shards' `.metadata` holds only checkpoint-layout records, paths, and torch's dtype, layout
    and size objects: nothing else in it is loaded (torch's own reader unpickles it without restriction)."""

    _NAMED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(
            ("pathlib", name)
            for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
        ),
    }

    def find_class(self, module: str, name: str) -> Any:
        layout_record = module.startswith("torch.distributed.checkpoint.") and not name.startswith(
            "__"
        )
        if (module, name) in self._NAMED or layout_record or module == "torch":
            found = super().find_class(module, name)
            if (
                (module, name) in self._NAMED
                or isinstance(found, torch.dtype)
                or (layout_record and isinstance(found, type) and found.__module__ == module)
            ):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


@functools.cache
def _dcp() -> tuple[type, type]:
    """torch.distributed.checkpoint's file reader and load planner, made to load nothing but data
    (torch's own unpickle `.metadata` and the non-tensor items, such as the optimizer's settings,
    without restriction); built on first use, since the package is slow to import."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _Unpickler(f).load()
            except (
                OSError,
                pickle.UnpicklingError,
                EOFError,
                AttributeError,
                ValueError,
                TypeError,
            ) as e:
                raise CheckpointError(
                    f"{path} cannot be read as checkpoint metadata ({type(e).__name__}: {e}); "
                    "the checkpoint is damaged"
                ) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            torch.load(
                value, weights_only=True
            )  # refuses anything but data: torch's own read below meets only that
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader, Planner


def _reader(folder: Path) -> Any:
    return _dcp()[0](str(folder))


def _planner() -> Any:
    return _dcp()[1]()


def checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _failure(error: BaseException) -> str:
    """The first underlying error of a torch.distributed.checkpoint failure (it wraps every rank's)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    if isinstance(error, CheckpointError):
        return str(error)
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


def shard_error(final: Path, error: BaseException) -> str:
    """A failed write of shards as one line: a refused write is a storage error naming the step."""
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error
    refused = os_error(cause)
    if refused is not None:
        return str(storage_error(final, refused))
    return f"cannot write the shards of {final}: {_failure(error)}"


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """torch.distributed.checkpoint warns that a load without a process group is one process's: here it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield
