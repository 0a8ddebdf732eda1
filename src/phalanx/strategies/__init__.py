"""Strategies and the choice among them from the `parallel` section."""
from __future__ import annotations

import torch

from phalanx.config import Config
from phalanx.errors import ConfigError
from phalanx.strategies.base import Strategy
from phalanx.strategies.single import Single

STRATEGIES = {"single": Single}


def resolve_device(cfg: Config) -> tuple[str, int]:
    """(accelerator, device count) from `parallel` and the `model.n_gpus` alias."""
    accelerator, devices = cfg.parallel.accelerator, cfg.parallel.devices
    if cfg.model.n_gpus is not None:
        accelerator, devices = ("cuda", cfg.model.n_gpus) if cfg.model.n_gpus > 0 else ("cpu", 1)
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        if cfg.model.n_gpus:
            raise ConfigError(f"model.n_gpus={cfg.model.n_gpus} asks for CUDA GPUs but none is visible; "
                              "remove model.n_gpus to train on the CPU")
        raise ConfigError("parallel.accelerator=cuda but no CUDA GPU is visible; set parallel.accelerator=auto or cpu")
    if accelerator == "cuda" and devices != "auto" and devices > torch.cuda.device_count():
        raise ConfigError(f"{devices} GPUs requested but {torch.cuda.device_count()} are visible; "
                          f"set parallel.devices (or model.n_gpus) to at most {torch.cuda.device_count()}")
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator == "cuda" else 1
    return accelerator, devices


def create(cfg: Config) -> Strategy:
    """The strategy the config asks for, on this process's device."""
    accelerator, devices = resolve_device(cfg)
    if devices != 1:
        raise ConfigError(f"{devices} devices requested, but this version of phalanx trains on one device; "
                          "set parallel.devices=1 (and leave model.n_gpus unset)")
    name = "single" if cfg.parallel.strategy == "auto" else cfg.parallel.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"parallel.strategy {name!r} is not available; choose one of "
                          f"{', '.join(['auto', *STRATEGIES])}")
    return STRATEGIES[name](torch.device(accelerator))
