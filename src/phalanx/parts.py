"""The model's parts as a config describes them, built for this process by its strategy: the
precision, the module to call and the user's module inside it, the forward, the optimizer, the
schedulers and the engine that steps them. A process that trains holds them in its `Trainer`; a
process that serves the others (a parameter server's) holds them alone, with its run state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx import keras_models, random
from phalanx.build import (
    build_dataset,
    build_optimizer,
    build_schedulers,
    check_given_model,
    derived_seed,
    seed_everything,
)
from phalanx.config import CompileConfig, Config
from phalanx.engine import Engine
from phalanx.feed import Feed
from phalanx.model import Forward, build_model
from phalanx.objects import Objects
from phalanx.precision import Precision
from phalanx.strategies.base import ModelOptions, Strategy


@dataclass
class ModelParts:
    precision: Precision
    # the module to call, and the user's module inside it: what the optimizer steps and
    # checkpoints hold
    module: torch.nn.Module
    model: torch.nn.Module
    forward: Forward
    optimizer: torch.optim.Optimizer | None
    schedulers: list
    engine: Engine
    # the dropout modules that draw keyed by sample
    keyed: list[str]


def build_feed(
    cfg: Config,
    search_dirs: list[Path],
    strategy: Strategy,
    objects: Objects,
    persistent: bool = True,
) -> Feed:
    """Torch set as the config asks, the process seeded, and the dataset's feed: what a process
    builds first, before its model."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    seed_everything(cfg.seed)
    dataset = (
        objects.dataset if objects.dataset is not None else build_dataset(cfg.dataset, search_dirs)
    )
    return Feed(cfg, dataset, strategy, persistent)


def build_parts(
    cfg: Config,
    search_dirs: list[Path],
    strategy: Strategy,
    feed: Feed,
    given: torch.nn.Module | None = None,
    inference: bool = False,
    run_dir: Path | None = None,
) -> ModelParts:
    """This process's model parts (`given`: a model built already; `inference`: no optimizer)."""
    if given is not None:
        module = given
        check_given_model(module, strategy)
    else:
        with strategy.init_context():
            module = build_model(cfg.model, search_dirs)
    # a Keras model's description, which `phalanx export` rebuilds it from without its code
    if run_dir is not None and not inference and strategy.is_main:
        keras_models.record(module, run_dir)
    precision = Precision(cfg.precision, strategy.device, cfg.channels_last)
    options = ModelOptions(
        precision,
        cfg.channels_last,
        tuple(cfg.activation_checkpointing),
        _compile_options(cfg),
        sample=feed.first_samples,
        adapter=lambda m: Forward(m, cfg.model, search_dirs),
    )
    # dropout masks keyed by sample: set on the user's module, under its own names, before any
    # strategy wraps, shards or splits it
    keyed = random.key_modules(module) if cfg.per_sample_random else []
    module, model = strategy.setup(module, options)
    # Dropout and augmentation: each rank's streams from the seed and the rank (rank 0's those of
    # one process), as on a resume on another process count; not from what building the model
    # drew, so that a model given as an object trains as the config's own would. Towers: each
    # tower's, as ddp's ranks'.
    seed_everything(derived_seed(cfg.seed, 0, strategy.rank))
    strategy.seed_streams(cfg.seed, 0)
    forward = Forward(
        module,
        cfg.model,
        search_dirs,
        inner=model,
        copies=replays_graphs(_compile_options(cfg), strategy.device),
    )
    # building an optimizer imports torch's compiler stack: seconds that evaluation does not need
    optimizer = (
        None
        if inference
        else build_optimizer(
            cfg.optimizer,
            model,
            search_dirs,
            cfg.dataset.batch_size,
            fused=strategy.device.type == "cuda",
            scaled=cfg.precision == "fp16",
        )
    )
    schedulers = (
        []
        if optimizer is None
        else build_schedulers(cfg, optimizer, search_dirs, feed.steps_per_epoch)
    )
    engine = Engine(
        module,
        forward,
        optimizer,
        schedulers,
        precision,
        cfg.optimizer.max_grad_norm,
        random_seed=cfg.seed if cfg.per_sample_random else None,
    )
    return ModelParts(precision, module, model, forward, optimizer, schedulers, engine, keyed)


def replays_graphs(compiled: CompileConfig | None, device: torch.device) -> bool:
    """Whether a model compiled as `compiled` (None: not compiled) runs as CUDA graphs on
    `device`: torch's `reduce-overhead` and `max-autotune` modes, and its `cudagraphs` backend. Each
    replay of a graph writes its outputs where the one before wrote its own, and torch refuses to
    read a tensor that a later replay overwrote."""
    if compiled is None or device.type != "cuda":
        return False
    if compiled.backend == "cudagraphs":
        return True
    if compiled.backend != "inductor" or compiled.mode is None:
        return False
    from torch._inductor import list_mode_options

    return bool(list_mode_options(compiled.mode).get("triton.cudagraphs"))


def _compile_options(cfg: Config) -> Any:
    if not cfg.compile:
        return None
    return cfg.compile if not isinstance(cfg.compile, bool) else CompileConfig()
