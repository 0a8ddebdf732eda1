"""`mesh`: one process per device, the processes laid out on a device mesh of three named
dimensions, data replicate x data shard x tensor (`init_device_mesh`), and the model parallelised
over it in one ordered function (`parallelize`), as torchtitan's `parallelize` does: the tensor
plan first (`parallelize_module` with `ColwiseParallel` / `RowwiseParallel` on the tensor
dimension), then `fully_shard` over the data dimensions (HSDP where replicate > 1).

The contract's arithmetic is fsdp's (this strategy is fsdp's, with a tensor dimension added):
gradients add over the data dimensions, the objective carries 1/B. The processes of one tensor
group (the same replicate and shard coordinates) train on the SAME shard of each micro-batch: the
data rank and world size come from the data dimensions alone. Only the tensor group's first
process counts that shard's loss in the ranks' agreement and gives its outputs to the hooks (the
others' hooks see them as an empty shard's), so nothing is counted twice. The gradient norm for
clipping is over the whole model (the engine's: DTensor norms, made global mesh by mesh).

A mesh of one shape is one of the named strategies, run as that strategy is (`build`): replicate
alone is `ddp`; replicate x pipeline (x tensor) is the `pipeline` strategy, each stage's planned
layers split over its tensor group (`pipeline.Tensor`), its settings in `parallel.pipeline`;
shard alone is `fsdp`'s sharding.

Checkpoints are fsdp's: the logical, whole-model format (full state dicts gathered to the main
process, or torch.distributed.checkpoint's shards), so a run saved on one mesh resumes on any
other strategy and process count.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from pydantic import Field, StrictInt
from torch import nn

from phalanx import environment
from phalanx.errors import ConfigError
from phalanx.settings import StrategySettings
from phalanx.strategies import ddp, in_worker, mesh_pricing, refuse_outside_workers
from phalanx.strategies.ddp import DDP
from phalanx.strategies.distributed import agreement
from phalanx.strategies.fsdp import FSDP, FSDPSettings, find_shard_units, shard_policies
from phalanx.strategies.pipeline import Pipeline
from phalanx.strategies.registry import PRECISION, Family, refuse, register
from phalanx.strategies.staging import checked_settings
from phalanx.strategies.staging import layout as pipeline_layout
from phalanx.strategies.tensor import (
    Tensor,
    apply_tensor_plan,
    describe_plan,
    no_plan,
    resolve_plan,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from phalanx.config import Config
    from phalanx.engine import Engine
    from phalanx.strategies.base import Micros, Outcome

DIMS = ("replicate", "shard", "tensor")


class Mesh(FSDP):
    """fsdp's strategy on a replicate x shard x tensor mesh; `layout` holds its degrees and plan."""

    config_name = "mesh"

    def __init__(
        self,
        accelerator: str,
        options: MeshSettings,
        timeout_s: float | None = None,
        backend: str = "auto",
        sharding: FSDPSettings | None = None,
    ):
        """`sharding`: `parallel.fsdp`, for the data dimensions' `fully_shard` (its units, dtypes
        and offload)."""
        super().__init__(accelerator, sharding or FSDPSettings(), timeout_s, backend)
        self.layout = options
        self.mesh = _device_mesh(self.device.type, options, self.world_size)
        replicate, shard = self.mesh["replicate"], self.mesh["shard"]
        # the data dimensions alone: a tensor group's processes share one shard of each batch
        self.tensor_rank = self.mesh["tensor"].get_local_rank()
        self.data_rank = replicate.get_local_rank() * options.shard + shard.get_local_rank()
        self.data_world_size = options.replicate * options.shard
        self.plan_line = ""  # the tensor plan as applied, for the run's first line

    def _shard(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        self.progress.enter("the parallelising of the model")
        module = module.to(self.device)
        self.keep_whole(module)
        if self.layout.tensor > 1:
            self.plan_line = describe_plan(module, self.layout.tensor_plan, self.layout.tensor)
        module = parallelize(module, self.mesh, self.layout, self.options)
        for name, unit in module.named_modules():
            if isinstance(unit, FSDPModule):  # its all-gathers counted, as fsdp's are
                self._count_unit(module.get_submodule(name), name)
        return module

    def describe(self) -> tuple[str, str]:
        # a tensor group's processes take one share of each micro-batch together
        return ("tensor group" if self.layout.tensor > 1 else "device"), self.plan_line

    def _sync_gradients(self, final: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        # where the data dimensions shard the model: reduce once, after the last micro-batch
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(final)

    def _agree_started(self, loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, dist.Work]:
        """The all-reduce over every process of the loss and stop flag, where only each tensor
        group's first process counts its shard's loss (the others computed the same one)."""
        counted = loss if self.tensor_rank == 0 else torch.zeros_like(loss)
        values = agreement(counted, stop)
        self.progress.enter("the agreement on the step's loss")
        return values, dist.all_reduce(values, async_op=True)

    # Each data shard's outputs go to the hooks once, from its tensor group's first process: the
    # others' are left out of what the hooks see (their own view and the gathered one), as an empty
    # shard's are
    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        outcome = super().train_step(engine, micros, stop)
        if self.tensor_rank != 0:
            outcome.parts = [None] * len(outcome.parts)
        return outcome

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        outputs = super().evaluate(engine, batch)
        return outputs if self.tensor_rank == 0 else {}


def _device_mesh(device_type: str, layout: MeshSettings, processes: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    degrees = (layout.replicate, layout.shard, layout.tensor)
    if degrees[0] * degrees[1] * degrees[2] != processes:
        raise ConfigError(_mismatch(layout, processes))
    return init_device_mesh(device_type, degrees, mesh_dim_names=DIMS)


def parallelize(
    module: nn.Module, mesh: DeviceMesh, layout: MeshSettings, sharding: FSDPSettings
) -> nn.Module:
    """The model parallelised over the mesh, in torchtitan's order:

    1. the tensor plan (`auto` resolved on the model), on the tensor dimension: each named
       module split by its style (strategies/tensor.py), before anything shards the parameters
       further;
    2. fully_shard over the data dimensions (a 2-D replicate x shard mesh: HSDP), as `sharding`
       (`parallel.fsdp`) says: its units (by default the model's parts) and then the root, in
       its dtypes, each summing its gradients (the objective carries 1/B already), where the
       data dimensions hold more than one process.
    """
    if layout.tensor > 1:
        plan = resolve_plan(module, layout.tensor_plan, layout.tensor)
        apply_tensor_plan(module, mesh["tensor"], plan)
    if layout.replicate * layout.shard > 1:
        data = mesh["shard"] if layout.replicate == 1 else mesh["replicate", "shard"]
        apply_fully_shard(module, data, sharding)
    return module


def apply_fully_shard(module: nn.Module, mesh: DeviceMesh, sharding: FSDPSettings) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = next(module.parameters(), torch.empty(0)).device
    policies = shard_policies(sharding, device)
    # innermost first, the root last
    for unit in find_shard_units(module, sharding.shard):
        fully_shard(unit, mesh=mesh, **policies)
    fully_shard(module, mesh=mesh, **policies)
    for sharded in module.modules():
        # sums, not averages: the objective carries 1/B already
        if isinstance(sharded, FSDPModule):
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)
    # as fsdp: phalanx changes no module's output in place (it detaches them for the hooks)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


# --- the strategy as the config names it ---------------------------------------------------


class MeshSettings(StrategySettings):
    """`parallel.mesh`: the degrees of the mesh's dimensions (their product is the number of
    processes) and the tensor plan."""

    replicate: StrictInt = Field(
        1, ge=1, description="data replicate degree: whole copies (of the shard x tensor group)"
    )
    shard: StrictInt = Field(
        1, ge=1, description="data shard degree: processes the parameters are sharded over (FSDP)"
    )
    tensor: StrictInt = Field(
        1, ge=1, description="tensor degree: processes each planned Linear's weight is split over"
    )
    pipeline: StrictInt = Field(
        1,
        ge=1,
        description="pipeline degree: processes a copy of the model is staged over, as "
        "parallel.pipeline (split, microbatches, schedule) says",
    )
    tensor_plan: Literal["auto"] | dict[str, Literal["colwise", "rowwise", "sequence"]] = Field(
        default_factory=dict,
        description="module name -> colwise (a Linear's weight split by outputs, an Embedding's "
        "by embedding dimensions), rowwise (a Linear's by inputs, an Embedding's by rows) or "
        "sequence (a LayerNorm or RMSNorm run on a share of the positions); auto: the MLPs' "
        "Linear pairs and the attention projections found on the model; used where tensor > 1",
    )


def _product(layout: MeshSettings) -> int:
    return layout.replicate * layout.shard * layout.pipeline * layout.tensor


def _mismatch(layout: MeshSettings, processes: int) -> str:
    return (
        f"parallel.mesh: replicate({layout.replicate}) * shard({layout.shard}) * "
        f"pipeline({layout.pipeline}) * tensor({layout.tensor}) = {_product(layout)}, but the "
        f"job has {processes} processes; set parallel.devices to {_product(layout)}, or degrees "
        f"whose product is {processes}"
    )


def build(cfg: Config, accelerator: str, devices: int) -> Mesh | Pipeline | DDP:
    """The strategy of the mesh's shape: `ddp`'s where it only replicates (its bucketed
    all-reduce overlaps the backward), the pipeline's where it stages the model (with a tensor
    dimension inside each stage), else fsdp's with a tensor dimension (`Mesh`)."""
    refuse_outside_workers("mesh", devices)
    if not in_worker():
        raise ConfigError(
            "parallel.strategy=mesh lays several processes out on a mesh; set parallel.devices to "
            "2 or more (phalanx starts them; parallel.mesh's degrees multiply to it), or start "
            "phalanx under torchrun"
        )
    # the job's processes, on every machine (`devices` is this machine's)
    processes = environment.here().world_size
    check(cfg, accelerator, processes)
    layout = cfg.parallel.section("mesh", MeshSettings)
    if layout.replicate == processes:
        return ddp.build(cfg, accelerator, devices)
    if layout.pipeline > 1:
        # the pipeline's stages with the tensor dimension inside each
        return Pipeline(
            accelerator,
            checked_settings(cfg, accelerator, "mesh"),
            window=-(-cfg.dataset.batch_size // cfg.parallel.accumulation),
            timeout_s=cfg.parallel.timeout_s,
            backend=cfg.parallel.backend,
            tensor=Tensor(layout.tensor, layout.tensor_plan),
            config_name="mesh",
        )
    return Mesh(
        accelerator,
        layout,
        cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
        sharding=cfg.parallel.section("fsdp", FSDPSettings),
    )


def check(cfg: Config, accelerator: str, processes: int) -> None:
    refuse(
        "mesh",
        {
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            PRECISION: cfg.precision == "fp16",
        },
        "parallel.strategy=fsdp or ddp",
    )
    layout = cfg.parallel.section("mesh", MeshSettings)
    if _product(layout) != processes:
        raise ConfigError(_mismatch(layout, processes))
    if layout.tensor > 1 and not layout.tensor_plan:
        raise ConfigError(no_plan(layout.tensor, "net.0"))
    if layout.pipeline > 1:
        _check_pipeline(cfg, accelerator, layout)
    sharding = cfg.parallel.section("fsdp", FSDPSettings)
    if sharding.init == "meta":
        raise ConfigError(
            "parallel.fsdp.init=meta is not supported under parallel.strategy=mesh (the tensor "
            "plan splits layers that hold values); remove it (init: full), or use "
            "parallel.strategy=fsdp"
        )
    if sharding.offload and layout.tensor > 1:
        raise ConfigError(
            "parallel.fsdp.offload with parallel.mesh.tensor > 1 is not supported: a split "
            "layer's parts stay on its devices; remove offload, or set parallel.mesh.tensor: 1"
        )


def _check_pipeline(cfg: Config, accelerator: str, layout: MeshSettings) -> None:
    """A pipeline dimension: its stages (parallel.pipeline) make `pipeline` processes a copy, and
    its copies replicate (sharding a pipeline's stages is not built)."""
    if layout.shard > 1:
        raise ConfigError(
            f"parallel.mesh: pipeline({layout.pipeline}) with shard({layout.shard}) is not "
            f"supported: a pipeline's stages are copied, not sharded; set parallel.mesh.replicate "
            f"to {layout.replicate * layout.shard} and parallel.mesh.shard to 1"
        )
    settings = checked_settings(cfg, accelerator, "mesh")
    per_process = settings.stages_per_process or 1
    if settings.split == "auto":
        stages = settings.stages or layout.pipeline * per_process
    else:
        stages = len(settings.split) + 1
    if stages != layout.pipeline * per_process:
        raise ConfigError(
            f"parallel.mesh.pipeline is {layout.pipeline}, but parallel.pipeline makes {stages} "
            f"stages, {per_process} a process; set parallel.mesh.pipeline to "
            f"{max(stages // per_process, 1)}, or split the model into "
            f"{layout.pipeline * per_process} stages"
        )
    # the stages share out over the processes, and the schedule can run its micro-batches
    pipeline_layout(settings, processes=layout.replicate * layout.pipeline)


register(
    Family(
        "mesh",
        build,
        "one process per device on a replicate x shard x pipeline x tensor mesh: tensor "
        "parallelism composed with FSDP or the pipeline's stages",
        process_per_device=True,
        check=check,
        settings=MeshSettings,
        field=Field(default_factory=MeshSettings, description="the mesh strategy's"),
        shards_state=True,
        setups=mesh_pricing.setups,
        cost=mesh_pricing.price,
        unplanned=mesh_pricing.unplanned,
        notes=mesh_pricing.notes,
        label=mesh_pricing.label,
        readers=mesh_pricing.readers,
        accumulation_setup=mesh_pricing.accumulation_setup,
        plan_settings=mesh_pricing.plan_settings,
    )
)
