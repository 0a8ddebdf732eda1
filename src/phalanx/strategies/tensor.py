"""The tensor dimension of the `mesh` strategy: a plan (module name -> style) checked against the
model, and applied with torch's `parallelize_module` over the mesh's tensor dimension."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from phalanx.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_tensor_plan(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_plan(module, plan, mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(module, mesh, {name: styles[style]() for name, style in plan.items()})


def check_plan(module: nn.Module, plan: Mapping[str, str], degree: int) -> None:
    """Each module the plan names is a Linear of the model whose split dimension (outputs for
    colwise, inputs for rowwise) the tensor degree divides: one ConfigError otherwise."""
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not plan:
        raise ConfigError(no_plan(degree, linears[0] if linears else "net.0"))
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


def no_plan(degree: int, example: str) -> str:
    return (
        f"parallel.mesh.tensor is {degree} but parallel.mesh.tensor_plan is empty; name the "
        f"Linear modules to split, such as {{{example}: colwise}}, or set parallel.mesh.tensor: 1"
    )
