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
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx import (
    __version__,
    config,
    environment,
    evaluation,
    launch,
    logs,
    resuming,
    rundir,
    runlock,
    signals,
    strategies,
)
from phalanx import nodes as machines
from phalanx.checkpoint import CheckpointMismatch, Checkpoints, initial_weights
from phalanx.errors import CheckpointError, ConfigError, PhalanxError
from phalanx.files import write_text_atomic
from phalanx.model import build_model
from phalanx.nodes import Nodes
from phalanx.objects import Objects, check_given
from phalanx.trainer import Trainer

log = logging.getLogger("phalanx")


@dataclass
class Run:
    """A run that `fit` or `resume` ended."""

    run_dir: Path
    # the command's exit code: 0 finished (or stopped by a hook), 1 failed, 128 + N interrupted by
    # signal N
    code: int
    metrics: dict[str, float]  # the last evaluation's numbers, as {"valid.loss": ...}
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
    raw, path = _read(config_source, _listed(overrides))
    plan: dict | None = None
    if raw.get("parallel", {}).get("strategy") == "plan":
        raw, plan = _planned(raw, path, _listed(overrides), nodes, objects)
    if raw.get("parallel", {}).get("gradient_accumulation") == "auto":
        raw, plan = _accumulation(raw, path, _listed(overrides), nodes, objects)
    cfg = config.validate(objects.into(raw))
    if objects and (nodes is not None or strategies.needs_launch(cfg)):
        raise ConfigError(_in_this_process(cfg))
    _check_strategy(cfg, nodes)
    if nodes is not None:
        run_dir, code = _train_on_nodes(cfg, path, nodes)
        return _launched(run_dir, code)
    if strategies.needs_launch(cfg):
        run_dir = rundir.create(cfg, path)
        with _training_lock(run_dir, "train"):  # the launcher holds it for its workers
            try:
                logs.setup(run_dir)
                _record_plan(run_dir, plan)
                devices = strategies.resolve_device(cfg)[1]
                log.info("run directory: %s; starting %d workers", run_dir, devices)
                code = _launch_until_it_fits(
                    run_dir,
                    devices,
                    False,
                    [],
                    cfg.parallel.max_restarts,
                    strategies.rejoining(cfg, devices),
                )
            except BaseException as e:
                if not _worth_keeping(run_dir, e):
                    _discard(run_dir)
                raise
            finally:
                logs.close_run_log()
        return _launched(run_dir, code)
    strategy = strategies.create(cfg)
    run_dir = Path(
        strategy.broadcast(
            str(rundir.create(cfg, path, objects.names())) if strategy.is_main else None
        )
    )
    search_dirs = [path.resolve().parent, Path.cwd()] if path is not None else [Path.cwd()]
    with _training_lock(run_dir, "train"):
        try:
            trainer = _worker_trainer(cfg, run_dir, search_dirs, strategy, objects)
            log.info("run directory: %s", run_dir)
            _record_plan(run_dir, plan)
            for note in objects.notes:
                log.info("%s", note)
            _log_start(cfg, strategy, trainer)
            trainer.initialise_from()
            try:
                return _ended(run_dir, trainer, _run(trainer))
            except torch.OutOfMemoryError:
                if objects:  # a model object cannot be built again as it began
                    raise
                more = _doubled(run_dir, [], "the process")
                if more is None:
                    raise
            del trainer
            return _until_it_fits(run_dir, more)
        except BaseException as e:
            if strategy.is_main and not _worth_keeping(run_dir, e):
                _discard(run_dir)
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
    logs.setup(None)  # first: opening the run logs where its classes come from
    run_dir = rundir.open_run(Path(run_path), announce=False)
    objects = Objects.given(model, dataset, hooks)
    overrides = _listed(overrides)
    check_given(run_dir, objects, "resume")
    try:
        if nodes is not None and nodes.rank != 0:  # node 0 holds the lock and writes the logs
            return _as_run(run_dir, _resume(run_dir, overrides, objects, nodes))
        with _training_lock(
            run_dir, "resume"
        ):  # a run in use is one error line, before anything else
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
    run_dir = rundir.open_run(Path(run_path), announce=model is None)
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
    if (
        len(dtypes) == 1
    ):  # the dtype it trained in (fp64 stays fp64); copied in, so tied weights stay tied
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
    found = evaluation.evaluate(run_path, stream, checkpoint, Objects.given(model, dataset))
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
        evaluation.check_output(output, "predictions.csv")
    arrays, collect = evaluation.predictions(
        run_path, stream, checkpoint, Objects.given(model, dataset)
    )
    if output is not None:
        evaluation.write_predictions(arrays, collect, stream, output)
    return arrays


def _listed(overrides: str | Sequence[str]) -> list[str]:
    """Overrides as a list: one string is one override, not a sequence of one-letter ones."""
    return [overrides] if isinstance(overrides, str) else list(overrides)


def _read(
    source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str]
) -> tuple[dict, Path | None]:
    """The raw config and the file it came from (None for a dict)."""
    if isinstance(source, Mapping):
        raw = config.apply_overrides(dict(source), overrides)
        raw.setdefault("name", "run")
        return raw, None
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"the config is a {type(source).__name__}; give the path of a YAML file or a dict"
        )
    return config.read(source, overrides), Path(source)


def _planned(
    raw: dict, path: Path | None, overrides: list[str], nodes: Nodes | None, objects: Objects
) -> tuple[dict, dict]:
    """`parallel.strategy: plan`: the raw config with the plan's choice in `parallel`, and the
    plan."""
    from phalanx import planner

    if path is None or objects or nodes is not None:
        raise ConfigError(
            "parallel.strategy=plan plans from a config file, for one machine, with the classes "
            "the config names; give a YAML file without model or dataset objects, or for several "
            "machines run `phalanx plan CONFIG --nnodes N` and name its choice"
        )
    devices = raw.get("parallel", {}).get("devices", "auto")
    settings, report = planner.choose(
        str(path), overrides, devices if isinstance(devices, int) else None
    )
    parallel = {k: v for k, v in raw.get("parallel", {}).items() if k not in ("pipeline",)}
    return {**raw, "parallel": {**parallel, **settings}}, report


def _accumulation(
    raw: dict, path: Path | None, overrides: list[str], nodes: Nodes | None, objects: Objects
) -> tuple[dict, dict]:
    """`parallel.gradient_accumulation: auto`: the raw config with the count that fits, and what
    to log."""
    from phalanx import planner

    if path is None or objects or nodes is not None:
        raise ConfigError(
            "parallel.gradient_accumulation=auto is measured from a config file, on one machine, "
            "with the classes the config names; give a YAML file without model or dataset "
            "objects, or give a number"
        )
    count, said = planner.accumulation_for(str(path), overrides)
    parallel = {**raw.get("parallel", {}), "gradient_accumulation": count}
    return {**raw, "parallel": parallel}, {"choice": said}


def _record_plan(run_dir: Path, plan: dict | None) -> None:
    """The plan's choice in the run's log, and the plan beside it (where there is one)."""
    if plan is None:
        return
    log.info("%s", plan["choice"])
    if "predictions" in plan:
        write_text_atomic(run_dir / "plan.json", json.dumps(plan, indent=1))


def _in_this_process(cfg: config.Config) -> str:
    devices = strategies.resolve_device(cfg)[1]
    return (
        "a model, dataset or hooks given as objects train in this process, but the config asks "
        f"for {devices} processes ({strategies.strategy_name(cfg)} on parallel.devices={devices}); "
        f"start the script with `torchrun --nproc-per-node {devices} script.py` (each process "
        "calls phalanx.fit), use parallel.strategy=towers (one process driving several devices), "
        "or name the classes in the config instead of giving objects"
    )


def _launched(run_dir: Path, code: int) -> Run:
    """A run whose workers were other processes: its numbers from the run's trace."""
    events = [e for e in rundir.read_trace(run_dir) if e.get("event") == "epoch" and "metrics" in e]
    return Run(run_dir, code, events[-1]["metrics"] if events else {})


def _as_run(run_dir: Path, result: Run | int) -> Run:
    """What `_resume` gave: the run trained here, or the exit code of the workers it launched."""
    return result if isinstance(result, Run) else _launched(run_dir, result)


def _ended(run_dir: Path, trainer: Trainer, code: int) -> Run:
    """A run trained in this process, in `run_dir`."""
    metrics = trainer.metrics
    if (
        not metrics and trainer.strategy.is_main
    ):  # resumed after its last evaluation: the one recorded
        metrics = _launched(run_dir, code).metrics
    return Run(run_dir, code, metrics, trainer.model)


def _train_on_nodes(cfg: config.Config, path: Path | None, nodes: Nodes) -> tuple[Path, int]:
    strategies.check_nodes(cfg, nodes.count, nodes.elastic)
    devices = strategies.resolve_device(cfg)[1]
    logs.setup(None)
    store = machines.join(nodes)
    machines.agree(store, nodes, rundir.resolved(cfg))  # before node 0 makes the run directory
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
    with _training_lock(run_dir, "train"):
        try:
            logs.setup(run_dir)
            log.info(
                "run directory: %s; node 0 of %d, starting %d workers on each",
                run_dir,
                nodes.count,
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
        except BaseException as e:
            if not _worth_keeping(run_dir, e):
                _discard(run_dir)
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


def _discard(run_dir: Path) -> None:
    """Remove a run directory that this command created and in which nothing ran."""
    logs.setup(None)
    shutil.rmtree(run_dir, ignore_errors=True)


def _resume(
    run_dir: Path, overrides: list[str], objects: Objects, nodes: Nodes | None = None
) -> Run | int:
    cfg = config.validate(
        objects.into(config.apply_overrides(rundir.load_config_text(run_dir), overrides))
    )
    _check_strategy(cfg, nodes)
    if nodes is None and not strategies.needs_launch(cfg):
        try:
            return _ended(run_dir, *_work(run_dir, True, overrides, objects))
        except torch.OutOfMemoryError:
            more = None if objects else _doubled(run_dir, list(overrides), "the process")
            if more is None:
                raise
        return _until_it_fits(run_dir, more)
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
    return _launch_until_it_fits(
        run_dir,
        devices,
        True,
        list(overrides),
        cfg.parallel.max_restarts,
        strategies.rejoining(cfg, devices),
    )


def _check_strategy(cfg: config.Config, nodes: Nodes | None) -> None:
    """The strategy's own conditions on the job's processes, before any starts and anything is
    made or written (a resume's overrides included)."""
    if nodes is not None and nodes.elastic:
        return  # its processes are counted as machines join: each worker checks as it builds
    machines = 1 if nodes is None else nodes.count
    strategies.check(cfg, strategies.resolve_device(cfg)[1] * machines)


def _until_it_fits(run_dir: Path, count: int) -> Run:
    """The run of this process again, from its last checkpoint, with `count` micro-batches a step;
    twice as many again while it runs out of device memory."""
    import gc

    while True:
        gc.collect()  # the failed attempt's tensors
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            more = [f"parallel.gradient_accumulation={count}"]
            return _ended(run_dir, *_work(run_dir, False, more))
        except torch.OutOfMemoryError:
            doubled = _doubled(run_dir, [], "the process")
            if doubled is None:
                raise
            count = doubled


def _launch_until_it_fits(
    run_dir: Path,
    devices: int,
    resume: bool,
    overrides: list[str],
    restarts: int,
    rejoin: tuple[int, ...] = (),
) -> int:
    """Launch the run's workers; where one runs out of device memory, every worker has ended (the
    failing one ends the others at once: none is left waiting in a collective), so launch them
    again with twice the micro-batches a step, kept in the run's config, from the last checkpoint
    (the steps since are trained again, the same: the global batch and the gradients do not
    depend on the count); until the micro-batches are single samples."""
    while True:
        try:
            return launch.launch(
                run_dir, devices, run_worker, resume, overrides, restarts=restarts, rejoin=rejoin
            )
        except PhalanxError:
            more = _more_micro_batches(run_dir, overrides)
            if more is None:
                raise
            overrides = [*overrides, f"parallel.gradient_accumulation={more}"]


def _more_micro_batches(run_dir: Path, overrides: list[str]) -> int | None:
    """After a launch that failed: where a worker ran out of memory and a step can be cut in more
    micro-batches, twice as many, written into the run's config (and the run's log saying so)."""
    marker = run_dir / launch.OOM_FILE
    if not marker.is_file():
        return None
    rank = marker.read_text().strip()
    marker.unlink(missing_ok=True)
    return _doubled(run_dir, overrides, f"process {rank}")


def _doubled(run_dir: Path, overrides: list[str], who: str) -> int | None:
    """Twice the run's micro-batches a step, written into its config and said in its log; None
    where they are single samples already."""
    saved = rundir.load_config_text(run_dir)
    cfg = config.validate(config.apply_overrides(saved, overrides))
    count, batch = cfg.parallel.accumulation, cfg.dataset.batch_size
    if count >= batch:
        log.error(
            "%s ran out of device memory with micro-batches of one sample: lower the model's "
            "size or use fsdp",
            who,
        )
        return None
    more = min(2 * count, batch)
    saved.setdefault("parallel", {})["gradient_accumulation"] = more
    write_text_atomic(run_dir / rundir.CONFIG, config.dump(saved))
    log.warning(
        "%s ran out of device memory with %d micro-batch%s a step; %sthe run goes on from its "
        "last checkpoint with %d (parallel.gradient_accumulation=%d, kept in its config)",
        who,
        count,
        "" if count == 1 else "es",
        "every process has stopped, and " if who.startswith("process") else "",
        more,
        more,
    )
    return more


@contextlib.contextmanager
def _training_lock(run_dir: Path, command: str):
    """The run directory's lock, held while this process trains there (see runlock): by the launcher
    or the only process, or by rank 0 under torchrun; workers of phalanx's launcher do not take
    it."""
    place = environment.here()
    if place.in_group and place.rank != 0:
        yield
        return
    with runlock.hold(run_dir, command):
        launch.clear_requests(run_dir)  # stop requests left by a launcher that was killed
        yield


def run_worker(run_dir: Path, resume: bool, overrides: Sequence[str] = ()) -> int:
    """Train in an existing run directory in this process (one of several, or the only one)."""
    return _work(run_dir, resume, overrides)[1]


def _work(
    run_dir: Path, resume: bool, overrides: Sequence[str] = (), objects: Objects | None = None
) -> tuple[Trainer, int]:
    objects = objects or Objects()
    saved = rundir.load_config_text(run_dir)
    cfg = config.validate(objects.into(config.apply_overrides(saved, overrides)))
    strategy = strategies.create(cfg)
    trainer = _worker_trainer(cfg, run_dir, rundir.search_dirs(run_dir), strategy, objects)
    if strategy.rejoining:  # the others go on: join them there
        steps, epoch_open = strategy.joined_at()
        trainer.join(steps, epoch_open)
        log.warning(
            "worker rank %d joins the run in place of one that died, at step %d",
            strategy.rank,
            steps,
        )
        return trainer, _run(trainer)
    if (
        not resume
    ):  # workers of `train` that find the run started before: the launcher started them again
        started, steps = strategy.broadcast(
            (
                any(e.get("event") == "started" for e in rundir.read_trace(run_dir)),
                Checkpoints(run_dir / "checkpoints").steps(),
            )
            if strategy.is_main
            else None
        )
        if started:  # after a worker failed, or (in an elastic job) when the machines changed
            resume = bool(steps)
        if started and strategy.is_main:
            log.warning(
                "the workers started again in this run (a worker failed, or the machines "
                "changed): %s",
                "it resumes from the last checkpoint"
                if resume
                else "no checkpoint yet, so it starts over",
            )
    if resume:
        previous = rundir.resolved(config.validate(objects.into(saved))) if overrides else None
        _restore_latest(trainer, run_dir, previous)
        if overrides:  # every rank restored the same step: every rank refuses alike
            resuming.check_epochs_left(trainer.cfg.main_loop.epochs, trainer.epoch, overrides)
        if (
            overrides and strategy.is_main
        ):  # the run's config changes only once the resume is sure to go on
            write_text_atomic(run_dir / rundir.CONFIG, config.dump(rundir.resolved(cfg)))
            rundir.trace(run_dir, "overrides", values=list(overrides))
        log.info(
            "resuming %s from step %d (epoch %d, %d steps into it) on %d process(es)",
            run_dir,
            trainer.step,
            trainer.epoch + 1,
            trainer.step_in_epoch,
            strategy.world_size,
        )
        log.info("%s", what_runs(cfg, strategy))
        _warn_ignored(cfg, strategy)
        if trainer.epoch >= cfg.main_loop.epochs:
            log.info(
                "the run has finished its %d epochs; raise main_loop.epochs to train more",
                cfg.main_loop.epochs,
            )
    else:
        _log_start(cfg, strategy, trainer)
        trainer.initialise_from()
    return trainer, _run(trainer)


def _restore_latest(trainer: Trainer, run_dir: Path, previous: dict | None) -> int:
    """Restore the newest checkpoint that verifies, parses, has finite weights and fits the model,
    falling back step by step, each step passed over a warning; every rank takes the same step.
    Returns it. Where none does and one was of another model, one error names that mismatch."""
    strategy, checkpoints = trainer.strategy, trainer.stored_checkpoints
    if strategy.is_main:
        removed = checkpoints.clean_stale()
        if removed:
            log.info("removed what an interrupted checkpoint write left: %s", ", ".join(removed))
    # (step, why): said once a step is restored, or where none is and no mismatch says it all
    passed: list[tuple[int, str]] = []
    mismatch = None
    for step in reversed(strategy.broadcast(checkpoints.steps() if strategy.is_main else None)):
        try:
            trainer.restore(step, previous=previous)
            error = None
        except CheckpointError as e:  # a mismatch too: an older step may be of this model
            error = (str(e), isinstance(e, CheckpointMismatch))
        errors = [e for e in strategy.gather(error) if e]
        if not errors:
            _passed_over(passed, strategy.is_main)
            checkpoints.fell_back_past([step for step, _ in passed])
            return step
        passed.append((step, errors[0][0]))
        mismatch = mismatch or next((text for text, other in errors if other), None)
    if mismatch is not None:
        raise CheckpointMismatch(
            f"no checkpoint of {run_dir} fits the model its config builds ({mismatch}); resume "
            "without the overrides that change the model, or with the model settings the run was "
            "trained with"
        )
    _passed_over(passed, strategy.is_main)
    why = f" (the newest one: {passed[0][1]})" if passed else ""
    raise CheckpointError(
        f"{run_dir} has no valid checkpoint to resume from{why}; start again with phalanx train"
    )


def _passed_over(passed: list[tuple[int, str]], is_main: bool) -> None:
    for step, why in passed if is_main else []:
        log.warning("skipping checkpoint step-%d: %s; falling back to the previous one", step, why)


def _log_start(cfg: config.Config, strategy, trainer: Trainer) -> None:
    from phalanx import metrics

    log.info("%s", what_runs(cfg, strategy))
    _warn_ignored(cfg, strategy)
    # a strategy that keeps part of the model in each process describes the whole one
    log.info("%s", getattr(strategy, "model_summary", None) or metrics.summary(trainer.model))


def _warn_ignored(cfg: config.Config, strategy) -> None:
    """Settings of another strategy that this run ignores, said once (every process logs its
    warnings)."""
    if strategy.is_main:
        for said in strategies.ignored_settings(cfg):
            log.warning("%s", said)


def what_runs(cfg: config.Config, strategy) -> str:
    """The run's first line: the strategy, its processes and the devices each drives, the
    precision, and the batch as the step, each micro-batch and each device take it."""
    from phalanx.data import split_sizes

    processes, each = strategy.world_size, len(strategy.devices)
    kind = strategy.device.type
    drives = f"driving {each} {kind} device{'s' if each > 1 else ''}"
    if kind == "cpu":
        threads = torch.get_num_threads()
        drives += f" with {threads} thread{'s' if threads > 1 else ''}"
    who = f"{processes} processes, each {drives}" if processes > 1 else f"1 process {drives}"
    batch, accumulation = cfg.dataset.batch_size, cfg.parallel.accumulation
    micro = split_sizes(batch, min(accumulation, batch))[0]
    weights = cfg.parallel.shard_weights
    shards = strategy.data_world_size * each  # a pipeline's stages share their copy's shard
    shares = split_sizes(micro, shards, weights if weights and len(weights) == shards else None)
    share = f"{min(shares)}" if min(shares) == max(shares) else f"{min(shares)} to {max(shares)}"
    micros = (
        f"{accumulation} micro-batches of up to {micro}" if accumulation > 1 else "one micro-batch"
    )
    line = (
        f"strategy {strategies.strategy_name(cfg)}: {who}; precision {cfg.precision}; global batch "
        f"{batch} per optimizer step, {micros}, {share} per "
        + (
            getattr(strategy, "shard_name", None)
            or ("copy of the pipeline" if getattr(strategy, "layout", None) else "device")
        )
    )
    if getattr(strategy, "layout", None):
        line += f"; {strategy.layout}"
    line += (
        "; dropout and augmentation keyed by sample"
        if cfg.per_sample_random
        else "; dropout and augmentation drawn per process (per_sample_random: false)"
    )
    if kind == "cpu" and processes * each > 1 and cfg.parallel.accelerator == "auto":
        line += f" (no GPU is visible: the {processes * each} devices are shares of the CPU)"
    return line


def _worker_trainer(
    cfg: config.Config,
    run_dir: Path,
    search_dirs: list[Path],
    strategy,
    objects: Objects | None = None,
) -> Trainer:
    """A trainer for this process: logs on rank 0 only, the same config checked on every rank."""
    logs.setup(
        run_dir if strategy.is_main else None, logging.INFO if strategy.is_main else logging.WARNING
    )
    if strategy.device.type == "cpu":  # the rule `phalanx plan` measures with
        local = environment.here().local_world_size if strategy.world_size > 1 else 1
        threads = strategies.cpu_threads(cfg.parallel.cpu_threads, local, len(strategy.devices))
        if threads is not None:
            torch.set_num_threads(threads)
    if strategy.world_size > 1:
        from phalanx.strategies.distributed import check_same_config

        check_same_config(
            strategy, rundir.resolved(cfg), {"phalanx": __version__, "torch": torch.__version__}
        )
    trainer = Trainer(cfg, run_dir, search_dirs, strategy=strategy, objects=objects)
    trainer.stop.watch(run_dir / launch.STOP_FILE, run_dir / machines.REFORM_FILE)
    return trainer


def _run(trainer: Trainer) -> int:
    code = trainer.run()
    # Only after success: closing the process group on a failure would make the other ranks fail
    # on the closed connection before this rank has recorded the error that came first.
    trainer.strategy.shutdown()
    return code
