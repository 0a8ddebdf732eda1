"""Epoch statistics over every sample of a stream: ComputeStats and ClassificationMetrics.

Both accumulate exact sums (in float64) batch by batch and publish into `epoch_data[stream]` after
the epoch: the mean under the variable's own name, other aggregations as `<variable>_<aggregation>`.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from phalanx.errors import ConfigError, ModelError
from phalanx.hooks.base import Hook

AGGREGATIONS = ("mean", "std", "min", "max", "sum", "count")


class ComputeStats(Hook):
    """Mean (and optionally std, min, max, sum, count) of per-sample variables over each stream."""

    def __init__(self, variables: list[str] = ("loss",), aggregations: list[str] = ("mean",)):
        for agg in aggregations:
            if agg not in AGGREGATIONS:
                raise ConfigError(f"ComputeStats: unknown aggregation {agg!r}; choose from {', '.join(AGGREGATIONS)}")
        self.variables, self.aggregations = list(variables), list(aggregations)
        self._acc: dict[tuple[str, str], dict[str, Any]] = {}
        self._needs = _reductions(self.aggregations)

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        for var in self.variables:
            value = batch.get(var)
            if value is None:
                raise ModelError(f"ComputeStats: variable {var!r} is not in the batch or the model outputs "
                                 f"({', '.join(batch)}); fix hooks ComputeStats.variables")
            v = value.detach().reshape(-1).double()
            acc = self._acc.get((stream, var))
            if acc is None:
                acc = self._acc[(stream, var)] = {"count": 0}
            acc["count"] += v.numel()
            for name, reduce, combine in self._needs:
                part = reduce(v)
                acc[name] = part if name not in acc else combine(acc[name], part)

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        for (stream, var), acc in self._acc.items():
            values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in acc.items()}
            count = values["count"]
            values["mean"] = values["sum"] / count
            if "squares" in values:
                values["std"] = math.sqrt(max(values["squares"] / count - values["mean"] ** 2, 0.0))
            target = epoch_data.setdefault(stream, {})
            for agg in self.aggregations:
                target[var if agg == "mean" else f"{var}_{agg}"] = values[agg]
        self._acc.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"acc": [[s, v, {k: (x.item() if isinstance(x, torch.Tensor) else x) for k, x in acc.items()}]
                        for (s, v), acc in self._acc.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._acc = {(s, v): {k: (x if k == "count" else torch.tensor(x, dtype=torch.float64))
                              for k, x in acc.items()} for s, v, acc in state["acc"]}


def _reductions(aggregations: list[str]) -> list:
    """(name, reduce a batch, combine with the running value) for what the aggregations need."""
    needs = [("sum", torch.sum, torch.add)]
    if "std" in aggregations:
        needs.append(("squares", lambda v: (v * v).sum(), torch.add))
    if "min" in aggregations:
        needs.append(("min", torch.min, torch.minimum))
    if "max" in aggregations:
        needs.append(("max", torch.max, torch.maximum))
    return needs


class ClassificationMetrics(Hook):
    """Accuracy and macro-averaged precision, recall and F1 of a classifier, per stream.

    `predicted` names the output holding class scores (argmax over the last dimension) or class
    indices; `gold` names the batch key holding the true class indices.
    """

    def __init__(self, predicted: str = "output", gold: str = "label", num_classes: int | None = None,
                 metrics: list[str] = ("accuracy", "f1")):
        valid = ("accuracy", "precision", "recall", "f1")
        for m in metrics:
            if m not in valid:
                raise ConfigError(f"ClassificationMetrics: unknown metric {m!r}; choose from {', '.join(valid)}")
        self.predicted, self.gold, self.num_classes, self.metrics = predicted, gold, num_classes, list(metrics)
        self._confusion: dict[str, torch.Tensor] = {}

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        for key in (self.predicted, self.gold):
            if key not in batch:
                raise ModelError(f"ClassificationMetrics: {key!r} is not in the batch or the outputs "
                                 f"({', '.join(batch)}); set predicted/gold to the right names")
        scores, gold = batch[self.predicted].detach(), batch[self.gold].detach().reshape(-1).long()
        predicted = scores.argmax(dim=-1) if scores.is_floating_point() else scores.reshape(-1).long()
        k = self.num_classes or (scores.shape[-1] if scores.is_floating_point()
                                 else int(max(gold.max(), predicted.max())) + 1)
        counts = torch.bincount(gold.cpu() * k + predicted.cpu(), minlength=k * k).reshape(k, k)
        previous = self._confusion.get(stream)
        if previous is not None and previous.shape != counts.shape:
            size = max(previous.shape[0], k)
            previous, counts = _pad(previous, size), _pad(counts, size)
        self._confusion[stream] = counts if previous is None else previous + counts

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        for stream, confusion in self._confusion.items():
            epoch_data.setdefault(stream, {}).update(_scores(confusion.double(), self.metrics))
        self._confusion.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"confusion": {s: c.tolist() for s, c in self._confusion.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._confusion = {s: torch.tensor(c, dtype=torch.long) for s, c in state["confusion"].items()}


def _pad(matrix: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, size, dtype=matrix.dtype)
    out[:matrix.shape[0], :matrix.shape[1]] = matrix
    return out


def _scores(confusion: torch.Tensor, metrics: list[str]) -> dict[str, float]:
    """Metrics from a confusion matrix (rows: true class, columns: predicted)."""
    true_pos = confusion.diag()
    present = (confusion.sum(1) > 0) | (confusion.sum(0) > 0)  # classes seen as truth or as prediction
    precision = torch.where(confusion.sum(0) > 0, true_pos / confusion.sum(0).clamp(min=1), 0.0)
    recall = true_pos / confusion.sum(1).clamp(min=1)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0)
    values = {"accuracy": (true_pos.sum() / confusion.sum()).item(),
              "precision": precision[present].mean().item(), "recall": recall[present].mean().item(),
              "f1": f1[present].mean().item()}
    return {m: values[m] for m in metrics}
