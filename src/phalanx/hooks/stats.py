"""Epoch statistics over every sample of a stream: ComputeStats and ClassificationMetrics.

Both accumulate exact sums (in float64) as batches come and publish into `epoch_data[stream]` after
the epoch: the mean under the variable's own name, other aggregations as `<variable>_<aggregation>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.errors import ConfigError, ModelError
from phalanx.hooks.base import Hook, reads_no_loss
from phalanx.hooks.variables import check_positive

AGGREGATIONS = ("mean", "std", "min", "max", "sum", "count")
WEIGHT = "loss_weight"
# sums of w, w * x and w * x^2, where weighted
_WEIGHTED = ("weights", "weighted", "weighted_squares")


class ComputeStats(Hook):
    """Mean (and optionally std, min, max, sum, count) of per-sample variables over each stream. The
    loss of a model that weighs its samples (`loss_weight`, such as real tokens) has the weighted
    mean and std, sum(w_i l_i) / sum(w_i): the objective that training minimises."""

    reads_loss = reads_no_loss

    # sums are added over ranks at the end of the epoch instead
    gathers = False
    # values held back before they are reduced together
    FLUSH_ELEMENTS = 1 << 16

    def __init__(
        self, variables: Sequence[str] = ("loss",), aggregations: Sequence[str] = ("mean",)
    ):
        for agg in aggregations:
            if agg not in AGGREGATIONS:
                raise ConfigError(
                    f"ComputeStats: unknown aggregation {agg!r}; choose from "
                    f"{', '.join(AGGREGATIONS)}"
                )
        self.variables, self.aggregations = list(variables), list(aggregations)
        self._acc: dict[tuple[str, str], dict[str, Any]] = {}
        # Batches wait here and are reduced together: a few reductions per many steps instead of
        # several small ones every step.
        self._pending: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._pending_elements = 0
        # each pending value's weight, where weighted
        self._weights: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._needs = _reductions(self.aggregations)

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if not batch:  # this rank had no samples in the batch
            return
        pending = self._pending
        for var in self.variables:
            value = batch.get(var)
            if value is None:
                raise ModelError(
                    f"ComputeStats: variable {var!r} is not in the batch or the model outputs "
                    f"({', '.join(batch)}); fix hooks ComputeStats.variables"
                )
            if value.requires_grad or value.dim() != 1:
                value = value.detach().reshape(-1)
            values = pending.get((stream, var))
            if values is None:
                values = pending[(stream, var)] = []
            values.append(value)
            self._pending_elements += value.numel()
            if var == "loss" and WEIGHT in batch:
                weights = self._weights.setdefault((stream, var), [])
                weights.append(batch[WEIGHT].reshape(-1))
        if self._pending_elements >= self.FLUSH_ELEMENTS:
            self._flush()

    def _flush(self) -> None:
        """Fold the waiting batches into the running values."""
        for key, values in self._pending.items():
            v = values[0] if len(values) == 1 else torch.cat(values)
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = {"count": 0}
            acc["count"] += v.numel()
            for name, reduce, combine in self._needs:
                part = reduce(v)
                acc[name] = part if name not in acc else combine(acc[name], part)
            weights = self._weights.get(key)
            if weights:
                w, v = torch.cat(weights).double(), v.double()
                for name, part in (
                    ("weights", w.sum()),
                    ("weighted", (w * v).sum()),
                    ("weighted_squares", (w * v * v).sum()),
                ):
                    acc[name] = acc.get(name, 0.0) + part
        self._pending.clear()
        self._weights.clear()
        self._pending_elements = 0

    def computes(self, stream: str) -> list[str]:
        return [v if a == "mean" else f"{v}_{a}" for v in self.variables for a in self.aggregations]

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        for (stream, var), values in self._global().items():
            count = values["count"]
            if not count:
                continue
            values["mean"] = values["sum"] / count
            values["std"] = math.sqrt(max(values["squares"] / count - values["mean"] ** 2, 0.0))
            # weighted: the mean and spread the objective has
            if values["weights"] > 0:
                values["mean"] = values["weighted"] / values["weights"]
                values["std"] = math.sqrt(
                    max(values["weighted_squares"] / values["weights"] - values["mean"] ** 2, 0.0)
                )
            target = epoch_data.setdefault(stream, {})
            for agg in self.aggregations:
                target[var if agg == "mean" else f"{var}_{agg}"] = (
                    int(count) if agg == "count" else values[agg]
                )
        self._acc.clear()

    def _global(self) -> dict[tuple[str, str], dict[str, float]]:
        """Every rank's running values combined: sums added, minima and maxima taken."""
        self._flush()
        strategy = self.strategy
        keys = sorted(
            {tuple(k) for ranks_keys in strategy.gather(sorted(self._acc)) for k in ranks_keys}
        )
        if not keys:
            return {}

        def column(name: str, default: float) -> torch.Tensor:
            return torch.tensor(
                [
                    float(self._acc[k].get(name, default)) if k in self._acc else default
                    for k in keys
                ],
                dtype=torch.float64,
                device=strategy.device,
            )

        added = ("count", "sum", "squares", *_WEIGHTED)
        sums = strategy.reduce(torch.stack([column(name, 0.0) for name in added]))
        low = strategy.reduce(column("min", math.inf), "min")
        high = strategy.reduce(column("max", -math.inf), "max")
        return {
            key: {
                **{name: sums[j, i].item() for j, name in enumerate(added)},
                "min": low[i].item(),
                "max": high[i].item(),
            }
            for i, key in enumerate(keys)
        }

    def state_dict(self) -> dict[str, Any]:
        """The epoch's running values, combined over ranks (any device count resumes them)."""
        return {"acc": [[s, v, values] for (s, v), values in self._global().items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending.clear()
        self._weights.clear()
        self._pending_elements = 0
        # Sums go to rank 0 alone, so that adding over ranks counts them once; minima and maxima
        # may stand everywhere.
        first = self.strategy.rank == 0
        self._acc = {
            (s, v): {
                "count": int(values["count"]) if first else 0,
                **{
                    k: torch.tensor(values.get(k, 0.0) if first else 0.0, dtype=torch.float64)
                    for k in ("sum", "squares", *_WEIGHTED)
                },
                **{k: torch.tensor(values[k], dtype=torch.float64) for k in ("min", "max")},
            }
            for s, v, values in state["acc"]
        }


# a sum's name, how a batch is reduced to it, and how two of it combine
_Reduction = tuple[
    str,
    Callable[[torch.Tensor], torch.Tensor],
    Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
]


def _reductions(aggregations: Sequence[str]) -> list[_Reduction]:
    """(name, reduce a batch, combine with the running value) for what the aggregations need."""
    needs: list[_Reduction] = [("sum", lambda v: v.sum(dtype=torch.float64), torch.add)]
    if "std" in aggregations:
        needs.append(("squares", lambda v: (v.double() ** 2).sum(), torch.add))
    if "min" in aggregations:
        needs.append(("min", lambda v: v.min().double(), torch.minimum))
    if "max" in aggregations:
        needs.append(("max", lambda v: v.max().double(), torch.maximum))
    return needs


class ClassificationMetrics(Hook):
    """Accuracy and macro-averaged precision, recall and F1 of a classifier, per stream.

    `predicted` names the output holding class scores (argmax over the last dimension) or class
    indices; `gold` names the batch key holding the true class indices. The counts stay where the
    outputs are (a GPU's memory) until the epoch's end; where `predicted` holds class indices, give
    `num_classes`, or each batch's largest class is read back to size the matrix.
    """

    reads_loss = reads_no_loss

    # confusion matrices are added over ranks at the end of the epoch instead
    gathers = False

    def __init__(
        self,
        predicted: str = "output",
        gold: str = "label",
        num_classes: int | None = None,
        metrics: Sequence[str] = ("accuracy", "f1"),
    ):
        check_positive("ClassificationMetrics", least=1, num_classes=num_classes)
        valid = ("accuracy", "precision", "recall", "f1")
        for m in metrics:
            if m not in valid:
                raise ConfigError(
                    f"ClassificationMetrics: unknown metric {m!r}; choose from {', '.join(valid)}"
                )
        self.predicted, self.gold, self.num_classes, self.metrics = (
            predicted,
            gold,
            num_classes,
            list(metrics),
        )
        self._confusion: dict[str, torch.Tensor] = {}
        # samples of a class (true or predicted) outside the matrix, refused at the epoch's end
        self._outside: dict[str, torch.Tensor] = {}

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if not batch:  # this rank had no samples in the batch
            return
        for key in (self.predicted, self.gold):
            if key not in batch:
                raise ModelError(
                    f"ClassificationMetrics: {key!r} is not in the batch or the outputs "
                    f"({', '.join(batch)}); set predicted/gold to the right names"
                )
        scores, gold = batch[self.predicted].detach(), batch[self.gold].detach().reshape(-1).long()
        predicted = (
            scores.argmax(dim=-1).reshape(-1)
            if scores.is_floating_point()
            else scores.reshape(-1).long()
        )
        if predicted.numel() != gold.numel():
            raise ModelError(
                f"ClassificationMetrics: {self.predicted!r} gives {predicted.numel()} predicted "
                f"classes (shape {tuple(scores.shape)}) but {self.gold!r} {gold.numel()} gold ones "
                f"(shape {tuple(batch[self.gold].shape)}); set predicted to the class scores (or "
                "classes) and gold to the true classes, one per sample or token"
            )
        k = self.num_classes or (
            scores.shape[-1]
            if scores.is_floating_point()
            else int(max(gold.max(), predicted.max())) + 1
        )
        # counted where the outputs are: on a GPU, nothing is read back until the epoch's end
        # (bincount would read the classes' range); a pair outside k classes in a bucket of its own
        gold = gold.to(predicted.device)
        inside = (gold >= 0) & (gold < k) & (predicted >= 0) & (predicted < k)
        pairs = torch.where(inside, gold * k + predicted, k * k)
        counts = torch.zeros(k * k + 1, dtype=torch.long, device=pairs.device)
        counts.scatter_add_(0, pairs, torch.ones_like(pairs))
        outside = self._outside.get(stream)
        self._outside[stream] = counts[-1] if outside is None else outside + counts[-1]
        counts = counts[:-1].reshape(k, k)
        previous = self._confusion.get(stream)
        if previous is not None:
            previous = previous.to(counts.device)  # a resumed count comes from the host
            if previous.shape != counts.shape:
                size = max(previous.shape[0], k)
                previous, counts = _pad(previous, size), _pad(counts, size)
        self._confusion[stream] = counts if previous is None else previous + counts

    def computes(self, stream: str) -> list[str]:
        return list(self.metrics)

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        counted = self._global()
        self._confusion.clear()
        self._outside.clear()
        for stream, (confusion, outside) in counted.items():
            if outside:
                raise ModelError(
                    f"ClassificationMetrics: {outside} samples of stream {stream!r} have a class "
                    f"outside 0-{confusion.shape[0] - 1} in {self.gold!r} or {self.predicted!r} "
                    "(a negative label, such as an ignored -100, or one the scores have no "
                    "column for); give labels of the model's classes, or set num_classes"
                )
            if confusion.sum() > 0:
                epoch_data.setdefault(stream, {}).update(_scores(confusion.double(), self.metrics))

    def _global(self) -> dict[str, tuple[torch.Tensor, int]]:
        """Confusion matrices added over ranks (padded to the largest class count any rank saw),
        and the samples outside them."""
        strategy = self.strategy
        seen = strategy.gather({s: c.shape[0] for s, c in self._confusion.items()})
        sizes: dict[str, int] = {}
        for rank_sizes in seen:
            for stream, k in rank_sizes.items():
                sizes[stream] = max(sizes.get(stream, 0), k)
        out = {}
        for stream in sorted(sizes):
            local = self._confusion.get(stream, torch.zeros(0, 0, dtype=torch.long))
            outside = self._outside.get(stream, torch.zeros((), dtype=torch.long))
            local = _pad(local.to(strategy.device), sizes[stream]).reshape(-1)
            both = strategy.reduce(torch.cat((local, outside.to(strategy.device).reshape(1))))
            both = both.cpu()
            out[stream] = both[:-1].reshape(sizes[stream], -1), int(both[-1])
        return out

    def state_dict(self) -> dict[str, Any]:
        counted = self._global()
        return {
            "confusion": {s: c.tolist() for s, (c, _) in counted.items()},
            "outside": {s: n for s, (_, n) in counted.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # counts go to one rank, so adding over ranks counts them once
        first = int(self.strategy.rank == 0)
        self._confusion = {
            s: torch.tensor(c, dtype=torch.long) * first for s, c in state["confusion"].items()
        }
        self._outside = {
            s: torch.tensor(n * first, dtype=torch.long)
            for s, n in state.get("outside", {}).items()
        }


def _pad(matrix: torch.Tensor, size: int) -> torch.Tensor:
    out = matrix.new_zeros(size, size)
    out[: matrix.shape[0], : matrix.shape[1]] = matrix
    return out


def _scores(confusion: torch.Tensor, metrics: list[str]) -> dict[str, float]:
    """Metrics from a confusion matrix (rows: true class, columns: predicted)."""
    true_pos = confusion.diag()
    # classes seen as truth or as prediction
    present = (confusion.sum(1) > 0) | (confusion.sum(0) > 0)
    precision = torch.where(confusion.sum(0) > 0, true_pos / confusion.sum(0).clamp(min=1), 0.0)
    recall = true_pos / confusion.sum(1).clamp(min=1)
    f1 = torch.where(
        precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300), 0.0
    )
    values = {
        "accuracy": (true_pos.sum() / confusion.sum()).item(),
        "precision": precision[present].mean().item(),
        "recall": recall[present].mean().item(),
        "f1": f1[present].mean().item(),
    }
    return {m: values[m] for m in metrics}
