"""Strategies and the choice among them from the `parallel` section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx import environment
from phalanx.config import Config
from phalanx.environment import cpu_cores
from phalanx.errors import ConfigError, did_you_mean
from phalanx.settings import (
    DDPSettings,
    FSDPSettings,
    ParamServerSettings,
    PipelineSettings,
    TowersSettings,
)
from phalanx.strategies.base import Strategy
from phalanx.strategies.single import Single

# CPU processes a launch may start per core: more only slow each other down (and a typo such as
# parallel.devices=1000 would start processes until the machine gives out).
# parallel.oversubscribe=true lifts the limit.
CPU_PROCESSES_PER_CORE = 4


def _host_processes(cfg: Config) -> int:
    """The processes of a run that hold no GPU: param_server's servers."""
    if cfg.parallel.strategy != "param_server":
        return 0
    return cfg.parallel.section("param_server", ParamServerSettings).servers


def rejoining(cfg: Config, devices: int) -> tuple[int, ...]:
    """The ranks whose worker, where it dies, is started again alone while the others go on:
    param_server's workers other than the main one, on one machine, where restarts are allowed."""
    servers = _host_processes(cfg)
    if not servers or not cfg.parallel.max_restarts:
        return ()
    return tuple(range(1, devices - servers))


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
                f"parallel.devices={devices} with {servers} param_server server(s) (in host "
                f"memory) asks for {devices - servers} GPU workers, but {visible} GPU(s) are "
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


def _refuse(
    name: str,
    unsupported: dict[str, bool],
    instead: str = "parallel.strategy=ddp (bf16 instead of fp16)",
) -> None:
    """One error naming the settings strategy `name` does not support that the config uses."""
    named = [setting for setting, used in unsupported.items() if used]
    if named:
        raise ConfigError(
            f"parallel.strategy={name} does not support {', '.join(named)}; remove it, or use "
            f"{instead}"
        )


def ignored_settings(cfg: Config) -> list[str]:
    """What the config sets for a strategy other than the run's, which the run ignores, and how to
    use it or leave it: a warning each. (A strategy's section may stay in a config for when it is
    chosen, as `parallel.pipeline` in examples/two_tower does; but a module placement the run
    does not apply trains the model where the user did not put it.)"""
    name, placement = strategy_name(cfg), cfg.parallel.section("placement", dict)
    if not placement or name == "placement":
        return []
    return [
        f"parallel.placement pins {', '.join(placement)} to devices for "
        f"parallel.strategy=placement only; this run's strategy, {name}, ignores it: set "
        "parallel.strategy=placement, or remove parallel.placement"
    ]


def in_worker() -> bool:
    """Whether this process is one of several started by a launcher (phalanx's own, or torchrun)."""
    return environment.here().in_group


def _no_check(cfg: Config, accelerator: str, processes: int) -> None:
    """A strategy whose config has no conditions beyond its settings' own."""


@dataclass(frozen=True)
class Entry:
    """A strategy as the config names it: how to build it for this process, and whether it runs one
    process per device (which `phalanx train` starts) or drives all of them from one. Its own
    section of the config, `parallel.<name>`, is registered in `phalanx.settings`. `check`: the
    conditions of the config alone on the processes of the job, which its builder checks too,
    and `phalanx train` and `resume` before any process starts or anything is written."""

    build: Callable[[Config, str, int], Strategy]  # (config, accelerator, devices per machine)
    process_per_device: bool
    summary: str
    check: Callable[[Config, str, int], None] = _no_check  # (config, accelerator, processes)


def _single(cfg: Config, accelerator: str, devices: int) -> Strategy:
    if in_worker() or devices > 1:
        raise ConfigError(
            f"parallel.strategy=single runs one process on one device, but {devices} devices "
            "were asked for; set parallel.strategy=auto (or ddp), or parallel.devices=1"
        )
    return Single(torch.device(accelerator))


def _ddp(cfg: Config, accelerator: str, devices: int) -> Strategy:
    if not in_worker():
        raise ConfigError(
            "parallel.strategy=ddp needs several processes; set parallel.devices to 2 or more "
            "(phalanx starts them), or start phalanx under torchrun"
        )
    from phalanx.strategies.ddp import DDP

    return DDP(
        accelerator,
        cfg.parallel.timeout_s,
        cfg.parallel.sync_batchnorm,
        backend=cfg.parallel.backend,
        bucket_cap_mb=cfg.parallel.section("ddp", DDPSettings).bucket_cap_mb,
    )


def _towers(cfg: Config, accelerator: str, devices: int) -> Strategy:
    if in_worker():
        raise ConfigError(
            "parallel.strategy=towers drives every device from one process, but this is one of "
            "several processes; start phalanx without torchrun, or use parallel.strategy=ddp"
        )
    _refuse(
        "towers",
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            "precision=fp16": cfg.precision == "fp16",
        },
    )
    from phalanx.strategies.towers import Towers

    count = (
        [torch.device(accelerator, i) for i in range(devices)]
        if accelerator == "cuda"
        else [torch.device("cpu")] * devices
    )
    return Towers(count, cfg.parallel.section("towers", TowersSettings).variables_on)


def _fsdp(cfg: Config, accelerator: str, devices: int) -> Strategy:
    """Several processes (phalanx starts one per device), or this one alone on one device (a group
    of one: offload then trains a model larger than the device's memory)."""
    if not in_worker() and devices > 1:
        raise ConfigError(
            f"parallel.strategy=fsdp on {devices} devices runs one process per device; start it "
            "with phalanx train (which starts them) or under torchrun"
        )
    _check_fsdp(cfg, accelerator, devices)
    from phalanx.strategies.fsdp import FSDP

    return FSDP(
        accelerator,
        cfg.parallel.section("fsdp", FSDPSettings),
        cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
    )


def _check_fsdp(cfg: Config, accelerator: str, processes: int) -> None:
    _refuse(
        "fsdp",
        {
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            "precision=fp16": cfg.precision == "fp16",
        },
    )


def _pipeline(cfg: Config, accelerator: str, devices: int) -> Strategy:
    settings = _pipeline_settings(cfg, accelerator)
    if not in_worker():
        per_process = settings.stages_per_process or 1
        stages = len(settings.split) + 1 if settings.split != "auto" else settings.stages
        processes = f"{stages // per_process} processes" if stages else "several processes"
        raise ConfigError(
            f"parallel.strategy=pipeline runs its stages in {processes}; set parallel.devices to "
            f"{stages // per_process if stages else 2} or a multiple (phalanx starts them), or "
            "start phalanx under torchrun"
        )
    from phalanx.strategies.pipeline import Pipeline

    # its stages and the schedule's micro-batches are checked as it is built, at the world's size
    return Pipeline(
        accelerator,
        settings,
        window=-(-cfg.dataset.batch_size // cfg.parallel.accumulation),
        timeout_s=cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
    )


def _check_pipeline(cfg: Config, accelerator: str, processes: int) -> None:
    from phalanx.strategies.pipeline import layout

    layout(_pipeline_settings(cfg, accelerator), processes)


def _pipeline_settings(cfg: Config, accelerator: str) -> PipelineSettings:
    """`parallel.pipeline`, checked against the rest of the config."""
    settings = cfg.parallel.optional_section("pipeline", PipelineSettings)
    if settings is None:
        raise ConfigError(
            "parallel.strategy=pipeline needs parallel.pipeline.split, the modules where a new "
            "stage starts, such as parallel.pipeline.split=[net.3]"
        )
    if accelerator == "cuda" and cfg.parallel.backend == "gloo":
        raise ConfigError(
            "parallel.strategy=pipeline on GPUs sends activations between stages over NCCL, one "
            "GPU a process; gloo cannot send GPU memory: set parallel.backend=auto (or nccl)"
        )
    per_process = settings.stages_per_process or 1
    stages = len(settings.split) + 1 if settings.split != "auto" else settings.stages
    if stages == per_process:
        raise ConfigError(
            f"parallel.pipeline puts its {stages} stages in one process ({per_process} per "
            "process, parallel.pipeline.stages_per_process): a pipeline runs over two processes "
            f"or more; split it at {2 * per_process - 1} points, or set parallel.strategy=single"
        )
    _refuse(
        "pipeline",
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            "precision=fp16": cfg.precision == "fp16",
            "compile": bool(cfg.compile),
        },
        "parallel.strategy=ddp or fsdp",
    )
    return settings


def _param_server(cfg: Config, accelerator: str, devices: int) -> Strategy:
    settings = cfg.parallel.section("param_server", ParamServerSettings)
    if in_worker():
        _check_param_server(cfg, accelerator, environment.here().world_size)
    else:
        raise ConfigError(
            f"parallel.strategy=param_server runs {settings.servers} server(s) and at least one "
            f"worker, each a process; set parallel.devices to {settings.servers + 1} or more "
            "(phalanx starts them), or start phalanx under torchrun"
        )
    from phalanx.strategies.param_server import ParamServer

    return ParamServer(accelerator, settings, cfg.parallel.timeout_s, backend=cfg.parallel.backend)


def _check_param_server(cfg: Config, accelerator: str, processes: int) -> None:
    servers = cfg.parallel.section("param_server", ParamServerSettings).servers
    if processes <= servers:
        raise ConfigError(
            f"parallel.param_server.servers={servers} leaves no worker among the {processes} "
            f"processes; set parallel.devices to at least {servers + 1}, or fewer servers"
        )
    _refuse(
        "param_server",
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            "precision=fp16": cfg.precision == "fp16",
        },
    )


def _placement(cfg: Config, accelerator: str, devices: int) -> Strategy:
    if in_worker():
        raise ConfigError(
            "parallel.strategy=placement runs in one process, but this is one of several; start "
            "phalanx without torchrun, or use parallel.strategy=pipeline"
        )
    placement = cfg.parallel.section("placement", dict)
    if not placement:
        raise ConfigError(
            "parallel.strategy=placement needs parallel.placement, the device of each module by "
            "name, such as parallel.placement={encoder: cuda:0, decoder: cuda:1}"
        )
    visible = torch.cuda.device_count()
    for name, where in placement.items():
        try:
            device = torch.device(where)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"parallel.placement puts {name} on {where!r}; name a device such as cuda:0, "
                "cuda:1 or cpu"
            )
        if device.type == "cuda" and (device.index or 0) >= visible:
            raise ConfigError(
                f"parallel.placement puts {name} on {where}, but {visible} GPU(s) are visible"
            )
    if cfg.compile:
        raise ConfigError("parallel.strategy=placement does not support compile; remove it")
    from phalanx.strategies.placement import Placement

    home = torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")
    return Placement(home, placement)


# parallel.strategy -> the strategy; a strategy's own settings are the section of `parallel` named
# after it
REGISTRY: dict[str, Entry] = {
    "single": Entry(_single, False, "one process, one device"),
    "ddp": Entry(
        _ddp, True, "one process per device, gradients all-reduced by DistributedDataParallel"
    ),
    "towers": Entry(
        _towers, False, "one process driving every device, a replica on each, in threads"
    ),
    "fsdp": Entry(
        _fsdp,
        True,
        "one process per device, parameters, gradients and optimizer state sharded (FSDP2)",
        _check_fsdp,
    ),
    "pipeline": Entry(
        _pipeline,
        True,
        "the model split by layers into stages, one process each; micro-batches flow through",
        _check_pipeline,
    ),
    "placement": Entry(
        _placement, False, "one process, the model's modules pinned to devices by name"
    ),
    "param_server": Entry(
        _param_server,
        True,
        "servers hold the parameters and the optimizer; workers pull, compute and push, without "
        "waiting for each other (a staleness bound)",
        _check_param_server,
    ),
}


def strategy_name(cfg: Config) -> str:
    """The strategy the config names; `auto` is ddp for several devices (or inside a worker), else
    single."""
    name = cfg.parallel.strategy
    if name == "plan":  # api.fit replaces it with the plan's choice before anything is built
        raise ConfigError(
            "parallel.strategy=plan is chosen by `phalanx train`; here name a strategy (`phalanx "
            "plan CONFIG` says which)"
        )
    if name == "auto":
        return "ddp" if in_worker() or resolve_device(cfg)[1] > 1 else "single"
    if name not in REGISTRY:
        raise ConfigError(
            f"parallel.strategy {name!r} is not available{did_you_mean(name, REGISTRY)}; choose "
            f"one of {', '.join(['auto', 'plan', *REGISTRY])}"
        )
    return name


def check(cfg: Config, processes: int) -> None:
    """The config's strategy's own conditions on a job of `processes` processes (a pipeline's
    stages and micro-batches, the settings a strategy does not support), before any process starts
    or anything is written: a resume's overrides that its strategy refuses leave the run as it
    was."""
    accelerator = resolve_device(cfg)[0]
    REGISTRY[strategy_name(cfg)].check(cfg, accelerator, processes)


def needs_launch(cfg: Config) -> bool:
    """Whether `phalanx train` must start worker processes itself."""
    return (
        REGISTRY[strategy_name(cfg)].process_per_device
        and resolve_device(cfg)[1] > 1
        and not in_worker()
    )


def check_nodes(cfg: Config, count: int, elastic: bool = False) -> None:
    """A job on `count` machines runs one process per device on each: a strategy that does. An
    elastic one restarts its workers when the machines change, a fixed one cannot restart yet."""
    name = "ddp" if cfg.parallel.strategy == "auto" else strategy_name(cfg)
    if not REGISTRY[name].process_per_device:
        raise ConfigError(
            f"parallel.strategy={name} runs in one process, but --nnodes {count} asks for a job on "
            f"{count} machines; use parallel.strategy=ddp or fsdp"
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
    strategy = REGISTRY[name].build(cfg, accelerator, devices)
    if cfg.parallel.build == "device":
        _build_on_device(strategy, name)
    return strategy


def _build_on_device(strategy: Strategy, name: str) -> None:
    """parallel.build=device: the strategies that keep the whole model on one device build it
    there; the others split or shard it, and say how they build a large model instead."""
    from phalanx.strategies.base import Replicated

    if not isinstance(strategy, Replicated) or name == "placement":
        instead = (
            "parallel.fsdp.init=meta (each module drawn and sharded in turn)"
            if name == "fsdp"
            else "parallel.build=host"
        )
        raise ConfigError(
            f"parallel.build=device builds the whole model on one device, but "
            f"parallel.strategy={name} splits it across devices; use {instead}"
        )
    strategy.build_on_device = True
