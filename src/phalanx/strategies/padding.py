"""A copy's shard of a pipeline step as the schedule takes it: cut into the schedule's micro-batches
of `rows` samples each and padded with rows of zeros to fill them (every stage runs every
micro-batch, in step with the others), with each row's weight (1 real, 0 padding) and each
micro-batch's real samples; and the last stage's outputs of those micro-batches, joined back for
the hooks (`Joined`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import overload

import torch

from phalanx.engine import concat
from phalanx.errors import ConfigError


class Padding:
    """The shards of a run's steps, each padded to `rows` x `microbatches` rows."""

    def __init__(self, rows: int, microbatches: int):
        self.rows, self.total = rows, rows * microbatches
        # each key's shape beyond the batch dimension, which every batch keeps (set by the first)
        self.shapes: dict[str, torch.Size] = {}
        self.counts: list[int] = []  # the real samples of each micro-batch of the last shard
        # the rows' weights and each micro-batch's real samples, by the shard's real-sample count
        # (the weights on the host: read without a device sync)
        self._by_count: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def pad(self, batch: Mapping, n: int) -> tuple[dict, torch.Tensor]:
        """A shard of `n` samples padded, and each row's weight."""
        if n > self.total:
            raise RuntimeError(f"a shard of {n} samples does not fit {self.total} pipeline rows")
        padded = pad(batch, self.total)
        shapes = self.shapes
        for key, value in padded.items():
            shape = value.shape[1:]
            if shape != shapes.get(key, shape):
                raise ConfigError(
                    f"the pipeline strategy needs every batch's {key!r} in one shape beyond the "
                    f"batch dimension: the first was {tuple(self.shapes[key])}, this one "
                    f"{tuple(value.shape[1:])}; pad the dataset's samples to one length"
                )
        known = self._by_count.get(n)
        if known is None:
            real = torch.zeros(self.total, dtype=torch.float64)
            real[:n] = 1.0
            rows = self.rows
            counts = [min(max(n - i * rows, 0), rows) for i in range(self.total // rows)]
            known = self._by_count[n] = (real, counts)
        real, self.counts = known
        return padded, real


def pad(batch: Mapping, rows: int) -> dict[str, torch.Tensor]:
    """Each of the batch's tensors with rows of zeros added up to `rows`."""
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or not value.dim():
            raise ConfigError(
                f"the pipeline strategy sends tensors through its stages, but the batch's {key!r} "
                f"is a {type(value).__name__}; give the model tensors only"
            )
        n = value.shape[0]
        if n < rows:
            value = torch.cat((value, value.new_zeros((rows - n, *value.shape[1:]))))
        out[key] = value
    return out


def chunks(batch: Mapping[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """The batch in `count` micro-batches of equal rows (views), as a schedule would split it."""
    parts = [(key, value.tensor_split(count)) for key, value in batch.items()]
    return [{key: split[i] for key, split in parts} for i in range(count)]


def rows_of(batch: Mapping) -> int:
    """The batch's samples: its first tensor's rows (0 where it holds none)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    return 0


class Joined(Sequence):
    """A step's outputs, one per micro-batch: each the last stage's outputs of the schedule's
    micro-batches, joined where it is first read (a step whose outputs no hook reads joins none).
    None: a micro-batch of this process's that gave none."""

    def __init__(self, chunks: list[list[dict] | None]):
        self._chunks = chunks
        self._joined: dict[int, dict | None] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    @overload
    def __getitem__(self, i: int) -> dict | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict | None]: ...

    def __getitem__(self, i: int | slice) -> dict | None | list[dict | None]:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self))[i]]
        if i < 0:
            i += len(self._chunks)
        if not 0 <= i < len(self._chunks):
            raise IndexError(f"index {i} of a step's {len(self._chunks)} micro-batches")
        if i not in self._joined:
            chunks = self._chunks[i]
            self._joined[i] = None if chunks is None else concat(chunks)
        return self._joined[i]
