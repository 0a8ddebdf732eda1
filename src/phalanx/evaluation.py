"""A checkpoint on a stream, in one process: its metrics (`phalanx eval`, `phalanx.evaluate`) and
its per-sample values (`phalanx predict`, `phalanx.predict`), written as CSV or safetensors."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from phalanx import config, data, logs, rundir
from phalanx.files import write_atomic, write_text_atomic
from phalanx.hooks import ClassificationMetrics, ComputeStats, Hook, build_hooks
from phalanx.objects import Objects, check_given
from phalanx.trainer import Trainer

log = logging.getLogger("phalanx")


def _open(
    run_path: str | os.PathLike, command: str, objects: Objects | None = None
) -> tuple[Path, config.Config]:
    """A run and its config for one process on one device (checkpoints carry no device count); a
    run trained with objects needs them again."""
    # first: opening the run logs where its classes come from
    logs.setup(None)
    objects = objects or Objects()
    run_dir = rundir.open_run(
        Path(run_path), announce=objects.model is None or objects.dataset is None
    )
    check_given(run_dir, objects, command)
    one = [
        "parallel.devices=1",
        "parallel.strategy=auto",
        "parallel.shard_weights=null",
        "model.n_gpus=null",
    ]
    return run_dir, config.validate(
        objects.into(config.apply_overrides(rundir.load_config_text(run_dir), one))
    )


def _restore(
    run_dir: Path,
    cfg: config.Config,
    which: str | int,
    hooks: Sequence[Hook],
    stream: str,
    objects: Objects | None = None,
) -> tuple[Trainer, int]:
    """A trainer with the weights of checkpoint `which` and only the given hooks, for `stream`
    (which the run's dataset must have)."""
    trainer = Trainer(
        cfg,
        run_dir,
        rundir.search_dirs(run_dir),
        hooks=hooks,
        inference=True,
        objects=Objects(objects.model, objects.dataset) if objects else None,
    )
    data.get_stream(trainer.dataset, stream, "Give one of them to --stream (stream= in Python)")
    step = trainer.stored_checkpoints.select(which, weights_only=True)
    trainer.restore(step, weights_only=True)
    return trainer, step


def evaluate(
    run_path: str | os.PathLike,
    stream: str,
    which: str | int,
    objects: Objects | None = None,
    save: bool = True,
) -> dict[str, Any]:
    """A checkpoint's metrics on a stream, computed by the run's metric hooks; saved as JSON too
    (`save`; else by `save_result`)."""
    run_dir, cfg = _open(run_path, "evaluate", objects)
    metric_hooks = [
        h
        for h in build_hooks(cfg, rundir.search_dirs(run_dir))
        if isinstance(h, (ComputeStats, ClassificationMetrics))
    ] or [ComputeStats()]
    trainer, step = _restore(run_dir, cfg, which, metric_hooks, stream, objects)
    trainer.epoch_data = {stream: {}}
    trainer.evaluate(stream)
    for hook in metric_hooks:
        hook.after_epoch(trainer.epoch, trainer.epoch_data)
    result: dict[str, Any] = {
        "stream": stream,
        "checkpoint": step,
        "metrics": trainer.epoch_data[stream],
    }
    if save:
        save_result(run_dir, result)
    return result


def save_result(run_dir: Path, result: dict[str, Any]) -> None:
    """An evaluation's metrics as `eval-<stream>-step-<step>.json` in the run directory."""
    path = run_dir / f"eval-{result['stream']}-step-{result['checkpoint']}.json"
    write_text_atomic(
        path,
        json.dumps(result, indent=1),
        where="eval saves its metrics in the run directory alone; they are printed above",
    )


def print_metrics(run_dir: Path, result: dict[str, Any]) -> None:
    """An evaluation's metrics as a table (`phalanx eval`), the run named on a line of its own: a
    title as wide as a run's name would wrap within it."""
    logs.out.print(f"run {run_dir}", soft_wrap=True)  # whole: the terminal wraps it, if any
    table = Table(title=f"{result['stream']} at step {result['checkpoint']}")
    table.add_column("variable")
    table.add_column("value", justify="right")
    for name, value in result["metrics"].items():
        table.add_row(name, f"{value:.6g}")
    logs.out.print(table)


class _Collect(Hook):
    """Every batch's per-sample values (the batch's and the model's), in dataset order."""

    # values per sample beyond which a tensor goes to an array file, not to CSV
    CSV_VALUES = 32

    def __init__(self) -> None:
        self.columns: dict[str, list[torch.Tensor]] = {}
        # keys that are not per-sample tensors, and what they are
        self.skipped: dict[str, str] = {}
        self.count = 0

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        n = len(batch["loss"])
        outputs = set(self.trainer.output_names)
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                self.skipped.setdefault(key, f"a {type(value).__name__}, not a tensor")
                continue
            if value.dim() == 0 or value.shape[0] != n:
                self.skipped.setdefault(key, f"shape {list(value.shape)}, not one row per sample")
                continue
            value = value.detach().cpu()
            self.columns.setdefault(key, []).append(
                value.double() if value.is_floating_point() else value
            )
            if (
                key in outputs
                and value.is_floating_point()
                and value.dim() == 2
                and value.shape[1] > 1
            ):
                scores = value.argmax(dim=1)  # class scores: the class
                self.columns.setdefault(f"{key}.class", []).append(scores)
        self.count += n

    def arrays(self) -> dict[str, torch.Tensor]:
        """Each value over every sample, the first dimension the sample, and `index` (dataset
        order). A value whose shape per sample changes between batches (a sequence padded to each
        batch's longest) has no one array and is left out, as are values that are not per-sample
        tensors: the log says which."""
        arrays = {}
        for key, parts in self.columns.items():
            shapes = sorted({tuple(part.shape[1:]) for part in parts})
            if len(shapes) > 1:
                self.skipped[key] = (
                    f"its shape per sample changes between batches ({list(shapes[0])}, "
                    f"{list(shapes[-1])}); return it padded to one length to have it"
                )
                continue
            arrays[key] = torch.cat(parts).contiguous()
        if self.skipped:
            log.warning(
                "left out of the predictions: %s",
                "; ".join(f"{key} ({why})" for key, why in self.skipped.items()),
            )
        return {"index": torch.arange(self.count), **arrays}

    def rows(self, arrays: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], list[str]]:
        """CSV rows: a column per one-value key, one per value of small tensors; keys left out."""
        flat, left = {}, []
        for key, array in arrays.items():
            values = array.reshape(len(array), -1)
            if values.shape[1] == 1:
                flat[key] = values[:, 0].tolist()
            elif values.shape[1] <= self.CSV_VALUES:
                flat.update({f"{key}.{j}": values[:, j].tolist() for j in range(values.shape[1])})
            else:
                left.append(f"{key} ({values.shape[1]} values each)")
        rows = [{name: column[i] for name, column in flat.items()} for i in range(self.count)]
        return rows, left


def predictions(
    run_path: str | os.PathLike, stream: str, which: str | int, objects: Objects | None = None
) -> tuple[dict[str, torch.Tensor], _Collect]:
    """Per-sample values of a checkpoint on a stream (the batch's and the model's outputs, and the
    class of outputs that are class scores), each a CPU tensor over the samples in dataset
    order."""
    collect = _Collect()
    run_dir, cfg = _open(run_path, "predict", objects)
    trainer, _ = _restore(run_dir, cfg, which, [collect], stream, objects)
    trainer.evaluate(stream)
    return collect.arrays(), collect


# what `write_predictions` writes, by the output's name: CSV rows, or the arrays whole
PREDICTION_FILES = (".csv", ".safetensors")


def write_predictions(
    arrays: dict[str, torch.Tensor], collect: _Collect, stream: str, output: str
) -> int:
    if output.endswith(".safetensors"):
        from safetensors.torch import save

        data = save(arrays, metadata={"stream": stream})
        write_atomic(Path(output), lambda f: f.write(data), sync=True)
        logs.out.print(f"wrote {collect.count} samples' {', '.join(arrays)} to {output}")
        return collect.count
    rows, left = collect.rows(arrays)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else [], restval="")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(Path(output), text.getvalue())
    logs.out.print(f"wrote {len(rows)} rows to {output}")
    if left:
        logs.out.print(
            f"left out of the CSV: {', '.join(left)}; write them whole with --output "
            "FILE.safetensors"
        )
    return len(rows)
