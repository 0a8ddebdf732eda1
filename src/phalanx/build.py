"""Builders for the parts a config names (dataset, optimizer, schedulers), and the RNG state."""

from __future__ import annotations

import base64
import copy
import hashlib
import inspect
import logging
import math
import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from phalanx import seeding
from phalanx.config import Config, DatasetConfig, OptimizerConfig
from phalanx.construct import build_value, import_object, instantiate
from phalanx.errors import ConfigError

log = logging.getLogger("phalanx")


def build_dataset(cfg: DatasetConfig, search_dirs: Sequence[Path]) -> Any:
    kwargs = {k: build_value(v, f"dataset.{k}", search_dirs) for k, v in cfg.kwargs().items()}
    return instantiate(
        "dataset", import_object(cfg.class_, search_dirs, key="dataset.class"), **kwargs
    )


def build_optimizer(
    cfg: OptimizerConfig,
    module: nn.Module,
    search_dirs: Sequence[Path],
    batch_size: int,
    fused: bool = False,
    scaled: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters; with `fused` (on CUDA), the fused kernel where
    the class has one and the config does not choose, but for SGD with momentum under a gradient
    scaler (`scaled`): torch's fused SGD makes its momentum buffers, uninitialised, before it reads
    the scaler's "skip" flag, and keeps them from a skipped first step (an fp16 run's first steps
    are often skipped)."""
    factory = import_object(
        cfg.class_, search_dirs, default_module="torch.optim", key="optimizer.class"
    )
    if isinstance(factory, type) and not issubclass(factory, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer.class {cfg.class_} is a {factory.__name__}, not a torch.optim.Optimizer; "
            "name an optimizer, such as AdamW or SGD"
        )
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters; check model.class")
    kwargs = scaled_lr(cfg, batch_size)
    # a NaN or an infinity makes every weight NaN at the first step, silently
    for key, value in kwargs.items():
        values = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(
                f"optimizer.{key} is {value!r}, which is not a finite number; give a finite one"
            )
    chosen = "fused" in kwargs or "foreach" in kwargs
    if (
        fused
        and not chosen
        and _takes(factory, "fused")
        and not (scaled and kwargs.get("momentum"))
    ):
        kwargs["fused"] = True
    elif scaled and kwargs.get("fused") and kwargs.get("momentum"):
        log.warning(
            "optimizer: fused: true with momentum under fp16: torch's fused kernel keeps "
            "uninitialised momentum from a first step that the gradient scaler skips (fp16's first "
            "steps often are); drop fused, or train in bf16"
        )
    return instantiate("optimizer", factory, params, **kwargs)


def _takes(factory: Any, name: str) -> bool:
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def scaled_lr(cfg: OptimizerConfig, batch_size: int) -> dict[str, Any]:
    """Optimizer keywords with `lr` scaled for the global batch (linear or square-root rule).

    The global batch does not change with the device count, so neither does the scaled rate.
    """
    kwargs = cfg.kwargs()
    scaling = cfg.lr_scaling
    if scaling is None or scaling.rule == "none":
        return kwargs
    rule = scaling.rule
    if "lr" not in kwargs:
        raise ConfigError(
            "optimizer.lr_scaling needs optimizer.lr, the rate tuned for base_batch_size"
        )
    ratio = batch_size / scaling.base_batch_size
    factor = ratio if rule == "linear" else math.sqrt(ratio)
    scaled = kwargs["lr"] * factor
    log.info(
        "learning rate %g scaled to %g (%s rule: batch %d / base %d)",
        kwargs["lr"],
        scaled,
        rule,
        batch_size,
        scaling.base_batch_size,
    )
    return {**kwargs, "lr": scaled}


AUTO = "auto"


def build_schedulers(
    cfg: Config,
    optimizer: torch.optim.Optimizer,
    search_dirs: Sequence[Path],
    steps_per_epoch: int | None = None,
) -> list[tuple[Any, str]]:
    """(scheduler, interval) pairs: the linear warm-up first, then the configured scheduler.

    Both act multiplicatively on the learning rate, so a warm-up composes with any chainable
    scheduler (StepLR, CosineAnnealingLR, ExponentialLR ...). A scheduler argument given as `auto`
    (OneCycleLR's total_steps, CosineAnnealingLR's T_max, LinearLR's total_iters ...) is the number
    of times the scheduler steps in the whole run: the optimizer steps of every epoch, or the
    epochs.
    """
    schedulers: list[tuple[Any, str]] = []
    warmup = cfg.optimizer.warmup_steps
    if warmup:
        schedulers.append(
            (
                torch.optim.lr_scheduler.LinearLR(
                    optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup
                ),
                "step",
            )
        )
    if cfg.scheduler is not None:
        factory = import_object(
            cfg.scheduler.class_,
            search_dirs,
            default_module="torch.optim.lr_scheduler",
            key="scheduler.class",
        )
        kwargs = cfg.scheduler.kwargs()
        auto = [key for key, value in kwargs.items() if value == AUTO]
        if auto:
            if steps_per_epoch is None:
                raise ConfigError(
                    f"scheduler: {', '.join(auto)}: auto is the run's length, which an iterable "
                    "training stream without __len__ does not tell; give the number of steps "
                    "instead"
                )
            length = cfg.main_loop.epochs * (
                steps_per_epoch if cfg.scheduler.interval == "step" else 1
            )
            kwargs.update(dict.fromkeys(auto, length))
            log.info(
                "scheduler %s: %s = %d (auto: the %s of the run)",
                cfg.scheduler.class_,
                ", ".join(auto),
                length,
                "optimizer steps" if cfg.scheduler.interval == "step" else "epochs",
            )
        scheduler = instantiate("scheduler", factory, optimizer, **kwargs)
        _try_schedule(cfg, factory, optimizer, kwargs)
        schedulers.append((scheduler, cfg.scheduler.interval))
    return schedulers


def _try_schedule(
    cfg: Config, factory: Any, optimizer: torch.optim.Optimizer, kwargs: dict
) -> None:
    """Arguments of one of torch's schedulers that only its steps would refuse (a T_max of 0 or of
    text, a scheduler that needs a measured value), refused before the run starts: its first step
    taken on a stand-in optimizer of the same class and groups, with copies of the arguments (a
    scheduler of the user's own, whose steps may act on more than the optimizer, is not tried)."""
    assert cfg.scheduler is not None
    if not getattr(factory, "__module__", "").startswith("torch.optim.lr_scheduler"):
        return
    stand_in = _stand_in(optimizer)
    if stand_in is None:
        return
    name = cfg.scheduler.class_
    try:
        copied = copy.deepcopy(kwargs)
    except Exception:  # noqa: BLE001 - an argument that will not copy: not tried
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            factory(stand_in, **copied).step()
    except TypeError as e:
        if "metrics" in str(e):
            raise ConfigError(
                f"scheduler: {name} steps on a measured value (metrics), which the scheduler "
                "section does not give it; schedule the learning rate by step or epoch instead "
                "(StepLR, CosineAnnealingLR ...), or stop on a plateau with the StopOnPlateau hook"
            ) from None
        raise _refused_step(name, kwargs, e) from e
    except (ValueError, ArithmeticError) as e:
        raise _refused_step(name, kwargs, e) from e


def _stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """An optimizer of `optimizer`'s class over one parameter a group, with copies of its groups'
    settings (a tensor learning rate that a step writes in place, too); None where the class will
    not build so."""
    try:
        groups = [
            {
                **copy.deepcopy({k: v for k, v in group.items() if k != "params"}),
                "params": [nn.Parameter(torch.zeros(1))],
            }
            for group in optimizer.param_groups
        ]
        kind: Any = type(optimizer)  # its subclasses take the groups alone
        return kind(groups)
    except Exception:  # noqa: BLE001 - a class of the user's with a constructor of its own
        return None


def _refused_step(name: str, kwargs: dict[str, Any], error: Exception) -> ConfigError:
    given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return ConfigError(
        f"scheduler: {name}({given}) fails at its first step: {type(error).__name__}: {error}; "
        "fix the values in the scheduler section"
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A seed for rank `rank`'s random streams from step `step` on: independent of the others'."""
    digest = hashlib.sha256(f"phalanx:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rng_state() -> dict[str, Any]:
    """Every RNG's state, as JSON-serialisable values."""
    legacy = np.random.get_state(legacy=True)
    # the global RandomState is an MT19937, whose legacy state is always this tuple
    assert isinstance(legacy, tuple)
    kind, keys, pos, has_gauss, gauss = legacy
    state = {
        "python": _jsonable(random.getstate()),
        "torch": _b64(torch.get_rng_state()),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    torch.set_rng_state(_unb64(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    seeding.set_numpy_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if (
        "cuda" in state
        and torch.cuda.is_available()
        and len(state["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def check_given_model(module: nn.Module, strategy: Any) -> None:
    """A model given as an object: built already, so not on the meta device; and, where each rank
    built its own (under torchrun), the same on every rank, as one process's would be."""
    where = strategy.init_context()
    if isinstance(where, torch.device):
        setting, instead = (
            ("parallel.fsdp.init: meta", "init: full")
            if where.type == "meta"
            else ("parallel.build: device", "build: host")
        )
        raise ConfigError(
            f"{setting} builds the model itself, but the model was given as an object, built "
            f"already; name its class in model.class, or use {instead}"
        )
    differing = strategy.differing_ranks(module)
    if differing:
        raise ConfigError(
            f"the model given differs on rank(s) {differing} from rank 0's: each process built its "
            "own from its own random state. Seed before building it (torch.manual_seed(0) first), "
            "so that every process starts from the same weights"
        )
