"""`pipeline`: the model split by layers into stages, one process each, its micro-batches flowing
through them on `torch.distributed.pipelining`'s schedules; copies of the whole pipeline train on
shards of each global batch, as ddp's ranks do.

Where the model splits. `parallel.pipeline.split` names the modules where a new stage starts, all
children of one `nn.Sequential` or `nn.ModuleList` (the *trunk*) that the model's forward calls in
a chain, each child taking the previous one's output (split by module name, as torchtitan does:
torch's traced front end breaks on real models). Before the first step, one forward of the whole
model on a micro-batch of the first samples (evaluation mode, no gradients: nothing the model holds
moves) checks the chain, finds the activations' shapes at each cut, and sorts the modules outside
the trunk by when the forward calls them: those before the trunk belong to the first stage, those
after it to the last. Each process then keeps only its stage's modules; the others leave the module
tree, so its state dict holds the model's own names, the stage's part of them.

Every stage runs the model's own forward on the micro-batch (each process has the data): the first
stage stops where the next begins and sends the activation on; a later stage takes the activation
it received in place of its first module's input (the modules before it pass their input through,
those outside the trunk before it give zeros of their shape) and, on the last stage, goes on to the
model's loss.

The contract, exactly. Each data-parallel shard of an accumulation window is padded to the
schedule's `microbatches` micro-batches of one size with rows of weight zero (the schedules fix
their buffers' shapes at the first step); the last stage's loss of a micro-batch is the contract's
sum over its real samples of w_i l_i / B (`Engine.weigh`), with the schedule's own scaling of the
gradients off, so that the gradients add up to the global batch's. The copies of each stage add
their gradients over the data-parallel group; the step's loss and stop flag are summed over every
process; the clipping norm spans every stage.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from phalanx.data import Micro
from phalanx.engine import TOKENS, concat, total_norm
from phalanx.errors import CheckpointMismatch, ConfigError, ModelError
from phalanx.strategies.base import Micros, ModelOptions, Outcome, prepare
from phalanx.strategies.distributed import ProcessGroup

if TYPE_CHECKING:
    from phalanx.config import PipelineConfig
    from phalanx.engine import Engine
    from phalanx.precision import Precision

SCHEDULES = ("gpipe", "1f1b")


class _Cut(Exception):  # noqa: N818 - a signal, not an error: the stage's forward ends here
    def __init__(self, activation: torch.Tensor):
        self.activation = activation


@dataclass
class _Split:
    """Where the model splits, as the probe found it."""

    trunk: str  # the trunk's name in the model
    cuts: list[int]  # the trunk's child index where each stage after the first starts
    size: int  # the trunk's children
    before: list[str]  # modules outside the trunk that the forward calls before it: stage 0's
    after: list[str]  # and after it: the last stage's
    shapes: list[tuple[torch.Size, torch.dtype]]  # the activation at each cut
    zeros: dict[str, Any] = field(default_factory=dict)  # what each module before the trunk gives


class Pipeline(ProcessGroup):
    runs_empty_shards = True  # every stage runs every micro-batch, padded, in step with the others

    def __init__(
        self,
        accelerator: str,
        settings: PipelineConfig,
        shard_rows: int,
        timeout_s: float | None = None,
        backend: str = "auto",
    ):
        """`shard_rows`: the most samples one data-parallel copy takes of an accumulation window;
        with `settings.microbatches`, it fixes the micro-batches' size for the whole run."""
        super().__init__(accelerator, timeout_s, backend)
        self.settings = settings
        self.stages = len(settings.split) + 1
        per_process = settings.stages_per_process or 1
        if self.stages % per_process:
            raise ConfigError(
                f"parallel.pipeline.split makes {self.stages} stages, which cannot be shared out "
                f"{per_process} to a process (parallel.pipeline.stages_per_process); name "
                f"{per_process} x N - 1 split points"
            )
        self.depth = self.stages // per_process  # processes in one copy of the pipeline
        if self.world_size % self.depth:
            raise ConfigError(
                f"parallel.pipeline.split makes {self.stages} stages, {per_process} per process, "
                f"so {self.depth} processes a copy of the pipeline, but there are "
                f"{self.world_size} processes: set parallel.devices to a multiple of {self.depth}"
            )
        self.copies = self.world_size // self.depth
        self.position, copy = self.rank % self.depth, self.rank // self.depth
        # looped: process p holds stages p, p + depth, p + 2 depth ... (the interleaved schedules')
        self.mine = [self.position + j * self.depth for j in range(per_process)]
        self.data_rank, self.data_world_size = copy, self.copies
        self.is_first, self.is_last = 0 in self.mine, self.stages - 1 in self.mine
        self.rows = max(1, math.ceil(shard_rows / settings.microbatches))  # per micro-batch
        # every process makes every group, in the same order
        self._pipe = self._dp = None
        for c in range(self.copies):
            group = dist.new_group([c * self.depth + p for p in range(self.depth)])
            if c == copy:
                self._pipe = group
        for p in range(self.depth):
            group = dist.new_group([c * self.depth + p for c in range(self.copies)])
            if p == self.position:
                self._dp = group
        self._split: _Split | None = None
        self._active = _Active()
        self._captured = self._active.captured  # the last stage's outputs, one per micro-batch
        self._schedule: Any = None
        self._global_index: list[int] = []  # each trainable parameter's index in the whole model's
        self._trainable = 0  # trainable parameters of the whole model
        self._sample_shapes: dict[str, torch.Size] = {}
        self.model_summary = ""  # the whole model's, before it is split (see setup)
        self.layout = ""  # the stages, copies and micro-batches, for the run's first line

    # --- building --------------------------------------------------------------------------

    def init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        if options.sample is None or options.adapter is None:
            raise RuntimeError("the pipeline strategy needs a sample batch and the model's adapter")
        sample, adapter = options.sample, options.adapter

        def place(whole: nn.Module) -> nn.Module:
            whole = whole.to(self.device)
            batch = _padded(sample(self.rows), self.rows)
            if not options.precision.passes_through:
                batch = dict(options.precision.convert_batch(batch, None))
            self._sample_shapes = {k: v.shape[1:] for k, v in batch.items()}
            self._split = _probe(whole, adapter(whole), batch, self.settings.split, self.stages)
            from phalanx import metrics

            self.model_summary = metrics.summary(whole)
            names = [n for n, p in whole.named_parameters() if p.requires_grad]
            self._trainable = len(names)
            _keep_stages(whole, self._split, self.mine, self.stages, self._active)
            mine = [n for n, p in whole.named_parameters() if p.requires_grad]
            if not list(whole.parameters()):
                raise ConfigError(
                    f"pipeline stage {self.mine[0]} holds no parameters: move its split point "
                    f"in parallel.pipeline.split ({self.settings.split})"
                )
            index = {name: i for i, name in enumerate(names)}
            self._global_index = [index[n] for n in mine]
            return whole

        self.model = prepare(module, options, place)
        counts = self.gather(sum(p.numel() for p in self.model.parameters()))[: self.depth]
        each = "" if len(self.mine) == 1 else f" ({len(self.mine)} stages each)"
        self.layout = (
            f"the model in {self.stages} stages on {self.depth} processes{each} holding "
            + ", ".join(f"{n:,}" for n in counts)
            + f" parameters, {self.copies} cop{'ies' if self.copies > 1 else 'y'} of the pipeline, "
            f"{self.settings.microbatches} micro-batches of {self.rows} samples through it "
            f"({self.settings.schedule})"
        )
        return self.model, self.model

    def _built(self, engine: Engine) -> Any:
        """The stage and its schedule, made at the first step (the adapter is the engine's)."""
        if self._schedule is not None:
            return self._schedule
        from torch.distributed import pipelining

        split = self._split
        assert split is not None  # setup has run
        bounds = [0, *split.cuts, split.size]
        loss_dtype = next(p.dtype for p in self.model.parameters())

        def meta(k: int) -> torch.Tensor:
            shape, dtype = split.shapes[k]
            return torch.empty(
                shape, dtype=dtype, device=self.device, requires_grad=dtype.is_floating_point
            )

        stages = []
        for k in self.mine:
            last = k == self.stages - 1
            module = _Stage(
                self.model,
                _stage_parts(self.model, split, k, self.stages),
                (bounds[k], bounds[k + 1], k),
                engine.forward_fn,
                self._active,
                engine.precision,
            )
            if last:
                self._last_stage = module
            stages.append(
                pipelining.PipelineStage(
                    module,
                    k,
                    self.stages,
                    self.device,
                    input_args=() if k == 0 else meta(k - 1),
                    output_args=(
                        torch.empty(
                            self.rows, dtype=loss_dtype, device=self.device, requires_grad=True
                        )
                        if last
                        else meta(k)
                    ),
                    group=self._pipe,
                )
            )
        kind, given = {
            "gpipe": (pipelining.ScheduleGPipe, stages[0]),
            "1f1b": (pipelining.Schedule1F1B, stages[0]),
            "interleaved": (pipelining.ScheduleInterleaved1F1B, stages),
            "zero_bubble": (pipelining.ScheduleInterleavedZeroBubble, stages),
        }[self.settings.schedule]
        try:
            self._schedule = kind(
                given, self.settings.microbatches, loss_fn=self._loss, scale_grads=False
            )
        except ValueError as e:  # the schedule's own conditions on the micro-batch count
            raise ConfigError(
                f"parallel.pipeline.schedule={self.settings.schedule} with "
                f"{self.settings.microbatches} micro-batches on {self.depth} processes: {e}"
            ) from None
        self._engine = engine
        return self._schedule

    # --- the step --------------------------------------------------------------------------

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        schedule = self._built(engine)
        engine.begin()
        self._parts: list[torch.Tensor] = []
        self._weighted = False
        parts: list[dict | None] = []
        for micro, batch in micros:
            assert batch is not None  # an empty shard comes as a batch of zero samples
            self._global_size = micro.global_size
            self._captured.clear()
            padded, real = self._pad_step(self._converted(engine, batch), len(micro.shard))
            schedule.step(target=real, **padded)
            parts.append(concat(self._captured) if self.is_last and micro.shard else None)
        start = time.perf_counter()
        self._reduce_gradients()
        loss, stop = self._agree(stop)
        communication = time.perf_counter() - start
        start = time.perf_counter()
        loss = engine.finish(loss, self.gradient_norm)
        return Outcome(loss, parts, stop, communication, time.perf_counter() - start)

    def _pad_step(self, batch: Mapping, n: int) -> tuple[dict, torch.Tensor]:
        """The shard padded to the schedule's micro-batches, and each row's weight (1 real, 0
        padding)."""
        total = self.rows * self.settings.microbatches
        if n > total:
            raise RuntimeError(f"a shard of {n} samples does not fit {total} pipeline rows")
        padded = _padded(batch, total)
        for key, value in padded.items():
            if value.shape[1:] != self._sample_shapes.get(key, value.shape[1:]):
                raise ConfigError(
                    f"the pipeline strategy needs every batch's {key!r} in one shape beyond the "
                    f"batch dimension: the first was {tuple(self._sample_shapes[key])}, this one "
                    f"{tuple(value.shape[1:])}; pad the dataset's samples to one length"
                )
        real = torch.zeros(total, dtype=torch.float64, device=self.device)
        real[:n] = 1.0
        return {_KEY + k: v for k, v in padded.items()}, real

    @staticmethod
    def _converted(engine: Engine, batch: Mapping) -> Mapping:
        """The batch as the engine gives it to the model (on the device, in the precision's
        dtype)."""
        precision = engine.precision
        return batch if precision.passes_through else precision.convert_batch(batch, None)

    def _loss(self, output: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The last stage's objective for one micro-batch: the contract's weights on its real rows
        (the first `n`), the padding out of the graph."""
        n = int(real.sum())
        data = self._captured[-1]
        tokens = data.pop(TOKENS, None)
        if tokens is not None and n < self.rows:
            tokens = tokens.reshape(self.rows, -1)[:n].reshape(-1)
        data = {k: v[:n] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in data.items()}
        self._captured[-1] = data
        micro = Micro(list(range(n)), self._global_size)
        weighed = self._engine.weigh(output[:n], data, micro, 1.0, tokens)
        self._parts.append(weighed.part)
        self._weighted = self._weighted or weighed.part.dim() > 0
        if weighed.gradient is None:
            return weighed.loss
        return torch.dot(weighed.loss.reshape(-1), weighed.gradient.reshape(-1))

    def _reduce_gradients(self) -> None:
        """Each stage's copies add their gradients (the parts of their shards)."""
        if self.copies == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.progress.enter("the gradient all-reduce of a stage's copies")
        dist.all_reduce(flat, group=self._dp)
        offset = 0
        for p in params:
            summed = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.copy_(summed)

    def _agree(self, stop: bool) -> tuple[torch.Tensor, bool]:
        """The step's loss (its last stages' parts, summed over the copies) and whether any process
        asked to stop, the same on every process."""
        values = torch.zeros(4, dtype=torch.float64, device=self.device)
        if self._parts:
            total = torch.stack(self._parts).sum(0).to(torch.float64).reshape(-1)
            values[: len(total)] = total
            values[2] = float(self._weighted)
        values[3] = float(stop)
        self.progress.enter("the agreement on the step's loss")
        dist.all_reduce(values)
        weighted = bool(values[2] > 0)
        return (values[:2] if weighted else values[0]), bool(values[3] > 0)

    def gradient_norm(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm over every stage's gradients (a stage's copies hold the same)."""
        squared = total_norm(gradients).to(torch.float64) ** 2
        self.progress.enter("the gradient norm over the stages")
        dist.all_reduce(squared, group=self._pipe)
        return squared.sqrt()

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        """The shard's outputs, from the last stage (the others return none), in rounds of the
        schedule's micro-batches."""
        schedule = self._built(engine)
        if self.model.training:
            self.model.eval()
        batch = self._converted(engine, batch)
        n = _rows(batch)
        per_round = self.rows * self.settings.microbatches
        out: list[dict | None] = []
        self._global_size = max(n, 1)
        with torch.no_grad():
            for start in range(0, max(n, 1), per_round):
                part = {k: v[start : start + per_round] for k, v in batch.items()}
                padded, real = self._pad_step(part, min(per_round, n - start))
                self._captured.clear()
                schedule.eval(target=real, **padded)
                out.extend(self._captured)
        return concat(out) if self.is_last else {}

    # --- state ---------------------------------------------------------------------------

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state on the main process, each stage's part gathered from the first
        copy of the pipeline."""
        mine = (
            {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            if self.data_rank == 0
            else None
        )
        self.progress.enter("the gathering of the stages' states")
        parts = self.gather(mine)
        if not self.is_main:
            return {}
        whole: dict[str, torch.Tensor] = {}
        for part in parts:
            whole.update(part or {})
        return whole

    def load_model_state(self, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        from safetensors.torch import load_file

        from phalanx.checkpoint import SHARDS
        from phalanx.shards import load_shards

        if path.name == SHARDS:  # each process reads its stage's part
            load_shards(path, self.model, optimizer)
            return
        whole = load_file(str(path))
        wanted = self.model.state_dict()
        missing = sorted(set(wanted) - set(whole))
        if missing:
            raise CheckpointMismatch(
                f"{path} lacks {len(missing)} tensors of pipeline stages {self.mine}, such as "
                f"{missing[:3]}: it holds another model"
            )
        try:
            self.model.load_state_dict({k: whole[k] for k in wanted}, strict=True)
        except RuntimeError as e:
            raise CheckpointMismatch(f"{path} does not fit stages {self.mine}: {e}") from None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer's state, parameters numbered as in the whole model, on the main
        process."""
        state = optimizer.state_dict()
        mine = None
        if self.data_rank == 0:
            mine = {
                "state": {
                    self._global_index[i]: tree_map(_to_cpu, s) for i, s in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
        self.progress.enter("the gathering of the stages' optimizer states")
        parts = self.gather(mine)
        if not self.is_main:
            return {}
        merged: dict[int, Any] = {}
        for part in parts:
            if part:
                merged.update(part["state"])
        groups = [dict(g, params=list(range(self._trainable))) for g in state["param_groups"]]
        if len(groups) != 1:
            raise ConfigError("the pipeline strategy saves optimizers of one parameter group")
        return {"state": merged, "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        local = {g: i for i, g in enumerate(self._global_index)}
        mine = {
            "state": {local[int(g)]: s for g, s in state["state"].items() if int(g) in local},
            "param_groups": [
                dict(group, params=list(range(len(self._global_index))))
                for group in state["param_groups"]
            ],
        }
        optimizer.load_state_dict(mine)

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        """The last stages' outputs (every copy's, in copy order: dataset order)."""
        return super().gather_outputs(parts if self.is_last else [None] * len(parts), keys)


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _rows(batch: Mapping) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    return 0


def _padded(batch: Mapping, rows: int) -> dict[str, torch.Tensor]:
    """Each of the batch's tensors with rows of zeros added up to `rows`."""
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or not value.dim():
            raise ConfigError(
                f"the pipeline strategy sends tensors through its stages, but the batch's {key!r} "
                f"is a {type(value).__name__}; give the model tensors only"
            )
        n = value.shape[0]
        if n < rows:
            value = torch.cat((value, value.new_zeros((rows - n, *value.shape[1:]))))
        out[key] = value
    return out


# --- the stages ---------------------------------------------------------------------------


@dataclass
class _Active:
    """What the model's forward does in this process now: the stage that runs (see the module's
    docstring)."""

    lo: int = 0  # the trunk's first child of the stage
    hi: int = 0  # the first child of the next stage (the trunk's size on the last stage)
    stage: int = 0
    received: torch.Tensor | None = None  # the activation from the previous stage
    captured: list[dict] = field(default_factory=list)  # the last stage's outputs


_KEY = "batch_"  # before each batch key passed to the schedule: none may be its own argument


class _Stage(nn.Module):
    """One stage as `PipelineStage` runs it: the model's forward, as far as the stage goes. Its
    parameters are its own modules' (a process's stages share one model)."""

    def __init__(
        self,
        model: nn.Module,
        parts: list[nn.Module],
        span: tuple[int, int, int],
        call: Callable,
        active: _Active,
        precision: Precision,
    ):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._span, self._call, self._active, self._precision = span, call, active, precision

    def forward(self, *received: torch.Tensor, **keyed: torch.Tensor) -> torch.Tensor:
        batch = {key[len(_KEY) :]: value for key, value in keyed.items()}
        active = self._active
        active.lo, active.hi, active.stage = self._span
        active.received = received[0] if received else None
        try:
            with self._precision.autocast():
                outputs = self._call(batch)
        except _Cut as cut:
            return cut.activation
        finally:
            active.received = None
        loss = outputs["loss"]
        rows = _rows(batch)
        if loss.dim() != 1 or loss.shape[0] != rows:
            raise ModelError(
                "the pipeline strategy needs the model's loss per sample (a vector of the batch's "
                f"size, {rows}), but it returned one of shape {tuple(loss.shape)}; return the "
                "loss with reduction='none', or name one with model.loss"
            )
        data: dict[str, Any] = dict(batch)
        for key, value in outputs.items():
            if key == TOKENS:
                data[key] = value
            else:
                data[key] = value.detach() if isinstance(value, torch.Tensor) else value
        active.captured.append(data)
        return loss


def _stage_parts(model: nn.Module, split: _Split, stage: int, stages: int) -> list[nn.Module]:
    """Stage `stage`'s modules: its blocks, and those around the trunk on the first and last."""
    bounds = [0, *split.cuts, split.size]
    trunk = model.get_submodule(split.trunk) if split.trunk else model
    parts = [trunk.get_submodule(str(i)) for i in range(bounds[stage], bounds[stage + 1])]
    if stage == 0:
        parts += [model.get_submodule(name) for name in split.before]
    if stage == stages - 1:
        parts += [model.get_submodule(name) for name in split.after]
    return parts


def _probe(
    model: nn.Module, call: Callable, batch: Mapping, names: list[str], stages: int
) -> _Split:
    """One forward of the whole model (evaluation mode, no gradients) that finds where it splits."""
    trunk_name, cuts, trunk = _trunk(model, names)
    children = list(trunk.children())
    order: list[tuple[str, Any]] = []  # (what, detail) in call order
    inputs: dict[int, Any] = {}
    outputs: dict[int, Any] = {}
    units = _units(model, trunk)
    zeros: dict[str, Any] = {}
    hooks = []
    for i, child in enumerate(children):

        def pre(module: nn.Module, args: tuple, i: int = i) -> None:
            order.append(("trunk", i))
            inputs.setdefault(i, args[0] if args else None)

        def post(module: nn.Module, args: tuple, out: Any, i: int = i) -> None:
            outputs.setdefault(i, out)

        hooks.append(child.register_forward_pre_hook(pre))
        hooks.append(child.register_forward_hook(post))
    for name, unit in units.items():

        def unit_pre(module: nn.Module, args: tuple, name: str = name) -> None:
            order.append(("unit", name))

        def unit_post(module: nn.Module, args: tuple, out: Any, name: str = name) -> None:
            zeros.setdefault(name, tree_map(_meta_of, out))

        hooks.append(unit.register_forward_pre_hook(unit_pre))
        hooks.append(unit.register_forward_hook(unit_post))
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            call(batch)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    valid = _valid_cuts(trunk_name, children, inputs, outputs)
    for name, i in zip(names, cuts, strict=True):
        if i not in valid:
            raise ConfigError(
                f"parallel.pipeline.split names {name}, but the model does not pass one tensor "
                f"from {trunk_name}.{i - 1} to it; valid split points: "
                f"{', '.join(f'{trunk_name}.{j}' for j in sorted(valid)) or 'none'}"
            )
    calls = [i for what, i in order if what == "trunk"]
    if sorted(calls) != list(range(len(children))):
        raise ConfigError(
            f"the pipeline strategy needs the model's forward to call each of {trunk_name}'s "
            f"{len(children)} children once, in order; it called {calls}"
        )
    first, last = order.index(("trunk", 0)), order.index(("trunk", len(children) - 1))
    before: list[str] = []
    after: list[str] = []
    for name in units:
        at = [k for k, entry in enumerate(order) if entry == ("unit", name)]
        if any(first < k < last for k in at) or (
            any(k < first for k in at) and any(k > last for k in at)
        ):
            raise ConfigError(
                f"the pipeline strategy cannot place {name}: the model's forward calls it inside "
                f"or on both sides of {trunk_name}, which the stages split (a shared or tied "
                "module); untie it, or move it into each block"
            )
        (after if at and at[0] > last else before).append(name)
    shapes = [(inputs[i].shape, inputs[i].dtype) for i in cuts]
    return _Split(trunk_name, cuts, len(children), before, after, shapes, zeros)


def _trunk(model: nn.Module, names: list[str]) -> tuple[str, list[int], nn.Module]:
    parents = set()
    cuts = []
    for name in names:
        parent, _, child = name.rpartition(".")
        try:
            container = model.get_submodule(parent) if parent else model
        except AttributeError:
            container = None
        if not isinstance(container, (nn.Sequential, nn.ModuleList)) or not child.isdigit():
            raise ConfigError(
                f"parallel.pipeline.split names {name!r}, which is not a block of an nn.Sequential "
                f"or nn.ModuleList of the model; split points are such blocks: "
                f"{', '.join(_candidates(model)) or 'the model has none'}"
            )
        parents.add(parent)
        cuts.append(int(child))
    if len(parents) != 1:
        raise ConfigError(
            f"parallel.pipeline.split names blocks of several modules ({sorted(parents)}); the "
            "split points must all be blocks of one"
        )
    (parent,) = parents
    trunk = model.get_submodule(parent) if parent else model
    size = len(list(trunk.children()))
    if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= size:
        raise ConfigError(
            f"parallel.pipeline.split {names}: give blocks of {parent or 'the model'} in order, "
            f"each once, from {parent}.1 to {parent}.{size - 1}"
        )
    return parent, cuts, trunk


def _candidates(model: nn.Module) -> list[str]:
    out: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) > 1:
            out.extend(f"{name}.{i}" if name else str(i) for i in range(1, len(module)))
    return out[:12]


def _units(model: nn.Module, trunk: nn.Module) -> dict[str, nn.Module]:
    """The modules outside the trunk, each whole: the children of the trunk's ancestors. State the
    ancestors hold themselves cannot be placed: an error."""
    units: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str) -> bool:
        """Whether `module` is the trunk or holds it."""
        if module is trunk:
            return True
        holds = False
        found = {}
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if walk(child, full + "."):
                holds = True
            else:
                found[full] = child
        if holds:
            own = [n for n, _ in module.named_parameters(recurse=False)] + [
                n for n, _ in module.named_buffers(recurse=False)
            ]
            if own:
                raise ConfigError(
                    f"the pipeline strategy places modules on stages, but {prefix or 'the model '}"
                    f"holds {own} itself; move them into a module of their own"
                )
            units.update({n: c for n, c in found.items() if _holds_state(c)})
        return holds

    walk(model, "")
    return units


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _valid_cuts(
    trunk_name: str, children: list[nn.Module], inputs: dict, outputs: dict
) -> set[int]:
    """The children whose input is the previous child's output, one tensor: where stages may
    start."""
    valid = set()
    for i in range(1, len(children)):
        given, made = inputs.get(i), outputs.get(i - 1)
        if isinstance(given, torch.Tensor) and given is made:
            valid.add(i)
    return valid


def _meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    return value


def _zeros_like_meta(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], torch.Size):
        return torch.zeros(value[0], dtype=value[1], device=value[2])
    return value


def _keep_stages(
    model: nn.Module, split: _Split, mine: list[int], stages: int, active: _Active
) -> None:
    """Remove every module that is not one of stages `mine`'s. The trunk's blocks run only in the
    running stage's range and pass through before it (`active` holds the range and the activation
    received); the modules before the trunk give zeros of their outputs on later stages."""
    bounds = [0, *split.cuts, split.size]
    trunk = model.get_submodule(split.trunk) if split.trunk else model
    kept = {i for k in mine for i in range(bounds[k], bounds[k + 1])}
    for i in range(split.size):
        child = trunk.get_submodule(str(i)) if i in kept else _Passing()
        _run_in_range(child, i, active)
        if i not in kept:
            _replace(trunk, str(i), child)
    for name in split.before:
        if 0 in mine:
            _zeros_after_the_first(model.get_submodule(name), split.zeros.get(name), active)
        else:
            _replace_path(model, name, _Zeros(split.zeros.get(name)))
    for name in split.after:
        if stages - 1 not in mine:
            _replace_path(model, name, _Unreached(name))


def _zeros_after_the_first(module: nn.Module, meta: Any, active: _Active) -> None:
    """A module before the trunk, in the process that also runs later stages: zeros there."""
    forward = module.forward

    def first_only(*args: Any, **kwargs: Any) -> Any:
        if active.stage:
            return tree_map(_zeros_like_meta, meta, is_leaf=_is_meta)
        return forward(*args, **kwargs)

    module.forward = first_only  # type: ignore[method-assign]  # on the instance: state names stay


def _run_in_range(child: nn.Module, i: int, active: _Active) -> None:
    """Child `i` of the trunk: before the stage it passes its input through, at the stage's first
    child the input becomes the activation received, and the next stage's first child ends the
    stage's forward with its input."""
    forward = child.forward

    def ranged(*args: Any, **kwargs: Any) -> Any:
        if i < active.lo:
            return args[0]
        if i == active.hi:
            raise _Cut(args[0])
        if i == active.lo and active.received is not None:
            args = (active.received, *args[1:])
        return forward(*args, **kwargs)

    child.forward = ranged  # type: ignore[method-assign]  # on the instance: state names stay


def _replace(parent: nn.Module, name: str, module: nn.Module) -> None:
    setattr(parent, name, module)


def _replace_path(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    _replace(model.get_submodule(parent) if parent else model, name, module)


class _Passing(nn.Module):
    """A block of another stage: it holds nothing (its forward is `_run_in_range`'s)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a block of another pipeline stage was called outside its range")


class _Zeros(nn.Module):
    """A module the first stage runs, seen from a later one: zeros of what it gives."""

    def __init__(self, meta: Any):
        super().__init__()
        self.meta = meta

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return tree_map(_zeros_like_meta, self.meta, is_leaf=_is_meta)


def _is_meta(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], torch.Size)


class _Unreached(nn.Module):
    """A module of the last stage, seen from an earlier one, whose forward stops before it."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} belongs to the last pipeline stage; it ran on another")
