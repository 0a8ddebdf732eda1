"""The contract's arithmetic for an optimizer step and an evaluation batch, written once: functions
that every strategy's step calls, however it runs its micro-batches.

Each rank scales the sum of its per-sample losses by 1/B_k, B_k the size of the whole global batch,
and the strategy's reduction sums: the reduced gradient is exactly that of the global batch's mean
loss, for uneven shards, short last batches and gradient accumulation alike.

Weighted losses (a model that returns `loss_weight` per sample beside `loss`, such as a language
model's count of real tokens) have the objective sum(w_i l_i) / sum(w_i) over the global batch. The
denominator is known only once every rank has run its micro-batches, so each sample's loss goes
back with w_i / B_k, and the step's sums (sum w_i l_i, sum w_i) travel with the strategy's loss
agreement (no collective of their own); after the reduction the gradients are multiplied once by
B_k / sum(w_i). Clipping (`max_grad_norm`) comes after that, on the global gradient.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from phalanx import random
from phalanx.data import Micro
from phalanx.errors import ConfigError, ModelError
from phalanx.model import (
    NEGATIVE_WEIGHTS,
    TOKENS,
    Forward,
    check_loss,
    check_weights,
    loss_not_a_tensor,
)
from phalanx.precision import Precision

log = logging.getLogger("phalanx")


WEIGHT = "loss_weight"  # the output that weighs each sample's loss


class Weighed(NamedTuple):
    """One micro-batch's forward, weighed by the contract (see `Engine.forward`)."""

    loss: torch.Tensor  # what backward starts from
    # its gradient (per sample), or None for a scalar
    gradient: torch.Tensor | None
    # the micro-batch's part of the global batch's mean loss (or weighted sums)
    part: torch.Tensor
    # the batch with the model's outputs, detached, for the hooks
    data: dict


@dataclass(frozen=True)
class Replica:
    """How a strategy runs one copy of the model: `call` (None: the model the engine was built
    with) on `device` (None: where the batch already is), and `scale`, the factor by which the
    strategy's gradient reduction divides (a reduction that averages over N copies: N), so that
    every copy's weights still sum to the global batch's."""

    call: Forward | None = None
    device: torch.device | None = None
    scale: float = 1.0


# the model the engine was built with, as it is
WHOLE = Replica()
_FULL_PRECISION = (torch.float32, torch.float64)
# a Weighed without the Python frame of its generated constructor
_weighed = tuple.__new__


class GradNorms:
    """The global gradient norm of each step of an epoch, before clipping: mean, max, and how many
    were not finite (those steps are skipped). The same on every rank. A norm left on its device
    (`add_later`) is read with the others still there, once, when any of these is read."""

    # what `variables` may hold, the epoch's `train` row of a run that clips
    NAMES = ("grad_norm", "grad_norm_max", "grad_norm_nonfinite")

    def __init__(self) -> None:
        self.sum, self.max, self.count, self.nonfinite = 0.0, 0.0, 0, 0
        self._last: float | None = None
        # norms on their device: the latest, one element each; before them, 64 a tensor
        self._pending: list[torch.Tensor] = []
        self._chunks: list[torch.Tensor] = []

    def add(self, norm: float, warn: bool = True) -> None:
        """A step's norm, read. The first that is not finite in an epoch is logged (`warn`)."""
        self._last = norm
        if not math.isfinite(norm):
            self.nonfinite += 1
            if warn and self.nonfinite == 1:
                log.warning(
                    "the gradient norm is not finite (%s) at step %d of the epoch: the step is "
                    "skipped; such steps are counted in the epoch's grad_norm_nonfinite",
                    norm,
                    self.count + self.nonfinite,
                )
            return
        self.sum, self.max, self.count = self.sum + norm, max(self.max, norm), self.count + 1

    def add_later(self, norm: torch.Tensor) -> None:
        """A step's norm, left where it is: read with the others when one is read."""
        pending = self._pending
        pending.append(norm.detach().reshape(1))
        if len(pending) >= 64:  # one tensor for 64 steps' norms, however long the epoch
            self._chunks.append(torch.cat(pending))
            pending.clear()

    def _settle(self) -> None:
        if self._pending or self._chunks:
            waiting = [*self._chunks, *self._pending]
            self._chunks, self._pending = [], []
            for norm in torch.cat(waiting).tolist():
                self.add(norm)

    @property
    def last(self) -> float | None:
        """The last step's norm (None before the first, and where nothing is clipped)."""
        self._settle()
        return self._last

    def variables(self) -> dict[str, float]:
        """What the epoch's `train` row holds."""
        self._settle()
        out: dict[str, float] = {"grad_norm_nonfinite": self.nonfinite}
        if self.count:
            out.update(grad_norm=self.sum / self.count, grad_norm_max=self.max)
        return out

    def reset(self) -> None:
        """A new epoch's norms."""
        self._settle()  # the last epoch's warning, if it has one to give
        self.__init__()  # type: ignore[misc]

    def state_dict(self) -> dict:
        self._settle()
        return {"sum": self.sum, "max": self.max, "count": self.count, "nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self._pending, self._chunks = [], []
        self.sum, self.max, self.count, self.nonfinite = (
            state["sum"],
            state["max"],
            state["count"],
            state["nonfinite"],
        )


class Engine:
    """The contract's arithmetic for one optimizer step, as functions a strategy calls from its
    `train_step`: `begin`, then each micro-batch's `forward` (or `weigh`, for a loss computed
    elsewhere) and `backward`, then `finish`. It knows nothing of how the strategy runs them."""

    def __init__(
        self,
        module: nn.Module,
        forward: Forward,
        optimizer: torch.optim.Optimizer | None,
        schedulers: list[tuple[Any, str]],
        precision: Precision,
        max_grad_norm: float | None = None,
        random_seed: int | None = None,
    ):
        self.module, self.forward_fn, self.optimizer = module, forward, optimizer
        # a forward's random draws are keyed by its samples, the seed and the step (`draws`);
        # None: torch's own generators
        self.random_seed = random_seed
        # steps done before the one running: set by the trainer
        self.step = 0
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.norms = GradNorms()
        self._schedulers = {
            interval: [s for s, i in schedulers if i == interval] for interval in ("step", "epoch")
        }
        # back-propagate a micro-batch's loss, with its per-sample gradient, and a scalar of the
        # strategy's own that must reach its reduction through autograd, unscaled: the precision's
        # `backward`, called every micro-batch, without a frame of the engine's
        self.backward = precision.backward
        self._gradients: dict[tuple, torch.Tensor] = {}
        # whether weights on an accelerator were negative: read at the epoch's end, not every
        # micro-batch (reading a device's value waits for it; on the CPU they are checked at once)
        self._negative: list[torch.Tensor] = []
        # whether the optimizer skips a clipped step on its device (`_clipped_step`), once known
        self._device_skips = False
        # a module replayed as CUDA graphs (`Forward.copies`) is told where each step starts: by
        # itself torch takes each forward after a backward for a new step, and frees the first
        # micro-batch's gradients (the backward graph's outputs, kept as `.grad`) at the second's
        self._marks_steps = forward.copies

    def begin(self) -> None:
        """A training step starts: the module in training mode, no gradients."""
        # walking the module tree every step costs more than the check
        if not self.module.training:
            self.module.train()
        optimizer = self.optimizer if self.optimizer is not None else self.trained_optimizer
        clear_gradients(optimizer)
        if self._marks_steps:
            torch.compiler.cudagraph_mark_step_begin()

    def finish(
        self, loss: torch.Tensor, norm: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The step's end, once the gradients are the global batch's: a weighted loss's pair of
        sums normalised (its gradients divided by the global sum of the weights), the gradients
        clipped to `max_grad_norm` by their global norm (`norm`: the strategy's, over every rank,
        shard or stage it splits them into), the optimizer's and the step's schedulers' steps.
        Returns the global batch's mean loss."""
        optimizer = self.optimizer if self.optimizer is not None else self.trained_optimizer
        # weighted: (sum w_i l_i, sum w_i) / B over the global batch
        if loss.dim():
            loss = self._normalise(loss)
        if self.max_grad_norm is None:
            self.precision.step(optimizer)
        else:
            self._clipped_step(optimizer, self.max_grad_norm, total_norm if norm is None else norm)
        self.step_schedulers()
        if len(self._negative) > 1:
            self._negative = [torch.stack(self._negative).any()]
        return loss

    def step_schedulers(self) -> None:
        """The schedulers that step every optimizer step: `finish` steps them; a strategy whose
        optimizer steps elsewhere (a parameter server's) steps them to keep this process's
        learning rates, and their saved state, in line with it."""
        try:
            for scheduler in self._schedulers["step"]:
                scheduler.step()
        except ValueError as e:  # a schedule shorter than the run (OneCycleLR's total_steps)
            raise _schedule_refused(scheduler, e) from e

    def forward(self, micro: Micro, batch: Mapping, replica: Replica = WHOLE) -> Weighed:
        """A micro-batch's forward through `replica`, weighed (`weigh`)."""
        seed = self.random_seed
        with random.drawing(None) if seed is None else random.Draws(seed, self.step, micro.shard):
            loss, data, tokens = self._forward(
                batch, len(micro.shard), replica.call, replica.device
            )
        return self.weigh(loss, data, micro, replica.scale, tokens)

    def draws(self, samples: Sequence[int] | torch.Tensor) -> random.Draws | None:
        """The random draws of a forward of `samples` (dataset indices; -1: padding) in the step
        that runs; None where draws are torch's own."""
        if self.random_seed is None:
            return None
        return random.Draws(self.random_seed, self.step, samples)

    def weigh(
        self,
        loss: torch.Tensor,
        data: dict,
        micro: Micro,
        scale: float = 1.0,
        tokens: torch.Tensor | None = None,
    ) -> Weighed:
        """The contract's weights for a micro-batch's `loss` (per sample, or the micro-batch's
        mean; `data` holds the batch and outputs, with `loss_weight` where the model weighs its
        samples): the loss to back-propagate and its gradient (per sample: each sample's weight,
        1/B times `scale`, B the global batch), the micro-batch's part of the global batch's mean
        loss (times `scale`), and `data`. Where the model weighs its samples, the part is the pair
        (sum w_i l_i, sum w_i) / B times `scale`, and each sample's gradient w_i / B times
        `scale`; `tokens`, a loss over tokens, then goes back token by token."""
        n = len(micro.shard)
        # (n / B) * shard mean = (1 / B) * shard sum: the shard's part of the global batch's mean,
        # times the factor by which the strategy's reduction divides
        weight = n / micro.global_size * scale
        weights = data.get(WEIGHT)
        if weights is not None:
            return self._weigh(loss, weights, scale / micro.global_size, data, tokens)
        # an empty shard that the strategy runs anyway (its collectives need every rank): weight 0
        if not n:
            return Weighed(loss.sum() * 0.0, None, loss.detach().new_zeros(()), data)
        # per-sample: weight / n flows back into each sample, no mean in the graph; the part is
        # the losses' dot product with that gradient (a reduction cheaper than mean's, every
        # step), or in half precision their mean (weight / n may be subnormal there)
        if loss.dim():
            gradient, losses = self._gradient(n, weight / n, loss), data["loss"]
            if losses.dtype in _FULL_PRECISION:
                part = torch.dot(losses, gradient)
            else:
                part = losses.mean() * weight
        else:
            part, gradient = loss.detach(), None
            if weight != 1:
                loss, part = loss * weight, part * weight
        return _weighed(Weighed, (loss, gradient, part, data))  # the common case, every step

    def weigh_scalar(
        self,
        loss: torch.Tensor,
        data: dict,
        micro: Micro,
        scale: float = 1.0,
        tokens: torch.Tensor | None = None,
    ) -> Weighed:
        """`weigh`, with the loss to back-propagate made one scalar (no gradient): for a schedule
        that calls backward() on the loss itself. Per sample, it is the losses' dot product with
        their gradient, which in full precision is also the part (the same numbers, once)."""
        n = len(micro.shard)
        if n and loss.dim() and loss.dtype in _FULL_PRECISION and WEIGHT not in data:
            weight = n / micro.global_size * scale  # as `weigh` has it, to the bit
            objective = torch.dot(loss, self._gradient(n, weight / n, loss))
            return _weighed(Weighed, (objective, None, objective.detach(), data))
        weighed = self.weigh(loss, data, micro, scale, tokens)
        if weighed.gradient is None:
            return weighed
        objective = torch.dot(weighed.loss.reshape(-1), weighed.gradient.reshape(-1))
        return Weighed(objective, None, weighed.part, weighed.data)

    def _weigh(
        self,
        loss: torch.Tensor,
        weights: torch.Tensor,
        factor: float,
        data: dict,
        tokens: torch.Tensor | None,
    ) -> Weighed:
        """A weighted micro-batch: each sample's loss goes back with w_i * factor, and its part is
        (sum w_i l_i, sum w_i) * factor (factor: the strategy's scale over the global batch). A loss
        over tokens goes back token by token, each with the factor: the same gradient, without the
        per-sample means in the graph."""
        # counts need the digits
        dtype = loss.dtype if loss.dtype in (torch.float32, torch.float64) else torch.float32
        weights = weights.to(dtype)
        if not len(weights):
            objective = tokens if tokens is not None else loss
            return Weighed(
                objective.sum() * 0.0, None, loss.detach().new_zeros(2, dtype=dtype), data
            )
        if tokens is not None:
            part = torch.stack((tokens.detach().to(dtype).sum(), weights.sum())) * factor
            return Weighed(tokens, self._gradient(tokens.numel(), factor, tokens), part, data)
        part = torch.stack((torch.dot(weights, data["loss"].to(dtype)), weights.sum())) * factor
        return Weighed(loss, (weights * factor).to(loss.dtype), part, data)

    @property
    def trained_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer; an engine built only to evaluate (`Trainer(inference=True)`) has none."""
        if self.optimizer is None:
            raise RuntimeError("this run was built only to evaluate: it has no optimizer to step")
        return self.optimizer

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.trained_optimizer.param_groups for p in group["params"]]

    def _normalise(self, sums: torch.Tensor) -> torch.Tensor:
        """The weighted step's mean loss, its gradients divided by the global sum of the weights (a
        batch without weight, all padding, keeps its zero gradients)."""
        inverse = torch.where(sums[1] > 0, 1.0 / sums[1], torch.zeros_like(sums[1]))
        grads = [p.grad for p in self._parameters() if p.grad is not None]
        if grads:
            _scale(grads, inverse)
        return sums[0] * inverse

    def _clipped_step(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_of: Callable[[list[torch.Tensor]], torch.Tensor],
    ) -> None:
        """The optimizer's step, the gradients scaled first so that their global norm (`norm_of`
        them: over every rank, shard or stage) is at most `max_norm`. A norm that is not finite
        skips the step, and is counted. An optimizer that skips itself by a flag on its device
        (`_skips_on_device`) is handed the flag there, as a gradient scaler hands it its own, and
        the norm stays on the device: nothing is read back."""
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        # clip_grads_with_norm_ skips those without a gradient
        parameters = self._parameters()
        norm = norm_of([p.grad for p in parameters if p.grad is not None])
        found_inf = None
        if scaler is None and self._on_device(optimizer):
            self.norms.add_later(norm)
            found_inf = torch.logical_not(torch.isfinite(norm)).to(torch.float32).reshape(())
        else:
            value = float(norm)
            # the scaler skips the step and lowers its scale: routine under fp16, not warned of
            self.norms.add(value, warn=scaler is None)
            if not math.isfinite(value):
                if scaler is not None:
                    self.precision.step(optimizer)
                return
        # one call per device mesh: a foreach over DTensors needs them on one mesh, and a model
        # parallelised over several dimensions holds parameters on several
        for group in _by_mesh(parameters):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        if found_inf is None:
            self.precision.step(optimizer)
            return
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]

    def _on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """`_skips_on_device`, kept once true (what makes it true stays: fused groups, state)."""
        if not self._device_skips:
            self._device_skips = _skips_on_device(optimizer)
        return self._device_skips

    def _gradient(self, n: int, value: float, like: torch.Tensor) -> torch.Tensor:
        """A vector of `n` times `value`: the gradient of the objective with respect to each
        sample's loss. Kept, since the same few shapes come back every step."""
        key = (n, value, like.dtype, like.device)
        gradient = self._gradients.get(key)
        if gradient is None:
            if len(self._gradients) > 64:
                self._gradients.clear()
            gradient = self._gradients[key] = torch.full(
                (n,), value, dtype=like.dtype, device=like.device
            )
        return gradient

    def eval_forward(self, batch: Mapping, replica: Replica = WHOLE) -> dict:
        """Outputs of the model (or of `replica`) on a batch, gradients off."""
        if self.module.training:
            self.module.eval()
        if self._marks_steps:  # each batch's outputs are copied: the next may overwrite them
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            _, data, _ = self._forward(batch, None, replica.call, replica.device)
        return data

    def end_epoch(self) -> None:
        self.refuse_negative_weights()
        try:
            for scheduler in self._schedulers["epoch"]:
                scheduler.step()
        except ValueError as e:
            raise _schedule_refused(scheduler, e) from e

    def refuse_negative_weights(self) -> None:
        """One error where a weight on an accelerator since the last check was negative. It reads
        the device: at an epoch's end, or where the caller reads it anyway."""
        if self._negative and bool(torch.stack(self._negative).any()):
            raise ModelError(NEGATIVE_WEIGHTS)
        self._negative.clear()

    def _forward(
        self,
        batch: Mapping,
        n: int | None,
        call: Forward | None = None,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """The model's loss, the batch with every output, detached, for the hooks (`loss` per
        sample), and the token losses to back-propagate where the loss was computed over tokens."""
        precision, call = self.precision, call or self.forward_fn
        if not precision.passes_through or device is not None:
            batch = precision.convert_batch(batch, device)
        n = n if n is not None else _first_dim(batch)
        if precision.autocast_dtype is None:
            outputs = call(batch)
        else:
            with precision.autocast():
                outputs = call(batch)
        loss = outputs["loss"]
        try:
            per_sample = loss.dim() == 1 and loss.shape[0] == n
        except AttributeError:  # not a tensor
            raise loss_not_a_tensor(loss) from None
        # not one value per sample: check and reduce it
        if not per_sample:
            loss = check_loss(loss, n)
        weights = outputs.get(WEIGHT)
        if weights is not None:
            check_weights(weights, loss, n)
            if weights.device.type != "cpu":
                self._negative.append((weights < 0).any())
        data, tokens = dict(batch), None
        for key, value in outputs.items():
            if key == "loss":
                data[key] = loss.detach() if loss.dim() else loss.detach().expand(n)
            elif key == TOKENS:
                tokens = value
            else:
                data[key] = value.detach() if isinstance(value, torch.Tensor) else value
        return loss, data, tokens

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.trained_optimizer.param_groups]


def clear_gradients(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.zero_grad(set_to_none=True)`: each parameter's gradient set to None, by the
    optimizer's own method only where it has one of its own, where torch has not yet wrapped
    its `step` (which torch's `zero_grad` does first: an optimizer that skipped
    `Optimizer.__init__`, as some wrappers do, runs its step hooks only then), or where this
    thread's profiler records (which names the call in its trace). torch's wraps the same loop in
    a profiler range that costs a small model's step about 70,000 instructions even where no
    profiler runs (BENCHMARKS.md)."""
    if (
        getattr(optimizer.zero_grad, "__func__", None) is not _ZERO_GRAD
        or not hasattr(optimizer, "_zero_grad_profile_name")
        or _profiling()
    ):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                parameter.grad = None


_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_profiling = torch.autograd._profiler_enabled


def _schedule_refused(scheduler: Any, error: ValueError) -> ConfigError:
    return ConfigError(
        f"scheduler: {type(scheduler).__name__} refused its step ({error}); a schedule of a fixed "
        "length must be as long as the run: give its length as auto (the run's), or a larger one, "
        "and resume"
    )


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips its own step where a flag on the device (`found_inf`) says so:
    torch's fused optimizers, as a gradient scaler drives them, every group fused. Not yet for a
    fused SGD with momentum that holds no momentum buffers: it makes them, uninitialised, before its
    kernel reads the flag, and would keep them from a skipped first step."""
    groups = optimizer.param_groups
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or not all(
        group.get("fused") for group in groups
    ):
        return False
    return bool(optimizer.state) or not any(group.get("momentum") for group in groups)


def total_norm(gradients: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all the gradients together; of sharded ones (DTensors), over every shard, and
    over every device mesh they lie on."""
    groups = _by_mesh(gradients)
    # a DTensor norm spans one mesh: the meshes' norms, then theirs
    if len(groups) > 1:
        return torch.linalg.vector_norm(torch.stack([total_norm(g) for g in groups]))
    norm = torch.nn.utils.get_total_norm(gradients, 2.0)
    # sharded gradients: the local parts' norm, made global
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by the device mesh of those that are DTensors (plain tensors: one
    group), in their order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def _scale(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply tensors in place by a 0-dim tensor, in one kernel where they allow it."""
    try:
        torch._foreach_mul_(tensors, factor)
    except (RuntimeError, TypeError, NotImplementedError):
        # sharded tensors of some versions: one by one
        for t in tensors:
            t.mul_(factor)


def _first_dim(batch: Mapping) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 1


def concat(parts: Sequence[dict | None]) -> dict:
    """Batch data joined along the batch dimension, in order; None parts (empty shards) skipped."""
    # one micro-batch: the common case, every step
    if len(parts) == 1:
        return parts[0] or {}
    present = [p for p in parts if p]
    if not present:
        return {}
    if len(present) == 1:
        return present[0]
    out: dict[str, Any] = {}
    for key in present[0]:
        values = [p[key] for p in present]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            out[key] = torch.cat(values)
        elif all(isinstance(v, list) for v in values):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = values[-1]
    return out
