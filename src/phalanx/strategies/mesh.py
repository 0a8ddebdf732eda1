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

from phalanx.errors import ConfigError
from phalanx.settings import StrategySettings
from phalanx.strategies import mesh_pricing, refuse_outside_workers
from phalanx.strategies.distributed import agreement
from phalanx.strategies.fsdp import FSDP, FSDPSettings, find_shard_units
from phalanx.strategies.registry import Family, refuse, register

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from phalanx.config import Config
    from phalanx.engine import Engine
    from phalanx.strategies.base import Micros, Outcome

DIMS = ("replicate", "shard", "tensor")


class Mesh(FSDP):
    """fsdp's strategy on a replicate x shard x tensor mesh; `layout` holds its degrees and plan."""

    def __init__(
        self,
        accelerator: str,
        options: MeshSettings,
        timeout_s: float | None = None,
        backend: str = "auto",
    ):
        super().__init__(accelerator, FSDPSettings(), timeout_s, backend)
        self.layout = options
        self.mesh = _device_mesh(self.device.type, options, self.world_size)
        replicate, shard = self.mesh["replicate"], self.mesh["shard"]
        # the data dimensions alone: a tensor group's processes share one shard of each batch
        self.tensor_rank = self.mesh["tensor"].get_local_rank()
        self.data_rank = replicate.get_local_rank() * options.shard + shard.get_local_rank()
        self.data_world_size = options.replicate * options.shard

    def _shard(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        self.progress.enter("the parallelising of the model")
        module = parallelize(module.to(self.device), self.mesh, self.layout)
        for name, unit in module.named_modules():
            if isinstance(unit, FSDPModule):  # its all-gathers counted, as fsdp's are
                self._count_unit(module.get_submodule(name), name)
        return module

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


def parallelize(module: nn.Module, mesh: DeviceMesh, layout: MeshSettings) -> nn.Module:
    """The model parallelised over the mesh, in torchtitan's order:

    1. the tensor plan, on the tensor dimension: each named Linear's weight split by rows
       (colwise: its outputs sharded) or by columns (rowwise: its inputs sharded, its outputs
       summed), before anything shards the parameters further;
    2. fully_shard over the data dimensions (a 2-D replicate x shard mesh: HSDP), the model's
       parts as units (fsdp's default) and then the root, each summing its gradients (the
       objective carries 1/B already), where the data dimensions hold more than one process.
    """
    if layout.tensor > 1:
        apply_tensor_plan(module, mesh["tensor"], layout.tensor_plan)
    if layout.replicate * layout.shard > 1:
        data = mesh["shard"] if layout.replicate == 1 else mesh["replicate", "shard"]
        apply_fully_shard(module, data)
    return module


def apply_tensor_plan(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_plan(module, plan, mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(module, mesh, {name: styles[style]() for name, style in plan.items()})


def apply_fully_shard(module: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # innermost first, the root last
    for unit in find_shard_units(module, None):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for sharded in module.modules():
        # sums, not averages: the objective carries 1/B already
        if isinstance(sharded, FSDPModule):
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)
    # as fsdp: phalanx changes no module's output in place (it detaches them for the hooks)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def check_plan(module: nn.Module, plan: Mapping[str, str], degree: int) -> None:
    """Each module the plan names is a Linear of the model whose split dimension (outputs for
    colwise, inputs for rowwise) the tensor degree divides: one ConfigError otherwise."""
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not plan:
        raise ConfigError(_no_plan(degree, linears[0] if linears else "net.0"))
    for name, style in plan.items():
        try:
            layer = module.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"parallel.mesh.tensor_plan names {name!r}, which the model does not have; "
                f"its Linear modules are {', '.join(linears) or 'none'}"
            ) from None
        if not isinstance(layer, nn.Linear):
            raise ConfigError(
                f"parallel.mesh.tensor_plan names {name!r}, a {type(layer).__name__}; only "
                f"nn.Linear modules are split; name one of {', '.join(linears) or 'none'}"
            )
        size, what = (
            (layer.out_features, "outputs") if style == "colwise" else (layer.in_features, "inputs")
        )
        if size % degree:
            raise ConfigError(
                f"parallel.mesh.tensor_plan: {name!r} ({style}) splits its {size} {what} over "
                f"parallel.mesh.tensor={degree} processes, which does not divide them; choose a "
                f"tensor degree that divides {size}, or leave {name!r} out of the plan"
            )


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
    tensor_plan: dict[str, Literal["colwise", "rowwise"]] = Field(
        default_factory=dict,
        description="module name -> colwise (weight split by outputs) or rowwise (by inputs); "
        "used where tensor > 1",
    )


def _no_plan(degree: int, example: str) -> str:
    return (
        f"parallel.mesh.tensor is {degree} but parallel.mesh.tensor_plan is empty; name the "
        f"Linear modules to split, such as {{{example}: colwise}}, or set parallel.mesh.tensor: 1"
    )


def _mismatch(layout: MeshSettings, processes: int) -> str:
    product = layout.replicate * layout.shard * layout.tensor
    return (
        f"parallel.mesh: replicate({layout.replicate}) * shard({layout.shard}) * "
        f"tensor({layout.tensor}) = {product}, but the job has {processes} processes; set "
        f"parallel.devices to {product}, or degrees whose product is {processes}"
    )


def build(cfg: Config, accelerator: str, devices: int) -> Mesh:
    refuse_outside_workers("mesh", devices)
    check(cfg, accelerator, devices)
    return Mesh(
        accelerator,
        cfg.parallel.section("mesh", MeshSettings),
        cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
    )


def check(cfg: Config, accelerator: str, processes: int) -> None:
    refuse(
        "mesh",
        {
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            "precision=fp16": cfg.precision == "fp16",
        },
        "parallel.strategy=fsdp or ddp",
    )
    layout = cfg.parallel.section("mesh", MeshSettings)
    if layout.replicate * layout.shard * layout.tensor != processes:
        raise ConfigError(_mismatch(layout, processes))
    if layout.tensor > 1 and not layout.tensor_plan:
        raise ConfigError(_no_plan(layout.tensor, "net.0"))


register(
    Family(
        "mesh",
        build,
        "one process per device on a replicate x shard x tensor mesh: tensor parallelism "
        "composed with FSDP",
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
