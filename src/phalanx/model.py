"""Model protocol: `forward` takes the batch keys it names and returns a dict of named outputs.

`loss` (a per-sample vector, or the mean over the batch) is the objective; beside it, `loss_weight`
(per sample) makes the objective sum(w_i l_i) / sum(w_i) over the global batch. Plain modules,
which take tensors and return a tensor, work through the config alone: `inputs:` maps batch keys to
forward arguments, `outputs:` names what they return, and `loss:` names a torch.nn.functional loss.
A class-index loss (cross_entropy, nll_loss) on sequence outputs weighs every real token once: each
sample's loss is the mean over its tokens whose target is not `ignore_index`, weighted by their
count. Hugging Face models (`transformers`) whose batch holds `labels` have their per-token loss
computed here from `logits` (shifted by one for causal language models, as their own loss is),
since theirs is the mean over the micro-batch.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from phalanx import keras_models
from phalanx.config import LossConfig, ModelConfig
from phalanx.construct import build_value, import_object, instantiate
from phalanx.errors import ConfigError, ModelError, beyond_input, did_you_mean, named


def build_model(cfg: ModelConfig, search_dirs: Sequence[Path]) -> nn.Module:
    """The user's module, built from the `model` section."""
    kwargs = {k: build_value(v, f"model.{k}", search_dirs) for k, v in cfg.kwargs().items()}
    args = build_value(cfg.args, "model.args", search_dirs)
    module = instantiate(
        "model", import_object(cfg.class_, search_dirs, key="model.class"), *args, **kwargs
    )
    if keras_models.is_keras(module):
        return keras_models.KerasModule(module)
    if not isinstance(module, nn.Module):
        raise ModelError(
            f"model.class {cfg.class_!r} built a {type(module).__name__}, not a torch.nn.Module"
        )
    return module


class Forward:
    """Calls a module on a batch and returns its outputs as a dict holding a `loss`."""

    def __init__(
        self,
        module: nn.Module,
        cfg: ModelConfig,
        search_dirs: Sequence[Path] = (),
        inner: nn.Module | None = None,
        copies: bool = False,
    ):
        """`module` is called; `inner` (the user's module inside any wrapper) says what forward
        takes; `copies`: the module's tensor outputs are copied before anything reads them (a
        module replayed as CUDA graphs overwrites them at its next call, and the hooks keep some
        for the epoch)."""
        self.module, self.copies = module, copies
        self.inputs = cfg.inputs
        self.outputs = [cfg.outputs] if isinstance(cfg.outputs, str) else list(cfg.outputs)
        # the name of a lone tensor output
        self._single = self.outputs[0] if len(self.outputs) == 1 else None
        # names the config gave (not the default's, which a resolved config repeats), checked once
        # against a model that returns a dict
        self._named = self.outputs != [type(cfg).model_fields["outputs"].default]
        self.named_loss = _NamedLoss(cfg.loss, search_dirs) if cfg.loss else None
        user = inner if inner is not None else module
        self.params, self.takes_all = _forward_params(user)
        # a Hugging Face model: "causal" (its labels are the inputs, predicted one token ahead) or
        # "other"
        self.hugging_face = _hugging_face_kind(user) if cfg.loss is None else None
        # its own loss, the micro-batch's mean, is not computed: phalanx's replaces it
        if self.hugging_face:
            self.params.pop("labels", None)
            # its **kwargs are options of attention kernels, not the batch's other keys
            self.takes_all = False
        self._no_cache = bool(self.hugging_face) and "use_cache" in self.params
        if self.inputs is not None and not self.takes_all and not self.hugging_face:
            unknown = [arg for arg in self.inputs.values() if arg not in self.params]
            if unknown:
                raise ConfigError(
                    f"model.inputs gives {type(user).__name__}.forward "
                    f"{', '.join(map(repr, unknown))}, which it does not take; it takes "
                    f"{', '.join(self.params) or 'nothing by name'}"
                )
        self.output_names: list[str] = []
        # the common case, told once: inputs by name, one tensor out, the configured loss of it
        # (per sample where its shapes are plain: `_NamedLoss.plain`); the call then builds no
        # other dict nor Loss. Each layer of Python on the step costs a small model several
        # times its own time (BENCHMARKS.md, the step layer by layer).
        named, single = self.named_loss, self._single
        # the output's name where the plain path applies, else None
        self._plain: str | None = (
            single
            if named is not None
            and self.inputs is not None
            and single is not None
            and named.cfg.output == single
            and not named.lists
            and not copies
            else None
        )
        self._plain_names = list(dict.fromkeys([self._plain or "", "loss"]))

    def bound_to(self, module: nn.Module) -> Forward:
        """The same adapter calling another module of its class (a replica on another device)."""
        other = copy.copy(self)
        other.module, other.output_names = module, []
        return other

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        try:
            # the mapping is checked only when it fails: this runs every step
            arguments = (
                {arg: batch[key] for key, arg in self.inputs.items()}
                if self.inputs is not None
                else self._arguments(batch)
            )
        except KeyError:
            arguments = self._arguments(batch)
        # a Hugging Face model keeps no attention cache it would hand back with its outputs
        if self._no_cache:
            arguments["use_cache"] = False
        raw = self.module(**arguments)
        plain = self._plain
        if plain is not None and isinstance(raw, torch.Tensor):
            loss = self.named_loss.plain(raw, batch)  # type: ignore[union-attr]  # plain: it is set
            if loss is not None:
                self.output_names = self._plain_names
                return {plain: raw, "loss": loss}
        outputs = (
            {self._single: raw}
            if self._single is not None and isinstance(raw, torch.Tensor)
            else self._as_dict(raw)
        )
        if self.copies:
            outputs = {k: _copied(v) for k, v in outputs.items()}
        if self.named_loss is not None:
            _put(outputs, self.named_loss(outputs, batch))
        elif self.hugging_face and "labels" in batch and "logits" in outputs:
            _put(
                outputs,
                hugging_face_loss(
                    outputs["logits"], batch["labels"], self.hugging_face == "causal"
                ),
            )
        elif "loss" not in outputs:
            raise ModelError(
                f"the model returned outputs {sorted(outputs)} but no 'loss'; return "
                "{'loss': ...} from forward, or name one with model.loss: "
                "{function: cross_entropy, output: ..., target: ...}"
            )
        self.output_names = list(outputs)
        return outputs

    def _arguments(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.inputs is not None:
            missing = [k for k in self.inputs if k not in batch]
            if missing:
                raise ModelError(
                    f"model.inputs names batch keys {missing} that the batch lacks "
                    f"(it has {', '.join(batch)})"
                )
            return {arg: batch[key] for key, arg in self.inputs.items()}
        if self.takes_all:
            return dict(batch)
        missing = [n for n, required in self.params.items() if required and n not in batch]
        if missing:
            raise ModelError(
                f"{type(self.module).__name__}.forward needs {missing} but the batch has "
                f"{', '.join(batch)}; rename the dataset keys or map them with model.inputs"
            )
        return {n: batch[n] for n in self.params if n in batch}

    def _as_dict(self, raw: Any) -> dict[str, torch.Tensor]:
        if isinstance(raw, torch.Tensor) and len(self.outputs) == 1:
            return {self.outputs[0]: raw}
        if isinstance(raw, Mapping):
            if self._named:
                self._named = False
                _check_named(self.outputs, raw)
            return dict(raw)
        values = raw if isinstance(raw, (tuple, list)) else (raw,)
        if len(values) != len(self.outputs):
            raise ModelError(
                f"the model returned {len(values)} values but model.outputs names "
                f"{len(self.outputs)}: {self.outputs}"
            )
        return dict(zip(self.outputs, values, strict=True))


def _check_named(names: list[str], returned: Mapping) -> None:
    """The outputs model.outputs names are among those a model returns by name."""
    missing = [n for n in names if n not in returned]
    if missing:
        raise ModelError(
            f"model.outputs names {', '.join(map(repr, missing))}, which the model does not "
            f"return: its forward returns a dict of {', '.join(map(str, returned)) or 'nothing'}, "
            "named by the model itself; name those, or drop model.outputs"
        )


class Loss(NamedTuple):
    """A loss computed here: per sample, each sample's weight (None: all alike), and where the loss
    is over tokens, their losses in the autograd graph (`per_sample` is then detached: the objective
    is their sum over the global batch's real tokens, each token back-propagated with the same
    weight)."""

    per_sample: torch.Tensor
    weights: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


def per_sample_loss(
    function: Callable,
    prediction: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int | None,
    kwargs: dict[str, Any],
) -> Loss:
    """`function(prediction, target, reduction="none")` per sample. A class-index loss on sequences
    (several targets per sample, `ignore_index` set): each sample's mean over its real targets,
    their count as its weight, and the token losses to back-propagate (the function gives ignored
    targets a loss of zero, as torch's do). Class scores may come last (batch, tokens, classes), as
    language models give them, or second, as torch's losses take them."""
    if ignore_index is not None and target.dim() >= 2 and prediction.shape[:-1] == target.shape:
        # scores last (also where tokens = classes): a row per token, as the loss reads them fastest
        loss = function(
            prediction.flatten(0, -2), target.flatten(), reduction="none", **kwargs
        ).view(target.shape)
    else:
        if ignore_index is None and prediction.shape != target.shape:
            _check_broadcast(function, prediction, target)
        loss = function(prediction, target, reduction="none", **kwargs)
    if ignore_index is not None and target.dim() >= 2 and loss.shape == target.shape:
        counts = (target != ignore_index).flatten(1).sum(dim=1)
        summed = loss.detach().flatten(1).sum(dim=1)
        return Loss(summed / counts.clamp(min=1).to(summed.dtype), counts, loss.reshape(-1))
    if loss.dim() <= 1:
        return Loss(loss)
    return Loss(loss.flatten(1).mean(dim=1))  # every element counts alike


def _check_broadcast(function: Callable, prediction: torch.Tensor, target: torch.Tensor) -> None:
    """An element-wise loss whose output and target broadcast to a shape that is neither's, such as
    (B, 1) against (B,) making a (B, B) loss, would train on the wrong objective: an error. A Keras
    loss is checked on the shapes it compares, after its own matching of ranks."""
    if isinstance(function, keras_models.KerasLoss):
        prediction, target = function.aligned(prediction, target)
    wrong = _broadcast_error(
        getattr(function, "__name__", "the loss"), prediction.shape, target.shape
    )
    if wrong is not None:
        raise ModelError(wrong)


@functools.lru_cache(maxsize=256)
def _broadcast_error(name: str, prediction: torch.Size, target: torch.Size) -> str | None:
    """What is wrong with a loss `name` of these shapes (see `_check_broadcast`), or None: once per
    pair of shapes, which come back every step (a class-index loss's shapes differ, and finding
    that they do not broadcast costs torch an exception)."""
    p, t = tuple(prediction), tuple(target)
    try:
        both = tuple(torch.broadcast_shapes(p, t))
    except RuntimeError:
        return None  # the function says what is wrong itself
    if both == p or both == t:
        return None
    squeeze = (
        (
            " (for a single output, `.squeeze(-1)` it in forward, or give the model a final "
            "layer of that many outputs)"
        )
        if p[-1:] == (1,)
        else ""
    )
    return (
        f"model.loss: {name} compares an output of shape {list(p)} with a target of shape "
        f"{list(t)}, which broadcast to {list(both)}: every output against every target. Give "
        f"the output the target's shape{squeeze}"
    )


def hugging_face_loss(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> Loss:
    """A Hugging Face model's loss per sample from its logits: cross-entropy over the labels that
    are not -100 (shifted one token for a causal language model: the logits at t predict label t+1),
    or the mean squared error where the labels are real numbers (regression heads)."""
    import torch.nn.functional as F

    # one score per sample: regression; several: independent labels
    if labels.is_floating_point():
        if labels.dim() == 1:
            return per_sample_loss(F.mse_loss, logits.reshape(labels.shape), labels, None, {})
        return per_sample_loss(F.binary_cross_entropy_with_logits, logits, labels, None, {})
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return per_sample_loss(
        F.cross_entropy,
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
        labels,
        -100,
        {},
    )


# the output that carries a Loss's token losses to the engine (not to the hooks)
TOKENS = "_token_losses"


def _put(outputs: dict, loss: Loss) -> None:
    outputs["loss"] = loss.per_sample
    if loss.weights is not None:
        outputs["loss_weight"] = loss.weights
    if loss.tokens is not None:
        outputs[TOKENS] = loss.tokens


def _hugging_face_kind(module: nn.Module) -> str | None:
    """ "causal" for a Hugging Face causal language model, "other" for another of its models, None
    for any other module (told by class names, without importing transformers)."""
    names = [cls.__name__ for cls in type(module).__mro__]
    if "PreTrainedModel" not in names:
        return None
    name = names[0]
    return "causal" if name.endswith(("ForCausalLM", "LMHeadModel")) else "other"


def _ignore_index(function: Callable, kwargs: dict[str, Any]) -> int | None:
    """The target a class-index loss ignores (the keyword given, or the function's default)."""
    if "ignore_index" in kwargs:
        return kwargs["ignore_index"]
    try:
        parameter = inspect.signature(function).parameters.get("ignore_index")
    except (TypeError, ValueError):
        return None
    return (
        parameter.default if parameter is not None and isinstance(parameter.default, int) else None
    )


class _NamedLoss:
    """The `model.loss` section: a torch.nn.functional loss of one model output against one batch
    key."""

    def __init__(self, cfg: LossConfig, search_dirs: Sequence[Path]):
        self.cfg = cfg
        self.function = _loss_function(cfg, search_dirs)
        self.kwargs = cfg.kwargs()
        keras_loss = _keras_loss(self.function, self.kwargs)
        if keras_loss is not None:  # its keywords made it
            self.function, self.kwargs = keras_loss, {}
        else:
            _check_keywords(cfg.function, self.function, self.kwargs)
        self.ignore_index = _ignore_index(self.function, self.kwargs)
        # keywords given as lists become tensors beside each prediction
        self.lists = any(isinstance(v, list) for v in self.kwargs.values())
        self._placed: tuple[tuple, dict[str, Any]] | None = None  # see _kwargs

    def __call__(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> Loss:
        """The configured loss per sample (see `per_sample_loss`)."""
        cfg = self.cfg
        try:
            prediction, target = outputs[cfg.output], batch[cfg.target]
        except KeyError:
            if cfg.output not in outputs:
                raise ModelError(
                    f"model.loss.output {cfg.output!r} is not an output; outputs are "
                    f"{sorted(outputs)}"
                ) from None
            raise ModelError(
                f"model.loss.target {cfg.target!r} is not a batch key; keys are {', '.join(batch)}"
            ) from None
        kwargs = self._kwargs(prediction) if self.lists else self.kwargs
        try:
            return per_sample_loss(self.function, prediction, target, self.ignore_index, kwargs)
        except _REFUSALS as e:
            if beyond_input(e):
                raise
            raise self._refused(prediction, target, e) from e

    def plain(self, prediction: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The loss per sample where `per_sample_loss` would take its plainest branch: a target
        tensor of one class index per sample (a class-index loss), or of the prediction's shape (an
        element-wise loss); None, with nothing computed, for any other case, which `__call__`
        takes (and where the target is missing, says so). Not for keywords given as `lists`."""
        try:
            target = batch[self.cfg.target]
        except KeyError:
            return None
        if not isinstance(target, torch.Tensor):
            return None
        if self.ignore_index is not None:
            if target.dim() != 1:
                return None
        elif prediction.shape != target.shape:
            return None
        try:
            loss = self.function(prediction, target, reduction="none", **self.kwargs)
        except _REFUSALS as e:
            if beyond_input(e):
                raise
            raise self._refused(prediction, target, e) from e
        return loss if loss.dim() <= 1 else loss.flatten(1).mean(dim=1)

    def _refused(self, prediction: Any, target: Any, error: Exception) -> ModelError:
        """The loss function's refusal of a batch, as bad input: its call, with the shapes it was
        given, and what to check (--debug: the traceback)."""
        cfg = self.cfg
        keywords = "".join(f", {k}={v!r}" for k, v in cfg.kwargs().items())
        return ModelError(
            f"model.loss: {cfg.function}(output {cfg.output!r} {_described(prediction)}, target "
            f"{cfg.target!r} {_described(target)}{keywords}) failed: {named(error)}; check "
            "model.loss's function, output, target and keywords against what the model returns "
            "and the batch holds"
        )

    def _kwargs(self, prediction: torch.Tensor) -> dict[str, Any]:
        """The loss function's keywords; lists (pos_weight, weight) as tensors beside the
        prediction, made once for its device and dtype (a copy to a GPU waits for it)."""
        place = (prediction.device, prediction.dtype)
        if self._placed is None or self._placed[0] != place:
            kwargs = {
                k: torch.tensor(v, dtype=prediction.dtype, device=prediction.device)
                if isinstance(v, list)
                else v
                for k, v in self.kwargs.items()
            }
            self._placed = place, kwargs
        return self._placed[1]


def _check_keywords(name: str, function: Callable, kwargs: dict[str, Any]) -> None:
    """The keywords `model.loss` gives beside function, output and target are the function's
    own: one it does not take is refused before the first batch (where the signature says)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without one: the call decides
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    # the prediction and the target are given by position; the reduction is phalanx's
    takes = [
        n
        for n, p in list(params.items())[2:]
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "reduction"
    ]
    if "reduction" in kwargs:
        raise ConfigError(
            "model.loss: phalanx computes the loss per sample and takes the global batch's mean "
            "itself (the same on any device count); drop model.loss.reduction"
        )
    for key in kwargs:
        if key not in takes:
            raise ConfigError(
                f"model.loss: {name} takes no argument {key!r}{did_you_mean(key, takes)}; it "
                f"takes {', '.join(takes) or 'none'} beside the output and the target"
            )


# what a loss function raises for a batch it cannot take (shapes, dtypes, a keyword's value, a
# class index out of range)
_REFUSALS = (TypeError, ValueError, RuntimeError, IndexError)


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"of shape {list(value.shape)}, {str(value.dtype).removeprefix('torch.')}"
    return f"of type {type(value).__name__}"


def _loss_function(cfg: LossConfig, search_dirs: Sequence[Path]) -> Callable:
    function = import_object(
        cfg.function, search_dirs, default_module="torch.nn.functional", key="model.loss.function"
    )
    keras = sys.modules.get("keras")
    if isinstance(function, type) and not (keras is not None and issubclass(function, keras.Loss)):
        raise ConfigError(
            f"model.loss.function: {cfg.function} is a class, not a loss function; name a "
            "function of (output, target, reduction=...), such as cross_entropy or mse_loss "
            "(torch.nn.functional's), or compute the loss in the model's forward and return it as "
            "'loss'"
        )
    if not callable(function):
        raise ConfigError(
            f"model.loss.function: {cfg.function} is a {type(function).__name__}, not a function; "
            "name a loss function such as cross_entropy or mse_loss"
        )
    return function


def _keras_loss(function: Any, kwargs: dict[str, Any]) -> Callable | None:
    """A Keras loss class, made with `kwargs`, as a per-sample loss; None for anything else."""
    keras = sys.modules.get("keras")
    if keras is None or not (isinstance(function, type) and issubclass(function, keras.Loss)):
        return None
    return keras_models.per_sample(function, kwargs)


def _copied(value: Any) -> Any:
    """`value`'s tensors copied, in the tuples, lists and dicts that hold them."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_copied(v) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _forward_params(module: nn.Module) -> tuple[dict[str, bool], bool]:
    """Forward's named parameters (name -> required) and whether it takes **kwargs."""
    params = inspect.signature(module.forward).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {
        n: p.default is p.empty
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return named, takes_all


def loss_not_a_tensor(loss: Any) -> ModelError:
    return ModelError(
        f"the model's 'loss' is a {type(loss).__name__}, not a tensor; return the loss as a "
        "tensor (one value per sample, or their mean)"
    )


def check_loss(loss: torch.Tensor, n: int) -> torch.Tensor:
    """The loss of a shard of `n` samples as a scalar mean or one value per sample (a loss with
    more dimensions per sample is averaged over them)."""
    if loss.dim() == 0:
        return loss
    if loss.shape[0] != n:
        raise ModelError(
            f"'loss' has shape {tuple(loss.shape)}; return one value per sample ({n}) or a scalar "
            "mean"
        )
    return loss if loss.dim() == 1 else loss.reshape(n, -1).mean(dim=1)


def check_weights(weights: torch.Tensor, loss: torch.Tensor, n: int) -> None:
    """`loss_weight` holds one number per sample, and weighs a per-sample loss."""
    if weights.dim() != 1 or weights.shape[0] != n:
        raise ModelError(
            f"'loss_weight' has shape {tuple(weights.shape)}; return one weight per sample ({n}), "
            "such as each sample's count of real tokens"
        )
    if loss.dim() != 1:
        raise ModelError(
            "the model returns 'loss_weight' but its 'loss' is a scalar; return the loss per "
            "sample (reduction='none', averaged over each sample's tokens) beside its weight"
        )
    if weights.device.type == "cpu" and bool((weights < 0).any()):
        raise ModelError(NEGATIVE_WEIGHTS)


NEGATIVE_WEIGHTS = (
    "'loss_weight' holds negative weights; a weight is how much a sample counts (such as its "
    "count of real tokens): return weights of 0 or more"
)


def shard_loss_mean(loss: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of per-sample losses over a shard of `n` samples; a scalar loss is that mean already."""
    loss = check_loss(loss, n)
    return loss if loss.dim() == 0 else loss.mean()
