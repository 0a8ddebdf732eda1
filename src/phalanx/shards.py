"""A sharded checkpoint step's `shards/` folder: the files `torch.distributed.checkpoint` writes
(one per process, and `.metadata`), read back by any strategy on any process count, or with no model
at all (`export`). torch's own reader unpickles `.metadata`, and the non-tensor items (the
optimizer's settings), without restriction; here the metadata goes through an unpickler that accepts
only its layout records, and the items through `torch.load(weights_only=True)`, as every other file
is read.
"""

from __future__ import annotations

import contextlib
import functools
import math
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import torch
from torch import nn

from phalanx.errors import CheckpointError, CheckpointMismatch
from phalanx.files import os_error, read_json, storage_error


def save_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its part of the model's and the optimizer's state into `folder`, in the
    model's own names: an FSDP model's shards, a pipeline stage's modules; parts that several
    ranks hold alike (a stage's copies) are written once. The optimizer's settings are kept per
    parameter (torch's flattened optimizer state), so that ranks holding different parameters
    write one consistent set, and any strategy reads it back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=folder)


def load_shards(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    collective: bool = False,
    whole: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """The model's state (and the optimizer's, if given) from a shards folder, saved by any number
    of processes. `collective`: the model is sharded over the process group and every rank calls
    this, each reading the parts its shards need; otherwise this process reads the whole state
    alone. `whole`: the names and shapes of the whole model's state where `model` holds a part of
    it (a pipeline's stages), which the checkpoint must match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    reader = _reader(folder)
    metadata = reader.read_metadata()
    # steps written before the optimizer's settings were kept per parameter hold them per group
    options = StateDictOptions(
        flatten_optimizer_state_dict="optim.param_groups.0.params"
        not in metadata.state_dict_metadata
    )
    state: dict[str, Any]
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optim": optimizer_state}
    _check_fits(folder, metadata, state["model"], whole)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=_planner(), no_dist=not collective)
    # whatever the reader makes of the files
    except (Exception, checkpoint_exception()) as e:  # noqa: BLE001
        raise CheckpointError(
            f"{folder} cannot be read ({_failure(e)}); the checkpoint is damaged"
        ) from None
    try:
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=options,
            )
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"{folder} does not fit this run ({type(e).__name__}: {e}); the checkpoint is damaged "
            "or was saved from another config"
        ) from None


def read_shards_model(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model's state from a shards folder, as CPU tensors, without a model to load it
    into."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(folder)
    metadata = reader.read_metadata()
    # zeros: a crafted file's chunks may overlap and leave a gap, which must not show the process's
    # memory (the metadata's checks bound the size by the files)
    state = {
        key[len("model.") :]: torch.zeros(meta.size, dtype=meta.properties.dtype)
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


def _check_fits(
    folder: Path, metadata: Any, model_state: dict, whole: dict[str, tuple[int, ...]] | None = None
) -> None:
    """The saved model's names and shapes are this model's (`whole`'s, where given): else a
    CheckpointMismatch."""
    saved = {
        key[len("model.") :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    mine = (
        whole
        if whole is not None
        else {
            key: tuple(value.shape)
            for key, value in model_state.items()
            if isinstance(value, torch.Tensor)
        }
    )
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
    """The shards' `.metadata` holds only checkpoint-layout records, paths, and torch's dtype,
    layout and size objects: nothing else in it is loaded (torch's own reader unpickles it without
    restriction). Each record is named one by one: a module's other classes (a process launcher, a
    stager that makes folders) would run their constructors."""

    _NAMED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            ("pathlib", name)
            for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
        ),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class _Damaged(ValueError):
    """A `.metadata` whose records are not what torch writes."""


def _check_metadata(metadata: Any, folder: Path) -> Any:
    """`metadata` if every record holds what torch writes, field by field, every file it names is a
    file of this step's manifest (inside the folder, covered by its hashes), and it claims no more
    than those files hold; else _Damaged."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata:
        raise _Damaged(f"it holds a {type(metadata).__name__}, not checkpoint metadata")
    entries = _mapping(metadata.state_dict_metadata, "state_dict_metadata")
    storage = _mapping(metadata.storage_data, "storage_data", keys=object)
    files = _manifest_files(folder)
    _check_counts(entries, storage, files)
    for key, entry in entries.items():
        if type(entry) is TensorStorageMetadata:
            _check_tensor(entry, key)
        elif type(entry) is not BytesStorageMetadata:
            raise _Damaged(f"the entry of {key!r} is a {type(entry).__name__}")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
            raise _Damaged("storage_data holds a key that is not a record's index")
        if not (index.offset is None or _is_size(index.offset)) or not _optional_int(index.index):
            raise _Damaged(f"the index of {index.fqn!r} is malformed")
        if type(info) is not _StorageInfo or not _stored_at(info):
            raise _Damaged(f"where {index.fqn!r} is stored is malformed")
        if info.relative_path not in files:
            raise _Damaged(
                f"{index.fqn!r} is said to be in {info.relative_path!r}, which is not a file of "
                "this step's manifest"
            )
    _check_extents(storage, files)
    for key, entry in entries.items():
        if type(entry) is TensorStorageMetadata:
            _check_chunks(key, entry, storage)
    for key, path in _mapping(metadata.planner_data or {}, "planner_data").items():
        if not isinstance(path, (tuple, list)) or not all(isinstance(p, (str, int)) for p in path):
            raise _Damaged(f"the planner's path of {key!r} is malformed")
    meta = metadata.storage_meta
    if meta is not None and (
        type(meta) is not StorageMeta
        or not isinstance(meta.checkpoint_id, (str, PurePath, type(None)))
        or not all(isinstance(v, (str, type(None))) for v in (meta.save_id, meta.load_id))
    ):
        raise _Damaged("its storage record is malformed")
    if not isinstance(metadata.version, (str, type(None))):
        raise _Damaged("its version is malformed")
    return metadata


def _mapping(value: Any, what: str, keys: type = str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, keys) for k in value):
        raise _Damaged(f"its {what} is not a mapping of the records torch writes")
    return value


def _check_tensor(entry: Any, key: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    props = entry.properties
    if (
        type(props) is not TensorProperties
        or not isinstance(props.dtype, torch.dtype)
        or not isinstance(props.layout, torch.layout)
        or not isinstance(props.memory_format, torch.memory_format)
        or not all(isinstance(v, bool) for v in (props.requires_grad, props.pin_memory))
        or not _is_size(entry.size)
        or not isinstance(entry.chunks, list)
        or not all(
            type(c) is ChunkStorageMetadata
            and _is_size(c.offsets)
            and _is_size(c.sizes)
            and len(c.offsets) == len(c.sizes) == len(entry.size)
            for c in entry.chunks
        )
    ):
        raise _Damaged(f"the record of tensor {key!r} is malformed")


def _check_counts(entries: dict, storage: dict, files: dict[str, int]) -> None:
    """Before any record is checked one by one: no more stored items than the files have bytes
    (each takes one at least), and no more chunks, over every tensor, than stored items (each is
    stored apart). A record that the file's pickle refers to a million times costs a few bytes, and
    each reference would cost a read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held = sum(files.values())
    if len(storage) > held:
        raise _Damaged(
            f"it lists {len(storage):,} stored items, more than its files' {held:,} bytes"
        )
    chunks = sum(
        len(entry.chunks) if isinstance(entry.chunks, list) else 0
        for entry in entries.values()
        if type(entry) is TensorStorageMetadata
    )
    if chunks > len(storage):
        raise _Damaged(f"its tensors have {chunks:,} chunks, but {len(storage):,} stored items")


def _check_extents(storage: dict, files: dict[str, int]) -> None:
    """Each stored item lies inside its file, untransformed (phalanx compresses nothing: a
    compressed item could claim any size), and no two overlap: together they hold no more bytes
    than the files."""
    extents: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        end, size = info.offset + info.length, files[info.relative_path]
        if info.transform_descriptors:
            raise _Damaged(f"{index.fqn!r} is stored transformed ({info.transform_descriptors})")
        if info.length < 1 or end > size:
            raise _Damaged(
                f"{index.fqn!r} is said to lie at bytes {info.offset:,} to {end:,} of "
                f"{info.relative_path!r}, which has {size:,}"
            )
        extents.setdefault(info.relative_path, []).append((info.offset, end))
    for path, spans in extents.items():
        spans.sort()
        if any(start < end for (_, end), (start, _) in zip(spans, spans[1:], strict=False)):
            raise _Damaged(f"two items stored in {path!r} overlap")


def _check_chunks(key: str, entry: Any, storage: dict) -> None:
    """A tensor's chunks lie inside it, each once, each stored in an item of its size at least, and
    together hold its elements: what the tensor claims, its files hold (an 8 TB tensor claimed in a
    small file is refused here, not by the allocator)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    itemsize, seen, elements = entry.properties.dtype.itemsize, set(), 0
    for chunk in entry.chunks:
        if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
            raise _Damaged(f"a chunk of tensor {key!r} lies outside its size {tuple(entry.size)}")
        if chunk.offsets in seen:
            raise _Damaged(f"tensor {key!r} lists its chunk at {tuple(chunk.offsets)} twice")
        seen.add(chunk.offsets)
        stored = storage.get(MetadataIndex(key, chunk.offsets))
        count = math.prod(chunk.sizes)
        if stored is None or count * itemsize > stored.length:
            raise _Damaged(
                f"the chunk of tensor {key!r} at {tuple(chunk.offsets)} has {count:,} elements, "
                "more than is stored for it"
            )
        elements += count
    if elements != math.prod(entry.size):
        raise _Damaged(
            f"the chunks of tensor {key!r} hold {elements:,} elements, not its "
            f"{math.prod(entry.size):,}"
        )


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and n >= 0 for n in value)


def _optional_int(value: Any) -> bool:
    return value is None or (type(value) is int and value >= 0)


def _stored_at(info: Any) -> bool:
    descriptors = info.transform_descriptors
    return (
        isinstance(info.relative_path, str)
        and type(info.offset) is int
        and type(info.length) is int
        and info.offset >= 0
        and info.length >= 0
        and (descriptors is None or all(isinstance(d, str) for d in descriptors))
    )


def _manifest_files(folder: Path) -> dict[str, int]:
    """The shards folder's files that its step's manifest covers, by name, with their sizes: the
    only files a load may read (a name with a folder in it, `..` above all, is none of them)."""
    path = folder.parent / "manifest.json"
    try:
        files = read_json(path)["files"]
        names = [name for name in files if isinstance(name, str)]
    except (OSError, ValueError, KeyError, TypeError):
        raise _Damaged(f"its step's {path.name} is missing or unreadable") from None
    prefix = folder.name + "/"
    inside = {name[len(prefix) :] for name in names if name.startswith(prefix)}
    covered = [n for n in inside if PurePosixPath(n).name == n and n not in ("", "..")]
    try:
        return {name: (folder / name).stat().st_size for name in covered}
    except OSError as e:
        raise _Damaged(f"a file of its step's {path.name} is missing ({e.strerror})") from None


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
                    metadata = _check_metadata(_Unpickler(f).load(), Path(self.path))
            except _Damaged as e:
                raise CheckpointError(
                    f"{path} is not checkpoint metadata as torch writes it ({e}); the checkpoint "
                    "is damaged"
                ) from None
            except Exception as e:  # noqa: BLE001 - only data is built: any failure is a damaged file
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
            # refuses anything but data: torch's own read below meets only that
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader, Planner


def _reader(folder: Path) -> Any:
    return _dcp()[0](str(folder))


def _planner() -> Any:
    return _dcp()[1]()


def checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _failure(error: BaseException) -> str:
    """The first underlying error of a torch.distributed.checkpoint failure (which wraps every
    rank's)."""
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
    """torch.distributed.checkpoint warns that a load without a process group is one process's: here
    it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield
