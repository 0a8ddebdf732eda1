"""phalanx from Python: `fit` trains a config, `resume` continues a run, `load` gives a run's
trained model back. `phalanx train` and `phalanx resume` are `fit` and `resume`.

    run = phalanx.fit("config.yaml", model=Net(), dataset={"train": train_set, "valid": valid_set})
    run.metrics["valid.loss"], run.model, run.run_dir
    model = phalanx.load(run.run_dir, checkpoint="best")

A config is a YAML file or a dict. A model, dataset or hooks given as objects take the place of
the classes the config names (see `phalanx.objects`); such objects train in this process: on one
device, with `towers` on several, or in each process of a `torchrun` job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx import config, evaluation, launch, logs, relaunch, rundir, signals, strategies
from phalanx import nodes as machines
from phalanx.checkpoint import Checkpoints, initial_weights
from phalanx.errors import CheckpointError, CheckpointMismatch, ConfigError, PhalanxError
from phalanx.files import check_output
from phalanx.model import build_model
from phalanx.nodes import Nodes
from phalanx.objects import Objects, check_given
from phalanx.spawned import STACKS
from phalanx.trainer import Trainer
from phalanx.worker import (
    build_worker_trainer,
    hold_training_lock,
    log_start,
    run_trainer,
    run_worker,
    train_in_run,
)

log = logging.getLogger("phalanx")


@dataclass
class Run:
    """A run that `fit` or `resume` ended."""

    run_dir: Path
    # the command's exit code: 0 finished (or stopped by a hook), 1 failed, 128 + N interrupted by
    # signal N
    code: int
    # the last evaluation's numbers, as {"valid.loss": ...}
    metrics: dict[str, float]
    _model: nn.Module | None = field(default=None, repr=False)

    @property
    def status(self) -> str:
        return "finished" if self.code == 0 else "interrupted" if self.code > 128 else "failed"

    @property
    def model(self) -> nn.Module:
        """The trained module, as this process holds it (on its device; its shards under fsdp)."""
        if self._model is None:
            raise PhalanxError(
                "the run trained in worker processes, so this process holds no model; read it "
                f"from a checkpoint: phalanx.load({str(self.run_dir)!r})"
            )
        return self._model


def fit(
    config_source: str | os.PathLike | Mapping[str, Any],
    *,
    overrides: str | Sequence[str] = (),
    model: nn.Module | None = None,
    dataset: Any = None,
    hooks: Sequence[Any] | None = None,
    nodes: Nodes | None = None,
) -> Run:
    """Train a new run: `config_source` is a YAML file or a dict, `overrides` its `KEY=VALUE`
    changes.

    `model`: a module, in place of `model.class`; `dataset`: an object with `streams()`, or
    `{"train": ..., "valid": ...}`, in place of `dataset.class`; `hooks`: Hook objects, called after
    the config's (or the default ones, where the config lists none). `nodes`: this machine's part of
    a job on several, as `--nnodes/--node-rank/--rdzv` give it.
    """
    objects = Objects.given(model, dataset, hooks)
    _check_nodes(nodes)
    raw, path = _read(config_source, _list_overrides(overrides))
    raw, plan = relaunch.settle_planned(raw, path, _list_overrides(overrides), nodes, objects)
    cfg = config.validate(objects.into(raw))
    if objects and (nodes is not None or strategies.needs_launch(cfg)):
        raise ConfigError(_in_this_process(cfg))
    _check_strategy(cfg, nodes)
    if nodes is not None:
        run_dir, code = _train_on_nodes(cfg, path, nodes)
        return _collect_launched(run_dir, code)
    if strategies.needs_launch(cfg):
        run_dir = rundir.create(cfg, path)
        # the launcher holds it for its workers
        announced = False
        with hold_training_lock(run_dir, "train"):
            try:
                logs.setup(run_dir)
                relaunch.record_plan(run_dir, plan)
                devices = strategies.resolve_device(cfg)[1]
                log.info("run directory: %s; starting %d workers", run_dir, devices)
                announced = True
                code = relaunch.launch_until_it_fits(
                    run_dir,
                    devices,
                    False,
                    [],
                    cfg.parallel.max_restarts,
                    strategies.rejoining(cfg, devices),
                )
            except BaseException as e:
                if not _worth_keeping(run_dir, e):
                    _discard(run_dir, announced)
                raise
            finally:
                logs.close_run_log()
        return _collect_launched(run_dir, code)
    strategy = strategies.create(cfg)
    run_dir = Path(
        strategy.broadcast(
            str(rundir.create(cfg, path, objects.names())) if strategy.is_main else None
        )
    )
    search_dirs = [path.resolve().parent, Path.cwd()] if path is not None else [Path.cwd()]
    announced = False
    with hold_training_lock(run_dir, "train"):
        try:
            trainer = build_worker_trainer(cfg, run_dir, search_dirs, strategy, objects)
            log.info("run directory: %s", run_dir)
            announced = True
            relaunch.record_plan(run_dir, plan)
            for note in objects.notes:
                log.info("%s", note)
            log_start(cfg, strategy, trainer)
            trainer.initialise_from()
            try:
                return _collect_trained(run_dir, trainer, run_trainer(trainer))
            except torch.OutOfMemoryError:
                # a model object cannot be built again as it began
                if objects:
                    raise
                more = relaunch.double_micro_batches(run_dir, [], "the process")
                if more is None:
                    raise
            del trainer
            return _collect_trained(run_dir, *relaunch.train_until_it_fits(run_dir, more))
        except BaseException as e:
            strategy.abandon()
            if strategy.is_main and not _worth_keeping(run_dir, e):
                _discard(run_dir, announced)
            raise
        finally:
            logs.close_run_log()


def resume(
    run_path: str | os.PathLike,
    *,
    overrides: str | Sequence[str] = (),
    model: nn.Module | None = None,
    dataset: Any = None,
    hooks: Sequence[Any] | None = None,
    nodes: Nodes | None = None,
) -> Run:
    """Continue a run from its latest valid checkpoint, in the same run directory, on any device
    count; `overrides` change its config from here on. A run trained with objects is given them
    again."""
    # first: opening the run logs where its classes come from
    logs.setup(None)
    _check_nodes(nodes)
    run_dir = rundir.open_run(_run_path(run_path), announce=False)
    objects = Objects.given(model, dataset, hooks)
    overrides = _list_overrides(overrides)
    check_given(run_dir, objects, "resume")
    try:
        # node 0 holds the lock and writes the logs
        if nodes is not None and nodes.rank != 0:
            return _as_run(run_dir, _resume(run_dir, overrides, objects, nodes))
        # a run in use is one error line, before anything else
        with hold_training_lock(run_dir, "resume"):
            rundir.announce_imports(run_dir)
            result = _resume(run_dir, overrides, objects, nodes)
        return _as_run(run_dir, result)
    finally:
        logs.close_run_log()


def load(
    run_path: str | os.PathLike, checkpoint: str | int = "auto", *, model: nn.Module | None = None
) -> nn.Module:
    """A run's model with the weights of its `checkpoint` (best, latest, a step, or auto: the best
    where there is one, else the latest), on the CPU, in eval mode, in the dtype it was trained in;
    saved whole or in shards, on any process count. The module is built as the run's config says, or
    is `model`, given."""
    logs.setup(None)
    # a model given imports nothing
    run_dir = rundir.open_run(_run_path(run_path), announce=model is None)
    if model is None:
        check_given(run_dir, Objects(), "load", parts=("model",))
        cfg = config.validate(rundir.load_config_text(run_dir))
        model = build_model(cfg.model, rundir.search_dirs(run_dir))
    elif not isinstance(model, nn.Module):
        raise PhalanxError(f"model= is a {type(model).__name__}, not a torch.nn.Module")
    if not Checkpoints(run_dir / "checkpoints").steps():
        raise CheckpointError(
            f"{run_dir} has no checkpoint yet: it saves them with SaveLatest, SaveBest or "
            "SaveEvery (the default hooks include SaveLatest)"
        )
    path, state = initial_weights(str(run_dir), checkpoint)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    # the dtype it trained in (fp64 stays fp64); copied in, so tied weights stay tied
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = " ".join(str(e).split())
        raise CheckpointMismatch(f"{path} does not fit this model ({lines[:400]})") from None
    return model.cpu().eval()


def evaluate(
    run_path: str | os.PathLike,
    stream: str = "test",
    checkpoint: str | int = "auto",
    *,
    model: nn.Module | None = None,
    dataset: Any = None,
) -> dict[str, float]:
    """A checkpoint's metrics on a stream (`phalanx eval`, which also prints them): the run's
    ComputeStats and ClassificationMetrics hooks, on one process; also saved as
    `eval-<stream>-step-<N>.json`."""
    found = evaluation.evaluate(
        _run_path(run_path), stream, checkpoint, Objects.given(model, dataset)
    )
    return found["metrics"]


def predict(
    run_path: str | os.PathLike,
    stream: str = "test",
    checkpoint: str | int = "auto",
    *,
    output: str | None = None,
    model: nn.Module | None = None,
    dataset: Any = None,
) -> dict[str, torch.Tensor]:
    """A checkpoint's per-sample values on a stream (`phalanx predict`): every batch key and model
    output, and `<output>.class` for class scores, each a CPU tensor whose first dimension is the
    sample, in dataset order (`index`). With `output`, also written (CSV, or .safetensors)."""
    if output is not None:
        check_output(output, "predictions.csv", evaluation.PREDICTION_FILES, _run_path(run_path))
    arrays, collect = evaluation.predictions(
        _run_path(run_path), stream, checkpoint, Objects.given(model, dataset)
    )
    if output is not None:
        evaluation.write_predictions(arrays, collect, stream, output)
    return arrays


def _list_overrides(overrides: str | Sequence[str]) -> list[str]:
    """Overrides as a list: one string is one override, not a sequence of one-letter ones."""
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Sequence) and not isinstance(overrides, bytes | bytearray):
        return list(overrides)
    raise ConfigError(
        f"overrides= is a {type(overrides).__name__}; give a KEY=VALUE string or a list of them, "
        "such as ['optimizer.lr=1e-3', 'main_loop.epochs=5']"
    )


def _run_path(run_path: Any) -> Path:
    """A run directory's path as given to resume, load, evaluate and predict."""
    if not isinstance(run_path, str | os.PathLike):
        raise ConfigError(
            f"the run directory is a {type(run_path).__name__}; give its path, such as "
            "run.run_dir or 'runs/digits-20261122-030200'"
        )
    return Path(run_path)


def _check_nodes(nodes: Any) -> None:
    if nodes is not None and not isinstance(nodes, Nodes):
        raise ConfigError(
            f"nodes= is a {type(nodes).__name__}; give a phalanx.nodes.Nodes(count, rank, host, "
            "port), as --nnodes, --node-rank and --rdzv describe this machine's part, or None"
        )


def _read(
    source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str]
) -> tuple[dict, Path | None]:
    """The raw config and the file it came from (None for a dict)."""
    if isinstance(source, Mapping):
        raw = config.apply_overrides(_plain(dict(source)), overrides)
        raw.setdefault("name", "run")
        return raw, None
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"the config is a {type(source).__name__}; give the path of a YAML file or a dict"
        )
    return config.read(source, overrides), Path(source)


def _plain(value: Any) -> Any:
    """A config dict's NumPy scalars and one-value tensors as the Python numbers they hold (what a
    YAML file would give): a run's config is written back as YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return value.item()
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):
        return item()
    return value


def _in_this_process(cfg: config.Config) -> str:
    devices = strategies.resolve_device(cfg)[1]
    return (
        "a model, dataset or hooks given as objects train in this process, but the config asks "
        f"for {devices} processes ({strategies.strategy_name(cfg)} on parallel.devices={devices}); "
        f"start the script with `torchrun --nproc-per-node {devices} script.py` (each process "
        "calls phalanx.fit), use parallel.strategy=towers (one process driving several devices), "
        "or name the classes in the config instead of giving objects"
    )


def _collect_launched(run_dir: Path, code: int) -> Run:
    """A run whose workers were other processes: its numbers from the run's trace."""
    events = [e for e in rundir.read_trace(run_dir) if e.get("event") == "epoch" and "metrics" in e]
    return Run(run_dir, code, events[-1]["metrics"] if events else {})


def _as_run(run_dir: Path, result: Run | int) -> Run:
    """What `_resume` gave: the run trained here, or the exit code of the workers it launched."""
    return result if isinstance(result, Run) else _collect_launched(run_dir, result)


def _collect_trained(run_dir: Path, trainer: Trainer, code: int) -> Run:
    """A run trained in this process, in `run_dir`."""
    metrics = trainer.metrics
    # resumed after its last evaluation: the one recorded
    if not metrics and trainer.strategy.is_main:
        metrics = _collect_launched(run_dir, code).metrics
    return Run(run_dir, code, metrics, trainer.model)


def _train_on_nodes(cfg: config.Config, path: Path | None, nodes: Nodes) -> tuple[Path, int]:
    strategies.check_nodes(cfg, nodes.count, nodes.elastic)
    devices = strategies.resolve_device(cfg)[1]
    logs.setup(None)
    store = machines.join(nodes)
    # before node 0 makes the run directory
    machines.agree(store, nodes, rundir.resolved(cfg))
    if nodes.rank != 0:
        run_dir = machines.share_run_dir(store, None)
        log.info(
            "node %d of %d: run directory %s; starting %d workers",
            nodes.rank,
            nodes.count,
            run_dir,
            devices,
        )
        return run_dir, launch.launch(
            run_dir,
            devices,
            run_worker,
            False,
            [],
            nodes=nodes,
            store=store,
            restarts=cfg.parallel.max_restarts,
        )
    run_dir = machines.share_run_dir(store, rundir.create(cfg, path))
    announced = False
    with hold_training_lock(run_dir, "train"):
        try:
            logs.setup(run_dir)
            log.info(
                "run directory: %s; node 0 of %d, starting %d workers on each",
                run_dir,
                nodes.count,
                devices,
            )
            announced = True
            return run_dir, launch.launch(
                run_dir,
                devices,
                run_worker,
                False,
                [],
                nodes=nodes,
                store=store,
                restarts=cfg.parallel.max_restarts,
            )
        except BaseException as e:
            if not _worth_keeping(run_dir, e):
                _discard(run_dir, announced)
            raise


def _worth_keeping(run_dir: Path, error: BaseException) -> bool:
    """Whether a run directory that `train` created is kept after `error`: not where training never
    started (bad input, a signal during start-up), nor, before any checkpoint, for bad input found
    at the first batches or a signal while the hooks started; a failing worker's is kept, with its
    log."""
    if isinstance(error, launch.RankFailure):
        return True
    trace = rundir.read_trace(run_dir)
    if not any(e.get("event") == "started" for e in trace):
        return False
    before_first_step = isinstance(error, signals.Interrupted) and trace[-1].get(
        "before_first_step"
    )
    if isinstance(error, PhalanxError) or before_first_step:
        return bool(Checkpoints(run_dir / "checkpoints").steps())
    return True


def _discard(run_dir: Path, announced: bool = False) -> None:
    """Remove a run directory that this command created and that holds nothing to keep (no
    checkpoint); `announced`: the log named it, and now says it is gone."""
    logs.setup(None)
    shutil.rmtree(run_dir, ignore_errors=True)
    if announced and not run_dir.exists():
        log.info("removed the run directory %s: it holds no checkpoint", run_dir)


def _resume(
    run_dir: Path, overrides: list[str], objects: Objects, nodes: Nodes | None = None
) -> Run | int:
    cfg = config.validate(
        objects.into(config.apply_overrides(rundir.load_config_text(run_dir), overrides))
    )
    _check_strategy(cfg, nodes)
    if nodes is None and not strategies.needs_launch(cfg):
        try:
            return _collect_trained(run_dir, *train_in_run(run_dir, True, overrides, objects))
        except torch.OutOfMemoryError:
            # a model object cannot be built again as it began
            if objects:
                raise
            more = relaunch.double_micro_batches(run_dir, list(overrides), "the process")
            if more is None:
                raise
        return _collect_trained(run_dir, *relaunch.train_until_it_fits(run_dir, more))
    if objects:
        raise ConfigError(_in_this_process(cfg))
    store = None
    if nodes is not None:
        strategies.check_nodes(cfg, nodes.count, nodes.elastic)
        store = machines.join(nodes)
        machines.agree(store, nodes, rundir.resolved(cfg))
    if nodes is None or nodes.rank == 0:
        logs.setup(run_dir)
    if nodes is not None:
        return launch.launch(
            run_dir,
            strategies.resolve_device(cfg)[1],
            run_worker,
            True,
            list(overrides),
            nodes=nodes,
            store=store,
            restarts=cfg.parallel.max_restarts,
        )
    devices = strategies.resolve_device(cfg)[1]
    with _as_it_was_if_refused(run_dir):
        return relaunch.launch_until_it_fits(
            run_dir,
            devices,
            True,
            list(overrides),
            cfg.parallel.max_restarts,
            strategies.rejoining(cfg, devices),
        )


@contextlib.contextmanager
def _as_it_was_if_refused(run_dir: Path) -> Iterator[None]:
    """A resume whose workers refuse it before training (bad input: a model its checkpoints do
    not fit, say) leaves the run directory as it was, as one process's refusal does: the lines the
    launch added to log.txt and trace.jsonl are taken back (no `failed` event marks a healthy run),
    and so are the stacks its workers wrote when they ended."""
    appended = [run_dir / "log.txt", run_dir / rundir.TRACE]
    sizes = {path: path.stat().st_size if path.is_file() else None for path in appended}
    stacks = run_dir / STACKS
    kept = {p: p.read_bytes() for p in stacks.iterdir() if p.is_file()} if stacks.is_dir() else None
    starts = _starts(run_dir)
    try:
        yield
    except PhalanxError as e:
        if isinstance(e, launch.RankFailure) or _starts(run_dir) > starts:
            raise
        with contextlib.suppress(OSError):
            for path, size in sizes.items():
                if size is None:
                    path.unlink(missing_ok=True)
                elif path.stat().st_size > size:
                    os.truncate(path, size)
            if kept is None:
                shutil.rmtree(stacks, ignore_errors=True)
            elif stacks.is_dir():
                for path in stacks.iterdir():
                    if path not in kept:
                        path.unlink()
                for path, content in kept.items():
                    path.write_bytes(content)
        raise


def _starts(run_dir: Path) -> int:
    """How often the run's trace says training started."""
    return sum(event["event"] == "started" for event in rundir.read_trace(run_dir))


def _check_strategy(cfg: config.Config, nodes: Nodes | None) -> None:
    """The strategy's own conditions on the job's processes, before any starts and anything is
    made or written (a resume's overrides included)."""
    # its processes are counted as machines join: each worker checks as it builds
    if nodes is not None and nodes.elastic:
        return
    machines = 1 if nodes is None else nodes.count
    strategies.check(cfg, strategies.resolve_device(cfg)[1] * machines)
