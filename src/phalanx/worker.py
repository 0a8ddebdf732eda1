"""The worker's main: what a training process runs inside an existing run directory, whether
phalanx's launcher started it, `torchrun` did, or it is the only process. It builds this rank's
trainer, restores the newest checkpoint that holds up when the run resumes, logs first what runs,
and trains. The training lock that keeps a second command out of a run directory is here too: the
process that trains takes it (see `hold_training_lock`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from phalanx import (
    __version__,
    config,
    environment,
    launch,
    logs,
    parts,
    resuming,
    rundir,
    runlock,
    spawned,
    strategies,
)
from phalanx.checkpoint import Checkpoints
from phalanx.errors import CheckpointError, CheckpointMismatch
from phalanx.objects import Objects
from phalanx.runstate import RunState
from phalanx.strategies.base import Strategy
from phalanx.trainer import Trainer

log = logging.getLogger("phalanx")


@contextlib.contextmanager
def hold_training_lock(run_dir: Path, command: str) -> Iterator[None]:
    """The run directory's lock, held while this process trains there (see runlock): by the launcher
    or the only process, or by rank 0 under torchrun; workers of phalanx's launcher do not take
    it."""
    place = environment.here()
    if place.in_group and place.rank != 0:
        yield
        return
    with runlock.hold(run_dir, command):
        # stop requests left by a launcher that was killed
        launch.clear_requests(run_dir)
        yield


def run_worker(run_dir: Path, resume: bool, overrides: Sequence[str] = ()) -> int:
    """Train in an existing run directory in this process (one of several, or the only one); or,
    where the strategy gives this process that role, serve the processes that train."""
    objects = Objects()
    saved, cfg, strategy = _read_run(run_dir, overrides, objects)
    # a process that serves builds no trainer: the model's parts and the run state alone
    if strategy.serving:
        return serve_in_run(cfg, run_dir, strategy, resume, saved, overrides, objects)
    return _train(run_dir, resume, overrides, objects, saved, cfg, strategy)[1]


def train_in_run(
    run_dir: Path, resume: bool, overrides: Sequence[str] = (), objects: Objects | None = None
) -> tuple[Trainer, int]:
    """Train the run in `run_dir` in this process, from its saved config and `overrides`: from the
    start, or (`resume`) from its newest valid checkpoint; the trainer and the exit code."""
    objects = objects or Objects()
    saved, cfg, strategy = _read_run(run_dir, overrides, objects)
    try:
        return _train(run_dir, resume, overrides, objects, saved, cfg, strategy)
    except BaseException:
        strategy.abandon()
        raise


def _read_run(
    run_dir: Path, overrides: Sequence[str], objects: Objects
) -> tuple[dict, config.Config, Strategy]:
    """The run's saved config, the config with `overrides`, and this process's strategy."""
    saved = rundir.load_config_text(run_dir)
    cfg = config.validate(objects.into(config.apply_overrides(saved, overrides)))
    return saved, cfg, strategies.create(cfg)


def _train(
    run_dir: Path,
    resume: bool,
    overrides: Sequence[str],
    objects: Objects,
    saved: dict,
    cfg: config.Config,
    strategy: Strategy,
) -> tuple[Trainer, int]:
    trainer = build_worker_trainer(cfg, run_dir, rundir.search_dirs(run_dir), strategy, objects)
    # the others go on: join them there
    if strategy.rejoining:
        steps, epoch_open = strategy.joined_at()
        trainer.join(steps, epoch_open)
        log.warning(
            "worker rank %d joins the run in place of one that died, at step %d",
            strategy.rank,
            steps,
        )
        return trainer, run_trainer(trainer)
    # workers of `train` that find the run started before: the launcher started them again
    if not resume:
        resume = _resumes_after_restart(run_dir, strategy)
    if resume:
        previous = rundir.resolved(config.validate(objects.into(saved))) if overrides else None
        _resume_from_latest(trainer.state, run_dir, cfg, previous, overrides)
    else:
        log_start(cfg, strategy, trainer)
        trainer.initialise_from()
    return trainer, run_trainer(trainer)


def serve_in_run(
    cfg: config.Config,
    run_dir: Path,
    strategy: Strategy,
    resume: bool,
    saved: dict,
    overrides: Sequence[str],
    objects: Objects,
) -> int:
    """Serve the processes that train (a parameter server's servers): the model's parts built as
    theirs are, restored from the checkpoint they restore, then stepped for them until each has
    ended its run."""
    prepare_process(cfg, run_dir, strategy)
    state = build_server(cfg, strategy, rundir.search_dirs(run_dir), run_dir, objects)
    # the same decisions as the workers', in the same collectives
    if not resume:
        resume = _resumes_after_restart(run_dir, strategy)
    if resume:
        previous = rundir.resolved(config.validate(objects.into(saved))) if overrides else None
        _resume_from_latest(state, run_dir, cfg, previous, overrides)
    else:
        state.initialise_from()
    strategy.serve(state.engine, state.steps_per_epoch)
    strategy.shutdown()
    return 0


def build_server(
    cfg: config.Config,
    strategy: Strategy,
    search_dirs: list[Path],
    run_dir: Path | None = None,
    objects: Objects | None = None,
) -> RunState:
    """What a process that serves the others holds: the model's parts as theirs are built, and the
    run's state, which a resume restores; `strategy.serve(state.engine, state.steps_per_epoch)`
    serves them."""
    objects = objects or Objects()
    feed = parts.build_feed(cfg, search_dirs, strategy, objects, persistent=False)
    model = parts.build_parts(cfg, search_dirs, strategy, feed, objects.model, run_dir=run_dir)
    state = RunState(cfg, run_dir, search_dirs, strategy, model, feed, {})
    strategy.watch(lambda: (state.step, False))
    return state


def _resumes_after_restart(run_dir: Path, strategy) -> bool:
    """Whether workers of `train` resume: where the run started before (after a worker failed, or,
    in an elastic job, when the machines changed) and has a checkpoint; said on rank 0."""
    started, steps = strategy.broadcast(
        (
            any(e.get("event") == "started" for e in rundir.read_trace(run_dir)),
            Checkpoints(run_dir / "checkpoints").steps(),
        )
        if strategy.is_main
        else None
    )
    resume = bool(steps) if started else False
    if started and strategy.is_main:
        log.warning(
            "the workers started again in this run (a worker failed, or the machines changed): %s",
            "it resumes from the last checkpoint"
            if resume
            else "no checkpoint yet, so it starts over",
        )
    return resume


def _resume_from_latest(
    state: RunState,
    run_dir: Path,
    cfg: config.Config,
    previous: dict | None,
    overrides: Sequence[str],
) -> None:
    """Restore the newest valid checkpoint, keep the run's config changed by `overrides`, and say
    where the run goes on from."""
    strategy = state.strategy
    _restore_latest(state, run_dir, previous)
    # every rank restored the same step: every rank refuses alike
    if overrides:
        resuming.check_epochs_left(cfg.main_loop.epochs, state.epoch, overrides)
    # the run's config changes only once the resume is sure to go on
    if overrides:
        state.keep_config_later(cfg, list(overrides))
    log.info(
        "resuming %s from step %d (epoch %d, %d steps into it) on %d process(es)",
        run_dir,
        state.step,
        state.epoch + 1,
        state.step_in_epoch,
        strategy.world_size,
    )
    log.info("%s", what_runs(cfg, strategy))
    _warn_ignored(cfg, strategy)
    _warn_capped(cfg, strategy)
    if state.epoch >= cfg.main_loop.epochs:
        log.info(
            "the run has finished its %d epochs; raise main_loop.epochs to train more",
            cfg.main_loop.epochs,
        )


def _restore_latest(state: RunState, run_dir: Path, previous: dict | None) -> int:
    """Restore the newest checkpoint that verifies, parses, has finite weights and fits the model,
    falling back step by step, each step passed over a warning; every rank takes the same step.
    Returns it. Where none does and one was of another model, one error names that mismatch, and
    the fix: the resume's overrides (`previous`: the config before them), or else the run's
    config.yaml edited since."""
    strategy, checkpoints = state.strategy, state.stored_checkpoints
    if strategy.is_main:
        removed = checkpoints.clean_stale()
        if removed:
            log.info("removed what an interrupted checkpoint write left: %s", ", ".join(removed))
    # (step, why): warned of once a step is restored; where none is, the error says them
    passed: list[tuple[int, str]] = []
    mismatch = None
    for step in reversed(strategy.broadcast(checkpoints.steps() if strategy.is_main else None)):
        try:
            state.restore(step, previous=previous)
            error = None
        # a mismatch too: an older step may be of this model
        except CheckpointError as e:
            error = (str(e), isinstance(e, CheckpointMismatch))
        errors = [e for e in strategy.gather(error) if e]
        if not errors:
            _warn_passed_over(passed, strategy.is_main)
            checkpoints.fell_back_past([step for step, _ in passed])
            return step
        passed.append((step, errors[0][0]))
        mismatch = mismatch or next((text for text, other in errors if other), None)
    if mismatch is not None:
        fix = (
            "resume without the overrides that change the model, or with the model settings the "
            "run was trained with"
            if previous is not None
            else f"put back in {run_dir / 'config.yaml'} the model settings the run was trained "
            "with (it was edited since)"
        )
        raise CheckpointMismatch(
            f"no checkpoint of {run_dir} fits the model its config builds ({mismatch}); {fix}"
        )
    # said in the error alone: a resume that fails on its checkpoints leaves the run's log as it was
    why = f" (the newest one: {passed[0][1]}" if passed else ""
    if len(passed) > 1:
        older = ", ".join(f"step-{step}" for step, _ in passed[1:])
        why += f"; the older {older} could not be restored either"
    why += ")" if passed else ""
    raise CheckpointError(
        f"{run_dir} has no valid checkpoint to resume from{why}; start again with phalanx train"
    )


def _warn_passed_over(passed: list[tuple[int, str]], is_main: bool) -> None:
    for step, why in passed if is_main else []:
        log.warning("skipping checkpoint step-%d: %s; falling back to the previous one", step, why)


def log_start(cfg: config.Config, strategy: Strategy, trainer: Trainer) -> None:
    """The run's first lines: what runs, the settings it ignores, and the model's summary."""
    from phalanx import metrics

    log.info("%s", what_runs(cfg, strategy))
    _warn_ignored(cfg, strategy)
    _warn_capped(cfg, strategy)
    _warn_whole_stream(cfg, strategy, trainer.feed.samples_per_epoch)
    # a strategy that keeps part of the model in each process describes the whole one
    log.info("%s", strategy.model_summary() or metrics.summary(trainer.model))


def _warn_ignored(cfg: config.Config, strategy) -> None:
    """Settings of another strategy that this run ignores, said once (every process logs its
    warnings)."""
    if strategy.is_main:
        for said in strategies.ignored_settings(cfg):
            log.warning("%s", said)


def _warn_capped(cfg: config.Config, strategy) -> None:
    """Gradient accumulation over more micro-batches than the batch has samples: the step splits
    its batch into one micro-batch a sample, said once."""
    batch, accumulation = cfg.dataset.batch_size, cfg.parallel.accumulation
    if strategy.is_main and accumulation > batch:
        log.warning(
            "parallel.gradient_accumulation is %d but dataset.batch_size is %d: a step splits its "
            "batch into %d micro-batches of one sample; set gradient_accumulation to %d or less "
            "(dataset.batch_size is the global batch of a step, not a micro-batch's)",
            accumulation,
            batch,
            batch,
            batch,
        )


def _warn_whole_stream(cfg: config.Config, strategy, samples: int | None) -> None:
    """A batch larger than the training stream: each step takes the whole stream, and what reads
    the batch size (lr_scaling) reads the configured one; said once."""
    batch = cfg.dataset.batch_size
    if strategy.is_main and samples is not None and batch > samples:
        scaling = cfg.optimizer.lr_scaling
        scaled = scaling is not None and scaling.rule != "none"
        log.warning(
            "dataset.batch_size is %d but the training stream has %d samples: each step takes all "
            "%d%s; set batch_size to %d or less",
            batch,
            samples,
            samples,
            f", while optimizer.lr_scaling scales the learning rate by {batch}" if scaled else "",
            samples,
        )


def what_runs(cfg: config.Config, strategy: Strategy) -> str:
    """The run's first line: the strategy, its processes and the devices each drives, the
    precision, and the batch as the step, each micro-batch and each device take it."""
    from phalanx.data import split_sizes

    processes, each = strategy.world_size, len(strategy.devices)
    kind = strategy.device.type
    goes_to, layout = strategy.describe()
    drives = f"driving {each} {kind} device{'s' if each > 1 else ''}"
    if kind == "cpu":
        threads = torch.get_num_threads()
        drives += f" with {threads} thread{'s' if threads > 1 else ''}"
    who = f"{processes} processes, each {drives}" if processes > 1 else f"1 process {drives}"
    # a step splits its batch into at most one micro-batch a sample (`data.Plan`)
    batch = cfg.dataset.batch_size
    accumulation = min(cfg.parallel.accumulation, batch)
    micro = split_sizes(batch, accumulation)[0]
    weights = cfg.parallel.shard_weights
    # a pipeline's stages share their copy's shard
    shards = strategy.data_world_size * each
    shares = split_sizes(micro, shards, weights if weights and len(weights) == shards else None)
    share = f"{min(shares)}" if min(shares) == max(shares) else f"{min(shares)} to {max(shares)}"
    micros = (
        f"{accumulation} micro-batches of up to {micro}" if accumulation > 1 else "one micro-batch"
    )
    line = (
        f"strategy {strategies.strategy_name(cfg)}: {who}; precision {cfg.precision}; global batch "
        f"{batch} per optimizer step, {micros}, {share} per {goes_to}"
    )
    if layout:
        line += f"; {layout}"
    line += (
        "; dropout and augmentation keyed by sample"
        if cfg.per_sample_random
        else "; dropout and augmentation drawn per process (per_sample_random: false)"
    )
    if kind == "cpu" and processes * each > 1 and cfg.parallel.accelerator == "auto":
        line += f" (no GPU is visible: the {processes * each} devices are shares of the CPU)"
    return line


def build_worker_trainer(
    cfg: config.Config,
    run_dir: Path,
    search_dirs: list[Path],
    strategy,
    objects: Objects | None = None,
) -> Trainer:
    """A trainer for this process: logs on rank 0 only, the same config checked on every rank."""
    prepare_process(cfg, run_dir, strategy)
    trainer = Trainer(cfg, run_dir, search_dirs, strategy=strategy, objects=objects)
    trainer.stop.watch(run_dir / launch.STOP_FILE, run_dir / spawned.REFORM_FILE)
    return trainer


def prepare_process(cfg: config.Config, run_dir: Path, strategy: Strategy) -> None:
    """This process's logs (rank 0's in the run directory), threads, and the same config checked
    on every rank."""
    logs.setup(
        run_dir if strategy.is_main else None, logging.INFO if strategy.is_main else logging.WARNING
    )
    # the rule `phalanx plan` measures with
    if strategy.device.type == "cpu":
        local = environment.here().local_world_size if strategy.world_size > 1 else 1
        threads = strategies.cpu_threads(cfg.parallel.cpu_threads, local, len(strategy.devices))
        if threads is not None:
            torch.set_num_threads(threads)
        # a number given: auto shares the cores, one thread a process at least
        if isinstance(cfg.parallel.cpu_threads, int) and strategy.is_main:
            crowded = strategies.too_many_threads(threads or 1, local)
            if crowded:
                log.warning("%s", crowded)
    if strategy.world_size > 1:
        from phalanx.strategies.distributed import check_same_config

        check_same_config(
            strategy, rundir.resolved(cfg), {"phalanx": __version__, "torch": torch.__version__}
        )


def run_trainer(trainer: Trainer) -> int:
    """Train to the end; the exit code."""
    code = trainer.run()
    # Only after success: closing the process group on a failure would make the other ranks fail
    # on the closed connection before this rank has recorded the error that came first.
    trainer.strategy.shutdown()
    return code
