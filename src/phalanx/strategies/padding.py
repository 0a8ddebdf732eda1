"""A copy's shard of a pipeline step as the schedule takes it: cut into the schedule's micro-batches
of `rows` samples each and padded with rows of zeros to fill them (every stage runs every
micro-batch, in step with the others), with each row's weight (1 real, 0 padding) and each
micro-batch's real samples, its keys prefixed so that none is taken for an argument of the
schedule's own."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from phalanx.errors import ConfigError

# before each batch key passed to the schedule: none may be its own argument
KEY = "batch_"


class Padding:
    """The shards of a run's steps, each padded to `rows` x `microbatches` rows."""

    def __init__(self, rows: int, microbatches: int):
        self.rows, self.total = rows, rows * microbatches
        # each key's shape beyond the batch dimension, which every batch keeps (set by the first)
        self.shapes: dict[str, torch.Size] = {}
        self.counts: list[int] = []  # the real samples of each micro-batch of the last shard
        # the rows' weights by real-sample count, on the host: read without a device sync
        self._weights: dict[int, torch.Tensor] = {}

    def pad(self, batch: Mapping, n: int) -> tuple[dict, torch.Tensor]:
        """A shard of `n` samples padded, its keys prefixed, and each row's weight."""
        if n > self.total:
            raise RuntimeError(f"a shard of {n} samples does not fit {self.total} pipeline rows")
        padded = pad(batch, self.total)
        for key, value in padded.items():
            if value.shape[1:] != self.shapes.get(key, value.shape[1:]):
                raise ConfigError(
                    f"the pipeline strategy needs every batch's {key!r} in one shape beyond the "
                    f"batch dimension: the first was {tuple(self.shapes[key])}, this one "
                    f"{tuple(value.shape[1:])}; pad the dataset's samples to one length"
                )
        real = self._weights.get(n)
        if real is None:
            real = self._weights[n] = torch.zeros(self.total, dtype=torch.float64)
            real[:n] = 1.0
        rows = self.rows
        self.counts = [min(max(n - i * rows, 0), rows) for i in range(self.total // rows)]
        return {KEY + k: v for k, v in padded.items()}, real


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


def rows_of(batch: Mapping) -> int:
    """The batch's samples: its first tensor's rows (0 where it holds none)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    return 0
