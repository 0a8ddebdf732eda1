"""Items as batches: stacking a shard's items into one dict (`collate`, with errors that say which
key of which items could not be batched), a batch's size, an empty batch shaped like an item, and
streams whose items dataset.keys names (`named`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from phalanx.data import is_iterable
from phalanx.errors import DataError, first_line


def collate(
    items: list[Any], name: str = "", keys: tuple[str, ...] | None = None
) -> dict[str, Any] | None:
    """Stack a list of dict items into a dict batch; an empty shard is None. Items that cannot be
    stacked are a DataError naming the stream `name`, the key and how the items differ. With
    `keys` (dataset.keys), items that are tuples, lists or tensors are stacked as they are and the
    batch is named: one dict per batch, not per sample."""
    if not items:
        return None
    return _stack(items, name, keys)


def _stack(items: list[Any], name: str, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One or more items as a batch (see `collate`)."""
    if keys is not None and not isinstance(items[0], Mapping):
        return _named_batch(items, keys, name)
    if type(items[0]) is not dict and not isinstance(items[0], Mapping):
        kind = type(items[0]).__name__
        named = (
            "name their parts with dataset.keys, e.g. dataset.keys: [image, label], or return a "
            "dict"
            if isinstance(items[0], (tuple, list))
            else "name them with dataset.keys: [x], or return a dict"
        )
        raise DataError(
            f"dataset items must be dicts of named values, e.g. {{'image': x, 'label': y}}; got "
            f"{kind}: {named} from __getitem__"
        )
    batch = _stacked(items)
    if batch is not None:
        return batch
    try:
        return default_collate(items)
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as e:
        raise DataError(_why_not_batched(items, name, e)) from e


def _stacked(items: list[Any], keys: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """`default_collate`'s batch of the common items, made as it makes it, without its Python for
    every value (its type dispatch costs a small model's step more Python than phalanx's whole loop
    adds: BENCHMARKS.md): plain dicts, or tuples and lists named by `keys` (dataset.keys), whose
    values are dense tensors (`torch.stack` of each part's values), ints or floats (`torch.tensor`
    of them, float64 for floats), in the first item's order. None for any other batch, which
    `default_collate` makes (and where it fails, says why), and in a DataLoader worker, where it
    stacks into shared memory."""
    first = items[0]
    if get_worker_info() is not None:
        return None
    if type(first) is dict:
        parts: list[tuple[Any, Any, Any]] = list(zip(first, first, first.values(), strict=True))
    elif keys is not None and type(first) in (tuple, list) and len(first) == len(keys):
        try:
            if set(map(len, items)) != {len(keys)}:  # default_collate refuses uneven items
                return None
        except TypeError:  # an item without a length
            return None
        parts = list(zip(keys, range(len(keys)), first, strict=True))
    else:
        return None
    # every part's kind first: a batch this cannot make is left whole to default_collate, with
    # nothing stacked twice
    for _, _, value in parts:
        kind = type(value)
        if kind is torch.Tensor:
            if value.layout is not torch.strided or value.is_nested:
                return None
        elif kind is not int and kind is not float:
            return None
    batch = {}
    try:
        for name, part, value in parts:
            values = [item[part] for item in items]
            kind = type(value)
            if kind is torch.Tensor:
                batch[name] = torch.stack(values)
            else:
                batch[name] = torch.tensor(values, dtype=torch.float64 if kind is float else None)
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError):
        return None
    return batch


def name_item(item: Any, keys: Sequence[str], name: str) -> Any:
    """An item as a dict: the parts of a tuple or list under `keys` in order, a tensor or other one
    value under its one key; a dict as it is."""
    if isinstance(item, Mapping):
        return item
    if isinstance(item, (tuple, list)):
        if len(item) != len(keys):
            raise DataError(
                f"stream {name!r}: an item has {len(item)} parts but dataset.keys names "
                f"{len(keys)} ({', '.join(keys)}); give one name per part"
            )
        return dict(zip(keys, item, strict=True))
    if len(keys) != 1:
        raise DataError(
            f"stream {name!r}: an item is a {type(item).__name__}, one value, but dataset.keys "
            f"names {len(keys)}; give it one name"
        )
    return {keys[0]: item}


def _named_batch(items: list[Any], keys: tuple[str, ...], name: str) -> dict[str, Any]:
    stacked = _stacked(items, keys)
    if stacked is not None:
        return stacked
    first = items[0]
    parts = len(first) if isinstance(first, (tuple, list)) else None
    if parts == len(keys) or (parts is None and len(keys) == 1):
        try:
            batch = default_collate(items)
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError):
            # named one by one below, for the error that says which item or key
            pass
        else:
            if parts is None:
                return {keys[0]: batch}
            if len(batch) == len(keys):
                return dict(zip(keys, batch, strict=True))
    return _stack([name_item(item, keys, name) for item in items], name)


def _why_not_batched(items: list[Any], name: str, error: Exception) -> str:
    """Which key of the items default_collate could not batch, and how its values differ (found
    only after a failure, so batching that works pays nothing for it)."""
    where = f"stream {name!r}" if name else "a batch"
    keys = set(items[0])
    for item in items[1:]:
        if not isinstance(item, Mapping) or set(item) != keys:
            other = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            return (
                f"{where}: items hold different keys ({sorted(keys)} and {other}); every item of a "
                "stream must hold the same keys"
            )
    for key in items[0]:
        values = [item[key] for item in items]
        try:
            default_collate(values)
        except Exception as e:  # noqa: BLE001 - any failure of this key is the one to report
            return f"{where}, key {key!r}: {_how_values_differ(values, key, e)}"
    return f"{where}: the items cannot be batched ({first_line(error)})"


def _how_values_differ(values: list[Any], key: str, error: Exception) -> str:
    shapes = [tuple(v.shape) for v in values if hasattr(v, "shape")]  # tensors and numpy arrays
    if len(shapes) == len(values) and len(set(shapes)) > 1:
        distinct = list(dict.fromkeys(shapes))
        shown = " and ".join(str(list(shape)) for shape in distinct[:3]) + (
            " ..." if len(distinct) > 3 else ""
        )
        return (
            f"items of different shapes {shown} cannot be stacked into one batch; give every "
            f"item's {key!r} one shape in the dataset (pad or crop it)"
        )
    types = list(dict.fromkeys(type(v).__name__ for v in values))
    if len(types) > 1:
        return (
            f"items hold values of different types ({', '.join(types)}); give every item's "
            f"{key!r} one type"
        )
    return (
        f"{first_line(error)}; an item's values must be tensors of one shape, numbers or strings, "
        "or dicts and lists of them"
    )


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise DataError(
        f"a batch holds no tensor with a batch dimension (keys: {', '.join(batch)}); "
        "items must hold tensors or numbers"
    )


def empty_like(item: Any, name: str) -> dict[str, Any]:
    batch = _stack([item], name)
    return {
        k: v[:0].clone() if isinstance(v, torch.Tensor) else v[:0] if isinstance(v, list) else v
        for k, v in batch.items()
    }


class _Named:
    """Items of another stream as dicts (see `name_item`). DataLoaders read the stream itself and
    name whole batches instead (`collate`): naming every sample in Python cost a tenth of
    a small model's step."""

    def __init__(self, stream: Any, keys: Sequence[str], name: str):
        self.stream, self.keys, self.name = stream, tuple(keys), name

    def _named(self, item: Any) -> Any:
        return name_item(item, self.keys, self.name)


class NamedItems(_Named):
    """A map-style stream whose items `_Named` names."""

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, i: int) -> Any:
        return self._named(self.stream[i])


class NamedStream(_Named, IterableDataset):
    """An iterable stream whose items `_Named` names; its position and epoch are the stream's."""

    def __iter__(self) -> Iterator[Any]:
        return map(self._named, self.stream)

    def __len__(self) -> int:
        # a TypeError where the stream has no length, as len() of it would give
        return len(self.stream)

    def __getattr__(self, attribute: str) -> Any:
        # set_epoch, state_dict, load_state_dict, __len__ ...
        if attribute == "stream":
            raise AttributeError(attribute)
        return getattr(self.stream, attribute)


def named(stream: Any, keys: Sequence[str] | None, name: str) -> Any:
    """`stream` with its items named by `keys` (dataset.keys), or itself where there are none."""
    if not keys:
        return stream
    return (
        NamedStream(stream, keys, name) if is_iterable(stream) else NamedItems(stream, keys, name)
    )
