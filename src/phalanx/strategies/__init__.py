"""The choice among the strategies from the `parallel` section: the devices, the strategy the
config names (each strategy's module declares itself in `registry`), and building it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from phalanx import environment
from phalanx.environment import cpu_cores
from phalanx.errors import ConfigError, count, did_you_mean
from phalanx.strategies.registry import auto, families, get

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.strategies.base import Strategy

# CPU processes a launch may start per core: more only slow each other down (and a typo such as
# parallel.devices=1000 would start processes until the machine gives out).
# parallel.oversubscribe=true lifts the limit.
CPU_PROCESSES_PER_CORE = 4


def _host_processes(cfg: Config) -> int:
    """The processes of a run that hold no GPU (a parameter server's servers)."""
    if cfg.parallel.strategy not in families():
        return 0
    return get(cfg.parallel.strategy).host_processes(cfg)


def rejoining(cfg: Config, devices: int) -> tuple[int, ...]:
    """The ranks whose worker, where it dies, is started again alone while the others go on (a
    parameter server's workers other than the main one), on one machine, where restarts are
    allowed."""
    if not cfg.parallel.max_restarts or cfg.parallel.strategy not in families():
        return ()
    return get(cfg.parallel.strategy).rejoining(cfg, devices)


def cpu_threads(setting: int | str, processes: int, devices: int = 1) -> int | None:
    """torch's threads in a CPU process that drives `devices` devices, one of `processes` on its
    machine: `setting` (`parallel.cpu_threads`) a device where it is a number; `auto`: a process
    alone keeps the threads it has (None: torch's own, OMP_NUM_THREADS where set, else every
    core), and several share the machine's cores evenly, at least one each."""
    if isinstance(setting, int):
        return setting * devices
    if processes <= 1:
        return None
    return max(1, cpu_cores() // processes)


def too_many_threads(threads: int, processes: int) -> str | None:
    """What to say where `processes` processes of `threads` threads each are more threads than this
    machine's cores (their threads then wait for each other); None where they fit."""
    cores = cpu_cores()
    if threads * processes <= cores:
        return None
    each = f"{count(processes, 'process', 'es')} of {threads} threads" if processes > 1 else ""
    return (
        f"parallel.cpu_threads asks for {each or count(threads, 'thread')}, more than this "
        f"machine's {count(cores, 'core')}: the threads will wait for each other; set "
        f"parallel.cpu_threads: auto, or at most {max(1, cores // processes)}"
    )


def resolve_device(cfg: Config) -> tuple[str, int]:
    """(accelerator, devices per machine) from `parallel` and the `model.n_gpus` alias."""
    accelerator, devices = cfg.parallel.accelerator, cfg.parallel.devices
    if cfg.model.n_gpus is not None:
        accelerator, devices = ("cuda", cfg.model.n_gpus) if cfg.model.n_gpus > 0 else ("cpu", 1)
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        if cfg.model.n_gpus:
            raise ConfigError(
                f"model.n_gpus={cfg.model.n_gpus} asks for CUDA GPUs but none is visible; "
                "remove model.n_gpus to train on the CPU, or use parallel.accelerator=cpu "
                f"parallel.devices={cfg.model.n_gpus} for as many CPU processes"
            )
        raise ConfigError(
            "parallel.accelerator=cuda but no CUDA GPU is visible; set parallel.accelerator=auto "
            "or cpu"
        )
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator == "cuda" else 1
    servers = _host_processes(cfg)
    if accelerator == "cuda" and devices - servers > torch.cuda.device_count():
        visible = torch.cuda.device_count()
        if servers:
            raise ConfigError(
                f"parallel.devices={devices} with {servers} {cfg.parallel.strategy} server(s) (in "
                f"host memory) asks for {devices - servers} GPU workers, but {visible} GPU(s) are "
                f"visible; set parallel.devices to at most {visible + servers}"
            )
        raise ConfigError(
            f"{devices} GPUs requested but {visible} are visible; "
            f"set parallel.devices (or model.n_gpus) to at most {visible}"
        )
    if devices < 1:
        raise ConfigError(f"parallel.devices must be at least 1, got {devices}")
    if accelerator == "cpu" and not in_worker() and not cfg.parallel.oversubscribe:
        cores = cpu_cores()
        if devices > CPU_PROCESSES_PER_CORE * cores:
            raise ConfigError(
                f"parallel.devices={devices} would start {devices} CPU processes on {cores} "
                f"core(s); at most {CPU_PROCESSES_PER_CORE * cores} ({CPU_PROCESSES_PER_CORE} per "
                "core) are allowed. Lower parallel.devices, or set parallel.oversubscribe=true to "
                "start them anyway"
            )
    if cfg.parallel.backend == "nccl" and accelerator != "cuda":
        raise ConfigError(
            "parallel.backend=nccl joins CUDA GPUs, but this run is on the CPU; "
            "set parallel.backend=auto or gloo"
        )
    return accelerator, devices


def ignored_settings(cfg: Config) -> list[str]:
    """What the config sets for a strategy other than the run's, which the run ignores, and how to
    use it or leave it: a warning each, from each other strategy's `Family.ignored`. (A strategy's
    section may stay in a config for when it is chosen; what a run would silently do otherwise,
    such as training a model where the user did not put it, is said.)"""
    name = strategy_name(cfg)
    return [said for n, f in families().items() if n != name for said in f.ignored(cfg, name)]


def in_worker() -> bool:
    """Whether this process is one of several started by a launcher (phalanx's own, or torchrun)."""
    return environment.here().in_group


def refuse_outside_workers(name: str, devices: int) -> None:
    """A strategy of one process per device, asked for several devices in one process: one error
    saying how to start them."""
    if not in_worker() and devices > 1:
        raise ConfigError(
            f"parallel.strategy={name} on {devices} devices runs one process per device; start it "
            "with phalanx train (which starts them) or under torchrun"
        )


def strategy_name(cfg: Config) -> str:
    """The strategy the config names; `auto` is the registry's pick for several devices (or inside a
    worker), else its pick for one."""
    name = cfg.parallel.strategy
    if name == "plan":  # api.fit replaces it with the plan's choice before anything is built
        raise ConfigError(
            "parallel.strategy=plan is chosen by `phalanx train`; here name a strategy (`phalanx "
            "plan CONFIG` says which)"
        )
    if name == "auto":
        return auto(in_worker() or resolve_device(cfg)[1] > 1)
    known = families()
    if name not in known:
        raise ConfigError(
            f"parallel.strategy {name!r} is not available{did_you_mean(name, known)}; choose "
            f"one of {', '.join(['auto', 'plan', *known])}"
        )
    return name


def check(cfg: Config, processes: int) -> None:
    """The config's strategy's own conditions on a job of `processes` processes (such as
    stages and micro-batches, the settings a strategy does not support), before any process starts
    or anything is written: a resume's overrides that its strategy refuses leave the run as it
    was."""
    accelerator = resolve_device(cfg)[0]
    get(strategy_name(cfg)).check(cfg, accelerator, processes)


def needs_launch(cfg: Config) -> bool:
    """Whether `phalanx train` must start worker processes itself."""
    return (
        get(strategy_name(cfg)).process_per_device
        and resolve_device(cfg)[1] > 1
        and not in_worker()
    )


def check_nodes(cfg: Config, count: int, elastic: bool = False) -> None:
    """A job on `count` machines runs one process per device on each: a strategy that does. An
    elastic one restarts its workers when the machines change, a fixed one cannot restart yet."""
    name = auto(several=True) if cfg.parallel.strategy == "auto" else strategy_name(cfg)
    if not get(name).process_per_device:
        general = " or ".join(n for n, f in families().items() if f.general)
        raise ConfigError(
            f"parallel.strategy={name} runs in one process, but --nnodes {count} asks for a job on "
            f"{count} machines; use parallel.strategy={general}"
        )
    if elastic and not cfg.parallel.max_restarts:
        raise ConfigError(
            "an elastic job (--nnodes MIN:MAX) restarts its workers whenever machines leave or "
            "join; set parallel.max_restarts to the changes it may go through, such as 10"
        )
    if not elastic and cfg.parallel.max_restarts:
        raise ConfigError(
            f"parallel.max_restarts={cfg.parallel.max_restarts} restarts the workers of one "
            "machine or of an elastic job (--nnodes MIN:MAX); a job on a fixed number of machines "
            "cannot restart: set parallel.max_restarts=0, or give --nnodes as MIN:MAX"
        )


def create(cfg: Config) -> Strategy:
    """The strategy the config asks for, on this process's devices."""
    accelerator, devices = resolve_device(cfg)
    name = strategy_name(cfg)
    strategy = get(name).build(cfg, accelerator, devices)
    if cfg.parallel.build == "device":
        try:
            _build_on_device(strategy, name)
        except BaseException:  # refused: a group it made for this process alone goes too
            strategy.abandon()
            raise
    return strategy


def _build_on_device(strategy: Strategy, name: str) -> None:
    """parallel.build=device: the strategies that keep the whole model on one device build it
    there; the others split or shard it, and say how they build a large model instead."""
    from phalanx.strategies.base import Replicated

    family = get(name)
    if not isinstance(strategy, Replicated) or not family.builds_on_device:
        raise ConfigError(
            f"parallel.build=device builds the whole model on one device, but "
            f"parallel.strategy={name} splits it across devices; use {family.large_model}"
        )
    strategy.build_on_device = True
