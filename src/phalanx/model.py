"""Model protocol: `forward` takes the batch keys it names and returns a dict of named outputs.

`loss` (a per-sample vector, or the mean over the batch) is the objective. Plain modules, which take
tensors and return a tensor, work through the config alone: `inputs:` maps batch keys to forward
arguments, `outputs:` names what they return, and `loss:` names a torch.nn.functional loss.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.config import LossConfig, ModelConfig, build_value, import_object, instantiate
from phalanx.errors import ModelError


def build_model(cfg: ModelConfig, search_dirs: list[Path]) -> nn.Module:
    """The user's module, built from the `model` section."""
    kwargs = {k: build_value(v, f"model.{k}", search_dirs) for k, v in cfg.kwargs().items()}
    args = build_value(cfg.args, "model.args", search_dirs)
    module = instantiate("model", import_object(cfg.class_, search_dirs), *args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ModelError(f"model.class {cfg.class_!r} built a {type(module).__name__}, not a torch.nn.Module")
    return module


class Forward:
    """Calls a module on a batch and returns its outputs as a dict holding a `loss`."""

    def __init__(self, module: nn.Module, cfg: ModelConfig, search_dirs: list[Path] = (),
                 inner: nn.Module | None = None):
        """`module` is called; `inner` (the user's module inside any wrapper) says what forward takes."""
        self.module = module
        self.inputs = cfg.inputs
        self.outputs = [cfg.outputs] if isinstance(cfg.outputs, str) else list(cfg.outputs)
        self._single = self.outputs[0] if len(self.outputs) == 1 else None  # the name of a lone tensor output
        self.loss_fn = _loss_function(cfg.loss, search_dirs) if cfg.loss else None
        self.loss_cfg = cfg.loss
        self.params, self.takes_all = _forward_params(inner if inner is not None else module)
        self.output_names: list[str] = []

    def bound_to(self, module: nn.Module) -> Forward:
        """The same adapter calling another module of the same class (a replica on another device)."""
        other = copy.copy(self)
        other.module, other.output_names = module, []
        return other

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        try:  # the mapping is checked only when it fails: this runs every step
            arguments = {arg: batch[key] for key, arg in self.inputs.items()} if self.inputs is not None \
                else self._arguments(batch)
        except KeyError:
            arguments = self._arguments(batch)
        raw = self.module(**arguments)
        outputs = {self._single: raw} if self._single is not None and isinstance(raw, torch.Tensor) \
            else self._as_dict(raw)
        if self.loss_fn is not None:
            outputs["loss"] = self._loss(outputs, batch)
        elif "loss" not in outputs:
            raise ModelError(f"the model returned outputs {sorted(outputs)} but no 'loss'; return "
                             "{'loss': ...} from forward, or name one with model.loss: "
                             "{function: cross_entropy, output: ..., target: ...}")
        self.output_names = list(outputs)
        return outputs

    def _arguments(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.inputs is not None:
            missing = [k for k in self.inputs if k not in batch]
            if missing:
                raise ModelError(f"model.inputs names batch keys {missing} that the batch lacks "
                                 f"(it has {', '.join(batch)})")
            return {arg: batch[key] for key, arg in self.inputs.items()}
        if self.takes_all:
            return dict(batch)
        missing = [n for n, required in self.params.items() if required and n not in batch]
        if missing:
            raise ModelError(f"{type(self.module).__name__}.forward needs {missing} but the batch has "
                             f"{', '.join(batch)}; rename the dataset keys or map them with model.inputs")
        return {n: batch[n] for n in self.params if n in batch}

    def _as_dict(self, raw: Any) -> dict[str, torch.Tensor]:
        if isinstance(raw, torch.Tensor) and len(self.outputs) == 1:
            return {self.outputs[0]: raw}
        if isinstance(raw, Mapping):
            return dict(raw)
        values = raw if isinstance(raw, (tuple, list)) else (raw,)
        if len(values) != len(self.outputs):
            raise ModelError(f"the model returned {len(values)} values but model.outputs names "
                             f"{len(self.outputs)}: {self.outputs}")
        return dict(zip(self.outputs, values))

    def _loss(self, outputs: dict, batch: Mapping[str, Any]) -> torch.Tensor:
        cfg = self.loss_cfg
        try:
            prediction, target = outputs[cfg.output], batch[cfg.target]
        except KeyError:
            if cfg.output not in outputs:
                raise ModelError(f"model.loss.output {cfg.output!r} is not an output; outputs are "
                                 f"{sorted(outputs)}") from None
            raise ModelError(f"model.loss.target {cfg.target!r} is not a batch key; keys are "
                             f"{', '.join(batch)}") from None
        loss = self.loss_fn(prediction, target, reduction="none")
        return loss.reshape(loss.shape[0], -1).mean(dim=1) if loss.dim() > 1 else loss


def _loss_function(cfg: LossConfig, search_dirs: list[Path]) -> Callable:
    return import_object(cfg.function, search_dirs, default_module="torch.nn.functional")


def _forward_params(module: nn.Module) -> tuple[dict[str, bool], bool]:
    """Forward's named parameters (name -> required) and whether it takes **kwargs."""
    params = inspect.signature(module.forward).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p.default is p.empty for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, takes_all


def check_loss(loss: torch.Tensor, n: int) -> torch.Tensor:
    """The loss of a shard of `n` samples as a scalar mean or one value per sample (a loss with
    more dimensions per sample is averaged over them)."""
    if loss.dim() == 0:
        return loss
    if loss.shape[0] != n:
        raise ModelError(f"'loss' has shape {tuple(loss.shape)}; return one value per sample ({n}) or a scalar mean")
    return loss if loss.dim() == 1 else loss.reshape(n, -1).mean(dim=1)


def shard_loss_mean(loss: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of per-sample losses over a shard of `n` samples; a scalar loss is that mean already."""
    loss = check_loss(loss, n)
    return loss if loss.dim() == 0 else loss.mean()
