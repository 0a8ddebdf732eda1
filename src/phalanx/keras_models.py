"""Keras 3 models under phalanx.

On its torch backend a Keras model is a `torch.nn.Module` whose weights are torch parameters, so
phalanx trains it as any module. Two things stand in the way, and this module removes them: Keras
names its weights with process-wide counters (`dense_4/kernel` in a process's fifth Dense layer),
so a checkpoint written by one build would not load into the next; and a Keras model returns its
predictions, its loss living in `compile(loss=...)`. `KerasModule` holds the model and registers
the very parameters Keras reads under names taken from the model's structure (`dense_2.kernel`:
the layer's class and its place among its parent's layers), which every build of the same model
gives alike; a Keras loss named in `model.loss` gives the per-sample loss (`per_sample`).

A tower's replica is a copy of the Keras model made as Python copies objects (`_copy_model`). For
`phalanx export`, training records Keras's description of the model (`record`), which export
rebuilds it from with no code of the run's (`rebuilt`) before it writes Keras's own file atomically
(`save`).

Keras must be loaded with `KERAS_BACKEND=torch`: phalanx sets it before it imports Keras, and says
so where a Keras on another backend was imported first.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.construct import KERAS_INSTALL, prefer_torch_keras
from phalanx.errors import ModelError, PhalanxError
from phalanx.files import write_text_atomic, writing

log = logging.getLogger("phalanx")

# the files Keras writes: a whole model, or its weights
KERAS_FILES = (".keras", ".weights.h5")
# in a run directory: Keras's description of the run's model (its config, no code), which `phalanx
# export` rebuilds it from without importing the run's code
ARCHITECTURE = "keras_model.json"


def import_keras() -> Any:
    """Keras, on its torch backend."""
    prefer_torch_keras()
    chosen = os.environ.get("KERAS_BACKEND", "torch")
    if "keras" not in sys.modules and chosen != "torch":
        raise ModelError(
            f"KERAS_BACKEND={chosen}, but phalanx trains Keras models on its torch backend; "
            "unset KERAS_BACKEND or set it to torch"
        )
    try:
        import keras
    except ImportError:
        raise ModelError(
            f"the model is a Keras model, but Keras is not installed: {KERAS_INSTALL}"
        ) from None
    backend = keras.backend.backend()
    if backend != "torch":
        raise ModelError(
            f"Keras was imported on its {backend} backend before phalanx could choose torch; set "
            "KERAS_BACKEND=torch before importing keras (or import phalanx first)"
        )
    return keras


def is_keras(value: Any) -> bool:
    """Whether `value` is a Keras layer or model (Keras is not imported to find out)."""
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(value, keras.layers.Layer)


class KerasModule(nn.Module):
    """A Keras model as a torch module: the model's own parameters under names of its structure.

    `forward(x)` calls the model (`training` follows the module's mode) and returns its output. The
    Keras model is held, not registered as a submodule: its names carry Keras's counters. Moving
    the module (`to`, `double`) moves the parameters in place, where Keras reads them too.
    """

    def __init__(self, model: Any):
        super().__init__()
        import_keras()
        if not model.built:
            raise ModelError(
                f"the Keras model {model.name!r} is not built, so it has no weights yet; give its "
                "input shape (keras.Input(shape=...) first, or model.build((None, ...)))"
            )
        self.__dict__["_keras"] = model
        self.layers = _holder(model)

    @property
    def keras_model(self) -> Any:
        """The Keras model itself."""
        return self.__dict__["_keras"]

    def __deepcopy__(self, memo: dict) -> KerasModule:
        """A copy whose module holds the parameters its Keras model reads: a tower's replica."""
        return KerasModule(_copy_model(self.keras_model, memo)).train(self.training)

    def check_dtype(self, dtype: str, asked: str) -> None:
        """One error where a layer of the model computes in another dtype than `dtype` (Keras
        casts to a layer's compute dtype, whatever its weights hold)."""
        others = sorted(
            {
                layer.compute_dtype
                for layer in [self.keras_model, *self.keras_model._flatten_layers()]
                if layer.compute_dtype != dtype
            }
        )
        if others:
            raise ModelError(
                f"{asked}, but the Keras model computes in {', '.join(others)}: build it in "
                f"{dtype} (keras.config.set_dtype_policy({dtype!r}) before building it, or dtype= "
                "on the model and each layer)"
            )

    def forward(self, x: Any) -> Any:
        return self.keras_model(x, training=self.training)

    def extra_repr(self) -> str:
        return f"keras {type(self.keras_model).__name__} {self.keras_model.name!r}"


def _copy_model(model: Any, memo: dict) -> Any:
    """A deep copy of a Keras model, made as Python copies any object: attribute by attribute, the
    functions it calls (a `Lambda`'s, with their globals and closures) shared. Keras's own copy
    saves the model and loads it again, which rebuilds a lambda from its bytecode without the names
    it reads and needs a model class of one's own registered with Keras. Every Keras object the
    model reaches gets an empty instance first, so that the copy fills it rather than asking Keras
    to pickle it; modules the model refers to (a seed generator's backend) are shared."""
    from keras.src.saving.keras_saveable import KerasSaveable

    found: list[Any] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (type, str, bytes, torch.Tensor)):
            continue
        seen.add(id(value))
        if isinstance(value, types.ModuleType):
            memo.setdefault(id(value), value)
            continue
        if isinstance(value, KerasSaveable) and id(value) not in memo:
            found.append(value)
            memo[id(value)] = object.__new__(type(value))
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, types.MethodType):
            stack.append(value.__self__)
        elif hasattr(value, "__dict__") and not isinstance(value, types.FunctionType):
            stack.append(vars(value))
    for value in found:
        vars(memo[id(value)]).update(copy.deepcopy(vars(value), memo))
    return memo[id(model)]


class _Layer(nn.Module):
    """One Keras layer's variables, and its layers', in the module tree."""


def _holder(layer: Any) -> nn.Module:
    held = _Layer()
    for variable in _own_variables(layer):
        held.register_parameter(_safe(variable.name), variable.value)
    for i, sub in enumerate(_sublayers(layer)):
        child = _holder(sub)
        if any(True for _ in child.parameters()):
            held.add_module(f"{_snake(type(sub).__name__)}_{i}", child)
    return held


def _own_variables(layer: Any) -> list[Any]:
    """The variables a layer tracks itself, not through its layers."""
    inner = {id(v) for sub in _sublayers(layer) for v in sub.variables}
    return [v for v in layer.variables if id(v) not in inner]


def _sublayers(layer: Any) -> list[Any]:
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _snake(name: str) -> str:
    from keras.src.utils.naming import to_snake_case

    return to_snake_case(name)


def _safe(name: str) -> str:
    return name.replace(".", "_").replace("/", "_") or "variable"


def record(module: nn.Module, run_dir: Path) -> None:
    """Where `module` is a Keras model, its description as Keras gives it (`to_json`: its layers
    and their settings, no weights) in the run directory, for `phalanx export` to rebuild it
    without the run's code. A model Keras cannot describe (a layer of Python objects) is only said:
    its export builds it with the run's code."""
    if not isinstance(module, KerasModule):
        return
    try:
        text = module.keras_model.to_json()
    except (NotImplementedError, TypeError, ValueError) as e:
        log.info(
            "Keras cannot describe the model (%s); exporting it to a Keras file will need --model",
            _first_line(e),
        )
        return
    write_text_atomic(run_dir / ARCHITECTURE, text)


def rebuilt(run_dir: Path, model_class: str) -> KerasModule:
    """The run's Keras model rebuilt from the description training saved of it (see `record`),
    untrained; Keras imports only its own modules and, in its safe mode, runs no code of the run's
    (a `Lambda`'s function, a layer class of one's own is an error). `model_class`: the run's
    `model.class`, for the error that says how to build it with the run's code instead."""
    keras = import_keras()
    fix = f"build it with the run's code instead: --model {model_class}"
    path = run_dir / ARCHITECTURE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PhalanxError(
            f"{run_dir} has no {ARCHITECTURE}, the description of a Keras model that training "
            f"saves: its model is not a Keras model (write a .safetensors file), or one that Keras "
            f"could not describe or that was trained before phalanx saved it; {fix}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PhalanxError(f"{path} is unreadable ({e}); {fix}") from None
    try:
        model = keras.models.model_from_json(text)
    except (TypeError, ValueError) as e:
        raise PhalanxError(
            f"Keras cannot rebuild the model of {run_dir} from {ARCHITECTURE} without running the "
            f"run's code ({_first_line(e)}); {fix}"
        ) from None
    return KerasModule(model)


def save(model: Any, path: Path) -> None:
    """The Keras model as Keras saves it, whole (`path` ending in `.keras`) or its weights
    (`.weights.h5`): written beside `path` under a temporary name and renamed, so that a failed
    write leaves no half-written file (and any earlier file as it was); a write the system refuses
    is one StorageError."""
    whole = path.name.endswith(".keras")
    # short, one per process, and ending as Keras asks the name to
    partial = path.with_name(f".phalanx-{os.getpid()}{'.keras' if whole else '.weights.h5'}")
    with writing(path, partial=partial, where="--output"):
        if whole:
            model.save(partial)
        else:
            model.save_weights(partial)
        os.replace(partial, path)


def _first_line(error: BaseException, limit: int = 200) -> str:
    """What went wrong, in one line: the first sentence of the error that came first (Keras wraps
    a layer's error in one that quotes the whole model's config)."""
    for _ in range(16):
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        error = inner
    text = " ".join(str(error).split()) or type(error).__name__
    sentence = text.split(". ", 1)[0]
    return sentence if len(sentence) <= limit else sentence[:limit] + "..."


def refuse(module: nn.Module, strategy: str, why: str) -> None:
    """One error where a strategy cannot train a Keras model (`why`: what it does that Keras does
    not follow)."""
    if isinstance(module, KerasModule):
        raise ModelError(
            f"parallel.strategy={strategy} cannot train a Keras model: {why}; use "
            "parallel.strategy=ddp (or towers, or one device)"
        )


def per_sample(loss_class: type, kwargs: dict[str, Any]) -> KerasLoss:
    """A Keras loss class as phalanx's losses are called (see `KerasLoss`)."""
    return KerasLoss(loss_class, kwargs)


class KerasLoss:
    """A Keras loss class as phalanx's losses are called, `f(prediction, target)`, giving one value
    per sample in the prediction's dtype (Keras's losses take the target first, reduce unless told
    not to, and compute in the dtype they were made with). Named as the Keras loss (`__name__`), so
    that an error about it says which loss."""

    def __init__(self, loss_class: type, kwargs: dict[str, Any]):
        self.loss_class, self.kwargs = loss_class, kwargs
        self.__name__ = loss_class.__name__
        self._made: dict[torch.dtype, Any] = {}

    def __call__(
        self, prediction: torch.Tensor, target: torch.Tensor, reduction: str = "none"
    ) -> torch.Tensor:
        loss = self._made.get(prediction.dtype)
        if loss is None:
            dtype = str(prediction.dtype).removeprefix("torch.")
            loss = self._made[prediction.dtype] = self.loss_class(
                reduction=None, dtype=dtype, **self.kwargs
            )
        return loss(target, prediction)

    def aligned(
        self, prediction: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and target as the loss compares them. Keras's losses of a function (its
        built-in ones: MeanSquaredError, ...) first match ranks that differ by one, a `(B, 1)`
        output against a `(B,)` target giving one value per sample; a loss class of its own
        compares them as they are."""
        from keras.src.losses.loss import squeeze_or_expand_to_same_rank
        from keras.src.losses.losses import LossFunctionWrapper

        if not issubclass(self.loss_class, LossFunctionWrapper):
            return prediction, target
        target, prediction = squeeze_or_expand_to_same_rank(target, prediction)
        return prediction, target
