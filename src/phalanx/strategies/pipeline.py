"""`pipeline`: the model split by layers into stages, one process each, its micro-batches flowing
through them on `torch.distributed.pipelining`'s schedules; copies of the whole pipeline train on
shards of each global batch, as ddp's ranks do.

Where the model splits, and how each process keeps and runs its stages, is `cutting`'s. Every
stage runs the model's own forward on the micro-batch (each process has the data), as far as its
stage goes; the last stage goes on to the model's loss.

The contract, exactly. Each data-parallel shard of an accumulation window is padded to the
schedule's `microbatches` micro-batches of one size with rows of weight zero (the schedules fix
their buffers' shapes at the first step); the last stage's loss of a micro-batch is the contract's
sum over its real samples of w_i l_i / B (`Engine.weigh_scalar`), with the schedule's own scaling
of the gradients off, so that the gradients add up to the global batch's. The copies of each stage
add their gradients over the data-parallel group; the step's loss and stop flag are summed over
every process; the clipping norm spans every stage. The stages' state is `stage_state`'s.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from phalanx import keras_models, random
from phalanx.data import Micro
from phalanx.engine import TOKENS, concat, total_norm
from phalanx.errors import ConfigError, count
from phalanx.strategies import in_worker, schedules
from phalanx.strategies.base import Micros, ModelOptions, Outcome, prepare
from phalanx.strategies.cutting import Active, Split, balance, keep_stages, probe
from phalanx.strategies.distributed import ProcessGroup, sum_gradients
from phalanx.strategies.padding import Joined, Padding, chunks, pad, rows_of
from phalanx.strategies.registry import Family, register
from phalanx.strategies.schedules import SCHEDULES
from phalanx.strategies.stage_state import StageState
from phalanx.strategies.staging import (
    PipelineSettings,
    accumulation_setup,
    checked_settings,
    layout,
    plan_settings,
    unplanned,
)
from phalanx.strategies.syncbn import PerDeviceStatistics
from phalanx.strategies.tensor import Tensor, apply_tensor_plan, check_tensor_plan, describe_plan
from phalanx.strategies.windows import StepAgreements

# the stages' module (torch's pipelining, a second to import) is imported where a step needs it:
# every process registers this strategy, few run it

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from phalanx.config import Config
    from phalanx.engine import Engine


class Pipeline(StageState, ProcessGroup):
    runs_empty_shards = True  # every stage runs every micro-batch, padded, in step with the others

    def __init__(
        self,
        accelerator: str,
        settings: PipelineSettings,
        window: int,
        timeout_s: float | None = None,
        backend: str = "auto",
        tensor: Tensor | None = None,
        config_name: str = "pipeline",
    ):
        """`window`: the most samples of an accumulation window (a global batch, without
        accumulation); its copy's shard of one, cut into `settings.microbatches`, fixes the
        micro-batches' size for the whole run. `tensor`: each stage's Linear layers split over
        that many processes (the mesh strategy's pipeline x tensor). `config_name`: the
        strategy the config names (pipeline, or mesh), as errors name it."""
        super().__init__(accelerator, timeout_s, backend)
        self.settings, self.config_name = settings, config_name
        self.tensor = tensor or Tensor(1, {})
        per_process = settings.stages_per_process or 1
        self.stages, self.depth = layout(settings, self.world_size // self.tensor.degree)
        self.copies = self.world_size // (self.depth * self.tensor.degree)
        # a tensor group's processes are neighbours in rank (the innermost dimension, where the
        # fastest link is): rank = (copy x depth + position) x tensor + tensor rank
        flat, self.tensor_rank = divmod(self.rank, self.tensor.degree)
        self.position, copy = flat % self.depth, flat // self.depth
        if SCHEDULES[settings.schedule].in_v:  # in a V: process p holds stages p and 2P - 1 - p
            self.mine = [self.position, 2 * self.depth - 1 - self.position]
        else:  # looped: process p holds stages p, p + P, p + 2P ... (the interleaved schedules')
            self.mine = [self.position + j * self.depth for j in range(per_process)]
        self.data_rank, self.data_world_size = copy, self.copies
        self.is_first, self.is_last = 0 in self.mine, self.stages - 1 in self.mine
        shard = math.ceil(window / self.copies)  # the most samples of a window a copy takes
        self.rows = max(1, math.ceil(shard / settings.microbatches))  # per micro-batch
        # every process makes every group, in the same order; one copy's stages talk over the
        # default group (a second group of the same processes costs each of them its own
        # communication threads)
        self._pipe = dist.group.WORLD if self.copies == 1 else None
        self._dp = None
        self._tensor_mesh: DeviceMesh | None = None
        if self.tensor.degree > 1:
            self._pipe, self._dp, self._tensor_mesh = self._mesh_groups()
        for c in range(self.copies if self.copies > 1 and self.tensor.degree == 1 else 0):
            group = dist.new_group([c * self.depth + p for p in range(self.depth)])
            if c == copy:
                self._pipe = group
        for p in range(self.depth if self.tensor.degree == 1 else 0):
            group = dist.new_group([c * self.depth + p for c in range(self.copies)])
            if p == self.position:
                self._dp = group
        self._split: Split | None = None
        self._active = Active()
        self._captured = self._active.captured  # the last stage's outputs, one per micro-batch
        self._schedule: Any = None
        self._global_index: list[int] = []  # each trainable parameter's index in the whole model's
        self._trainable = 0  # trainable parameters of the whole model
        self._whole: dict[str, tuple[int, ...]] = {}  # the whole model's state: names and shapes
        # the whole model's, before it is split (see setup)
        self.whole_summary = ""
        self._meta_model: nn.Module | None = None  # the whole model on the meta device (setup)
        self.layout = ""  # the stages, copies and micro-batches, for the run's first line
        self.chosen = ""  # where split: auto cut, and why
        self._statistics: PerDeviceStatistics | None = None  # BatchNorm's warning, from setup
        # the steps' agreements on their loss and stop flag
        self._agreements = StepAgreements(self.device, settings.agree_every, self._send)
        self._samples: list[int] = []  # each row's sample in the schedule's step (-1: padding)
        self._unmerged: dict[str, bool] = {}  # the schedule's step's options (`_built`)
        self._padding = Padding(self.rows, settings.microbatches)  # a step's shard, padded

    def _mesh_groups(self) -> tuple[Any, Any, DeviceMesh]:
        """The groups of a pipeline with a tensor dimension, from one device mesh of copies x
        stages x tensor: a copy's stages (one tensor rank's), a stage's copies, and the stage's
        tensor group (a mesh, as tensor parallelism takes it)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            self.device.type,
            (self.copies, self.depth, self.tensor.degree),
            mesh_dim_names=("replicate", "pipeline", "tensor"),
        )
        return mesh["pipeline"].get_group(), mesh["replicate"].get_group(), mesh["tensor"]

    # --- building --------------------------------------------------------------------------

    def init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        keras_models.refuse(
            module,
            self.config_name,
            "it cuts the model at its submodules, and a Keras model's layers are not torch "
            "submodules",
        )
        if options.sample is None or options.adapter is None:
            raise RuntimeError("the pipeline strategy needs a sample batch and the model's adapter")
        tied: list[str] = []
        self.model = prepare(module, options, lambda whole: self._place(whole, options, tied))
        said = [t for t in self.gather(tied[0] if tied else None) if t]
        if said:
            raise ConfigError(said[0])
        self.layout = self._layout()
        return self.model, self.model

    def _place(self, whole: nn.Module, options: ModelOptions, tied: list[str]) -> nn.Module:
        """The whole model as it was built (on the host): split where the settings say (or where
        `balance` finds the stages even), this process's stages kept and moved to its device, their
        planned layers split over its tensor group. A tied weight that the split parts goes into
        `tied` (every process says it, after they compare)."""
        from phalanx import metrics

        assert options.adapter is not None  # setup checked
        # the whole model's shapes, before the split below removes other stages' modules and
        # makes the kept ones run one stage: what counting its FLOPs needs
        self._meta_model = metrics.on_meta(whole)
        batch = self._sample_batch(whole, options)
        names = self._split_names(whole, options.adapter, batch)
        self._split = probe(whole, options.adapter(whole), batch, names, self.stages)
        self.whole_summary = metrics.summary(whole)
        self._statistics = PerDeviceStatistics(
            whole,
            self.world_size,
            self.is_main,
            "",
            said="BatchNorm under the pipeline: the model's BatchNorm layers ({layers}) "
            f"normalise each micro-batch of {self.rows} samples with its own statistics (a "
            "short batch's padding rows included), so training differs from one device's; "
            "the pipeline has no synchronised BatchNorm: train such a model with ddp or "
            "fsdp, or use LayerNorm or GroupNorm",
        )
        plan = self._tensor_plan(whole, names)
        planned = {name: whole.get_submodule(name) for name in plan}
        self._keep_mine(whole, names, tied)
        whole = whole.to(self.device)
        if self._tensor_mesh is not None:
            # the planned layers this process's stages kept, split over its tensor group
            kept = {id(m) for m in whole.modules()}
            ours = {n: plan[n] for n, m in planned.items() if id(m) in kept}
            if ours:
                apply_tensor_plan(whole, self._tensor_mesh, ours)
        return whole

    def _sample_batch(self, whole: nn.Module, options: ModelOptions) -> dict[str, torch.Tensor]:
        """A sample batch of one micro-batch's rows where the model was built: the probe runs there
        (the host), and only this process's stages go to its device, so that a model too large for
        one device splits at all."""
        assert options.sample is not None  # setup checked
        here = next(whole.parameters(), torch.empty(0)).device
        batch = {k: v.to(here) for k, v in pad(options.sample(self.rows), self.rows).items()}
        if not options.precision.passes_through:
            batch = dict(options.precision.convert_batch(batch, here))
        self._padding.shapes = {k: v.shape[1:] for k, v in batch.items()}
        return batch

    def _split_names(self, whole: nn.Module, adapter: Any, batch: dict) -> list[str]:
        """Where the model splits: the settings' names, or those `balance` finds."""
        names = self.settings.split
        if names != "auto":
            return names
        names, times = balance(whole, adapter(whole), batch, self.stages, self._mean, self.device)
        self.chosen = (
            f"; split auto at {', '.join(names)} (blocks' forward and backward: "
            + ", ".join(f"{t:.2f}" for t in times)
            + " ms)"
        )
        return names

    def _tensor_plan(self, whole: nn.Module, names: list[str]) -> dict[str, str]:
        """The layers a tensor dimension splits, and how (none without one)."""
        if self._tensor_mesh is None:
            return {}
        split = self._split
        assert split is not None  # probed
        blocks = {f"{split.trunk}.{i}" if split.trunk else str(i) for i in range(split.size)}
        several = self.settings.schedule if len(self.mine) > 1 else None
        plan = check_tensor_plan(whole, self.tensor, names, blocks, several)
        self.chosen += "; " + describe_plan(whole, plan, self.tensor.degree)
        return plan

    def _keep_mine(self, whole: nn.Module, names: list[str], tied: list[str]) -> None:
        """This process's stages kept (the others' modules removed), and the whole model's state
        recorded (`StageState`); a tied weight that the split parts goes into `tied`."""
        split = self._split
        assert split is not None  # probed
        hooked = self._tensor_mesh is not None
        apart = self._keep_stages(
            whole,
            lambda m: keep_stages(
                m, split, self.mine, self.stages, self._active, self.device, hooked
            ),
        )
        if not list(whole.parameters()):
            raise ConfigError(
                f"pipeline stage {self.mine[0]} holds no parameters: move its split point "
                f"in parallel.pipeline.split ({names})"
            )
        if apart:
            tied.append(
                f"the pipeline strategy cannot split the model at {', '.join(names)}: "
                f"{apart[0]} (a tied weight), which another stage holds; untie them, split where "
                "one stage holds both, or train with ddp or fsdp"
            )

    def _layout(self) -> str:
        """The run's first line's account of the pipeline: its stages' sizes (from the first copy's
        first tensor rank; a DTensor counts its whole), copies and micro-batches."""
        counts = self.gather(sum(p.numel() for p in self.model.parameters()))
        counts = counts[:: self.tensor.degree][: self.depth]
        each = "" if len(self.mine) == 1 else f" ({len(self.mine)} stages each)"
        if self.tensor.degree > 1:
            each += f", each stage's planned layers split over {self.tensor.degree} processes"
        m = self.settings.microbatches
        return (
            f"the model in {self.stages} stages on {count(self.depth, 'process', 'es')}{each} "
            "holding "
            + ", ".join(f"{n:,}" for n in counts)
            + f" parameters, {'1 copy' if self.copies == 1 else f'{self.copies} copies'} of the "
            f"pipeline, {count(m, 'micro-batch', 'es')} of {self.rows} samples through it "
            f"({self.settings.schedule}){self.chosen}"
        )

    def describe(self) -> tuple[str, str]:
        return ("copy of the pipeline", self.layout) if self.layout else ("device", "")

    def model_summary(self) -> str | None:
        return self.whole_summary or None

    def whole_model(self) -> nn.Module:
        """The whole model before the split, on the meta device (see `Abilities.whole_model`)."""
        if self._meta_model is None:
            raise RuntimeError("the pipeline strategy has not set the model up yet")
        return self._meta_model

    def _built(self, engine: Engine) -> Any:
        """The stage and its schedule, made at the first step (the adapter is the engine's)."""
        if self._schedule is not None:
            return self._schedule
        from phalanx.strategies.stages import make_stages

        assert self._split is not None  # setup has run
        self._stage_modules, stages = make_stages(
            self.model,
            self._split,
            self.mine,
            self.stages,
            engine,
            self._active,
            self.progress.again,  # within the schedule's step (`_schedule_entered`)
            self._chunk_draws,
            self.rows,
            self.device,
            self._pipe,
        )
        name = self.settings.schedule
        kind = schedules.torch_class(name)
        given = stages if schedules.takes_stages(name) else stages[0]
        try:
            self._schedule = kind(
                given, self.settings.microbatches, loss_fn=self._loss, scale_grads=False
            )
        except ValueError as e:  # the schedule's own conditions on the micro-batch count
            raise ConfigError(
                f"parallel.pipeline.schedule={self.settings.schedule} with "
                f"{count(self.settings.microbatches, 'micro-batch', 'es')} on "
                f"{count(self.depth, 'process', 'es')}: {e}"
            ) from None
        # the last stage's outputs are the captured ones: the schedule need not merge its own
        taken = inspect.signature(kind.step).parameters
        self._unmerged = {"return_outputs": False} if "return_outputs" in taken else {}
        self._engine = engine
        return self._schedule

    # --- the step --------------------------------------------------------------------------

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        schedule = self._built(engine)
        if self._statistics is not None:
            self._statistics.warn_once()
        engine.begin()
        self._parts: list[torch.Tensor] = []
        parts: list[list[dict] | None] = []
        for micro, batch in micros:
            assert batch is not None  # an empty shard comes as a batch of zero samples
            self._global_size = micro.global_size
            self._captured.clear()
            padded, real = self._padding.pad(self._convert(engine, batch), len(micro.shard))
            self._active.chunks = chunks(padded, self.settings.microbatches)
            # each row's sample, for the draws of the chunks the schedule runs (padding: -1)
            self._samples = [*micro.shard, *[-1] * (len(real) - len(micro.shard))]
            before = self._schedule_entered()
            try:
                schedule.step(target=real, **self._unmerged)
            except RuntimeError as e:
                from phalanx.strategies.stages import stage_error

                inner = stage_error(e)
                if inner is e:
                    raise
                raise inner from None
            self._counts_evened(before, self.settings.microbatches)
            # a tensor group's last stages give the same outputs: its first process's count
            given = self.is_last and micro.shard and self.tensor_rank == 0
            parts.append(list(self._captured) if given else None)
        self._active.forget_batch()
        start = time.perf_counter()
        self._reduce_gradients()
        # a tensor group's loss, counted once
        agreed, window = self._agreements.step(stop, self._parts if self.tensor_rank == 0 else [])
        communication = time.perf_counter() - start
        start = time.perf_counter()
        if window is None:  # (loss part, weight sum, weighted, stop), summed
            weighted = self._agreements.weighted
            loss = engine.finish(agreed[:2] if weighted else agreed[0], self.gradient_norm)
            optimizer = time.perf_counter() - start
            return Outcome(loss, Joined(parts), bool(agreed[3] > 0), communication, optimizer)
        loss = engine.finish(agreed, self.gradient_norm)  # the step's loss, as its window sends it
        optimizer = time.perf_counter() - start
        return Outcome(
            loss,
            Joined(parts),
            self._agreements.stopped(),
            communication,
            optimizer,
            settle=window.settled,
            agreed=window.sent is not None,
        )

    def agree_when(self, due: Callable[[], bool] | None, drop: bool = False) -> None:
        """Gather the steps' agreements into windows of up to `settings.agree_every` steps
        (`StepAgreements.when`)."""
        self._agreements.when(due, drop)

    def end_epoch(self) -> None:
        """The epoch's last agreement checked on the host: on a GPU each other step's is checked
        when the next step takes its stop flag."""
        self._agreements.check()

    def _chunk_draws(self, chunk: int) -> random.Draws | None:
        """The random draws of the schedule's micro-batch `chunk` of the step: its rows' samples,
        whichever stage runs it (a padding row draws under a key of its own)."""
        return self._engine.draws(self._samples[chunk * self.rows : (chunk + 1) * self.rows])

    def _schedule_entered(self) -> int:
        """The schedule's step (or round) entered as one collective, its sends and receives
        counted within it (`count_transfer`); the count before it, for `_counts_evened`."""
        before = self.progress.entered
        self.progress.enter("the pipeline schedule")
        return before

    def _counts_evened(self, before: int, microbatches: int) -> None:
        """The schedule's step (or round) of `microbatches` run: this process's count made what
        the process with the most transfers counts (a first or last stage sends and receives half
        of what a middle one does), so that the counts of processes in the next step stay
        comparable."""
        # a stage k's transfers of one micro-batch count k and k + 1 (activations in and out),
        # S - 1 - k and S - k (gradients): 2 S at most
        most = 2 * self.stages * microbatches * len(self.mine)
        missing = before + 1 + most - self.progress.entered
        if missing > 0:
            self.progress.again(self.progress.what, missing)

    @staticmethod
    def _convert(engine: Engine, batch: Mapping) -> Mapping:
        """The batch as the engine gives it to the model (on the device, in the precision's
        dtype)."""
        precision = engine.precision
        return batch if precision.passes_through else precision.convert_batch(batch, None)

    def _loss(self, output: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The last stage's objective for one micro-batch: the contract's weights on its real rows
        (the first `n`), the padding out of the graph."""
        n = self._padding.counts[len(self._captured) - 1]  # `real`'s sum, known on the host
        data = self._captured[-1]
        tokens = data.pop(TOKENS, None)
        if n < self.rows:  # padding rows out
            if tokens is not None:
                tokens = tokens.reshape(self.rows, -1)[:n].reshape(-1)
            data = {
                k: v[:n] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in data.items()
            }
            self._captured[-1] = data
            output = output[:n]
        micro = Micro(list(range(n)), self._global_size)
        weighed = self._engine.weigh_scalar(output, data, micro, 1.0, tokens)
        self._parts.append(weighed.part)
        return weighed.loss

    def _reduce_gradients(self) -> None:
        """Each stage's copies add their gradients (the parts of their shards)."""
        if self.copies == 1:
            return
        self.progress.enter("the gradient all-reduce of a stage's copies")
        sum_gradients([p for p in self.model.parameters() if p.requires_grad], self._dp)

    def _send(self, values: torch.Tensor) -> dist.Work:
        """`values` summed over every process, in place, behind the caller."""
        self.progress.enter("the agreement on the step's loss")
        return dist.all_reduce(values, async_op=True)

    def _mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values`' mean over every process."""
        values = values.to(self.device, torch.float64)
        self.progress.enter("the averaging of the blocks' measured times")
        dist.all_reduce(values)
        return values.cpu() / self.world_size

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
        batch = self._convert(engine, batch)
        n = rows_of(batch)
        per_round = self.rows * self.settings.microbatches
        out: list[dict | None] = []
        self._global_size = max(n, 1)
        with torch.no_grad():
            for start in range(0, max(n, 1), per_round):
                part = {k: v[start : start + per_round] for k, v in batch.items()}
                padded, real = self._padding.pad(part, min(per_round, n - start))
                self._captured.clear()
                if SCHEDULES[self.settings.schedule].in_v:
                    before = self._schedule_entered()
                    self._evaluate_in_turn(padded, min(per_round, n - start))
                    self._counts_evened(before, 1)
                else:
                    self._active.chunks = chunks(padded, self.settings.microbatches)
                    before = self._schedule_entered()
                    schedule.eval(target=real)
                    self._counts_evened(before, self.settings.microbatches)
                out.extend(self._captured)
        self._active.forget_batch()
        return concat(out) if self.is_last and self.tensor_rank == 0 else {}

    def _evaluate_in_turn(self, padded: dict[str, torch.Tensor], n: int) -> None:
        """A V schedule's round, forward, each stage in turn (see `forward_in_turn`); the last
        stage's outputs, less the padding, go to `_captured`."""
        from phalanx.strategies.stages import forward_in_turn

        assert self._split is not None and self._pipe is not None  # set up; in a copy
        down = range(self.depth)  # a V's stages go down the copy's processes and back up
        ranks = [dist.get_global_rank(self._pipe, p) for p in (*down, *reversed(down))]
        forward_in_turn(
            self._stage_modules,
            ranks,
            self._split.shapes,
            padded,
            self._active,
            self._pipe,
            self.device,
            self.progress.enter,
        )
        if self.is_last:
            data = self._captured[-1]
            data.pop(TOKENS, None)
            self._captured[-1] = {
                k: v[:n] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in data.items()
            }

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        """The last stages' outputs (every copy's, in copy order: dataset order)."""
        return super().gather_outputs(parts if self.is_last else [None] * len(parts), keys)


# --- the strategy as the config names it ---------------------------------------------------


def build(cfg: Config, accelerator: str, devices: int) -> Pipeline:
    settings = checked_settings(cfg, accelerator)
    if not in_worker():
        per_process = settings.stages_per_process or 1
        stages = len(settings.split) + 1 if settings.split != "auto" else settings.stages
        processes = f"{stages // per_process} processes" if stages else "several processes"
        raise ConfigError(
            f"parallel.strategy=pipeline runs its stages in {processes}; set parallel.devices to "
            f"{stages // per_process if stages else 2} or a multiple (phalanx starts them), or "
            "start phalanx under torchrun"
        )
    # its stages and the schedule's micro-batches are checked as it is built, at the world's size
    return Pipeline(
        accelerator,
        settings,
        window=-(-cfg.dataset.batch_size // cfg.parallel.accumulation),
        timeout_s=cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
    )


def check(cfg: Config, accelerator: str, processes: int) -> None:
    layout(checked_settings(cfg, accelerator), processes)


register(
    Family(
        "pipeline",
        build,
        "the model split by layers into stages, one process each; micro-batches flow through",
        process_per_device=True,
        check=check,
        settings=PipelineSettings | None,
        field=Field(None, description="the pipeline strategy's (split is required)"),
        setups=schedules.setups,
        cost=schedules.price,
        unplanned=unplanned,
        label=schedules.label,
        readers=lambda setup: setup.devices // setup.stages,
        accumulation_setup=accumulation_setup,
        plan_settings=plan_settings,
    )
)
