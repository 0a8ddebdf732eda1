"""The tensor dimension of the `mesh` strategy: a plan (module name -> style), written by hand or
found by `auto`, checked against the model and applied with torch's `parallelize_module` over the
mesh's tensor dimension.

The styles are torch's, with the inputs taken as phalanx hands them over: every process of a
tensor group holds the same whole activations (they train on the same shard of the batch).

- `colwise` (`ColwiseParallel`): a Linear's weight split by outputs, an Embedding's by embedding
  dimensions; its output is this process's slice of the features (a plain tensor), which the
  following `rowwise` layer takes. A DTensor input (a `sequence` norm's output) is gathered first.
- `rowwise` (`RowwiseParallel`): a Linear's weight split by inputs, its partial outputs summed; an
  Embedding's rows (the vocabulary) split, each process looking up the rows it holds.
- `sequence` (`SequenceParallel`): a LayerNorm or RMSNorm run on this process's share of the
  sequence positions (dimension 1), its output a DTensor sharded by position, which a following
  `colwise` layer gathers; anything else that takes it must take DTensors (a plain tensor op says
  so: a "mixed torch.Tensor and DTensor" error, never a silent result).

An attention module whose q, k and v projections are split colwise computes its own share of the
heads: its head counts (`n_head`, `num_heads`, ... and the key/value ones) are divided by the
degree, as torch's tensor parallel tutorial does, so that its forward's reshape into
(batch, time, heads, head_dim) sees the heads it holds.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from phalanx.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

Style = Literal["colwise", "rowwise", "sequence"]
# consecutive planned modules between which the activation is split over the tensor group: a
# colwise layer's output slices until the rowwise one, a sequence norm's positions until the
# colwise layer that gathers them
SPLIT_BETWEEN = {("colwise", "rowwise"), ("sequence", "colwise")}
# the module types each style splits
TAKES: dict[str, tuple[type[nn.Module], ...]] = {
    "colwise": (nn.Linear, nn.Embedding),
    "rowwise": (nn.Linear, nn.Embedding),
    "sequence": (nn.LayerNorm, nn.RMSNorm),
}
# the names attention modules give their head counts, head size and projections
HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
KV_HEADS = ("n_kv_head", "n_kv_heads", "num_key_value_heads")
HEAD_DIM = ("head_dim", "head_size")
PROJECTIONS = {
    "q": ("q", "q_proj", "wq", "query", "to_q"),
    "k": ("k", "k_proj", "wk", "key", "to_k"),
    "v": ("v", "v_proj", "wv", "value", "to_v"),
    "out": ("o", "o_proj", "out_proj", "wo", "proj", "c_proj", "dense", "out", "to_out"),
}
FUSED = ("qkv", "c_attn", "qkv_proj", "wqkv", "Wqkv", "in_proj")


@dataclass
class Found:
    """What `auto` found: module name -> style, and the parts it left whole -> why."""

    styles: dict[str, str] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tensor:
    """A tensor dimension: `degree` processes, each module the plan names split over them by its
    style (or `auto`: found on the model)."""

    degree: int
    plan: Mapping[str, str] | str


def resolve_plan(module: nn.Module, plan: Mapping[str, str] | str, degree: int) -> dict[str, str]:
    """The plan to apply, module name -> style: `auto` found on the model, or the plan as written;
    checked either way (one ConfigError where the model cannot take it)."""
    if plan == "auto":
        found = find_plan(module, degree)
        if not found.styles:
            raise ConfigError(_found_nothing(module, degree, found))
        resolved = found.styles
    elif isinstance(plan, Mapping):
        resolved = dict(plan)
    else:
        raise ConfigError(f"parallel.mesh.tensor_plan is {plan!r}; give auto or a mapping")
    check_plan(module, resolved, degree)
    return resolved


def find_plan(module: nn.Module, degree: int) -> Found:
    """`auto`: in each attention module (one with a head count), its separate q, k and v Linears
    colwise and its output Linear rowwise, where its heads split by `degree`; elsewhere, a Linear
    followed by a Linear of its output size under the same parent, with only modules without
    parameters (activations, dropout) registered between them: colwise then rowwise (an MLP)."""
    found = Found()
    tied = _tied(module)
    for name, parent in module.named_modules():
        if _int_attr(parent, HEADS) is not None:
            _plan_attention(name, parent, degree, found)
        else:
            _plan_pairs(name, parent, degree, tied, found)
    return found


def _plan_pairs(
    prefix: str, parent: nn.Module, degree: int, tied: Mapping[str, str], found: Found
) -> None:
    waiting: tuple[str, nn.Linear] | None = None
    for child_name, child in parent.named_children():
        name = f"{prefix}.{child_name}" if prefix else child_name
        if isinstance(child, nn.Linear) and name not in tied:
            if waiting is not None and waiting[1].out_features == child.in_features:
                if child.in_features % degree == 0:
                    found.styles[waiting[0]], found.styles[name] = "colwise", "rowwise"
                else:
                    found.whole[f"{waiting[0]} and {name}"] = (
                        f"their {child.in_features} hidden features do not split over {degree}"
                    )
                waiting = None
            else:
                waiting = (name, child)
        # a module with parameters between two Linears (a norm) needs the whole features
        elif isinstance(child, nn.Linear) or any(True for _ in child.parameters()):
            waiting = None


def _plan_attention(prefix: str, attention: nn.Module, degree: int, found: Found) -> None:
    linears = {n: c for n, c in attention.named_children() if isinstance(c, nn.Linear)}
    parts = {
        role: next((n for n in names if n in linears), None) for role, names in PROJECTIONS.items()
    }
    fused = next((n for n in FUSED if n in linears), None)
    why = None
    if fused is not None:
        why = (
            f"its q, k and v are one Linear ({fused!r}): a split of its outputs would give a "
            "process rows of q and k, not whole heads; separate q, k and v Linears split"
        )
    elif None in parts.values():
        why = "no separate q, k, v and output Linears (q_proj, k_proj, v_proj, o_proj, ...)"
    elif _int_attr(attention, HEAD_DIM) is None:
        why = (
            "no head_dim attribute: its forward may derive the head size from the split width, "
            "which a split would change"
        )
    else:
        why = _heads_indivisible(attention, degree)
    if why is not None:
        found.whole[prefix] = why
        return
    for role in ("q", "k", "v"):
        found.styles[_join(prefix, parts[role])] = "colwise"
    found.styles[_join(prefix, parts["out"])] = "rowwise"


def _heads_indivisible(attention: nn.Module, degree: int) -> str | None:
    for names in (HEADS, KV_HEADS):
        count = _int_attr(attention, names)
        if count is not None and count % degree:
            return f"its {count} heads ({_attr_name(attention, names)}) do not split over {degree}"
    return None


def check_plan(module: nn.Module, plan: Mapping[str, str], degree: int) -> None:
    """Each module the plan names is one of the model's that its style splits (colwise, rowwise: a
    Linear or an Embedding; sequence: a LayerNorm or RMSNorm), owns its weights (no tied weight),
    and has a split dimension the tensor degree divides; an attention module whose q, k and v it
    splits has heads the degree divides. One ConfigError otherwise, naming the module and fix."""
    if not plan:
        raise ConfigError(no_plan(degree, (_candidates(module, TAKES["colwise"]) or ["net.0"])[0]))
    tied = _tied(module)
    for name, style in plan.items():
        layer = _planned(module, name, style)
        if name in tied:
            raise ConfigError(
                f"parallel.mesh.tensor_plan names {name!r}, whose weight another module shares "
                f"({tied[name]}): a split would leave the other whole; leave {name!r} out of the "
                "plan, or untie the weights"
            )
        _check_divides(name, style, layer, degree)
    for name, attention in module.named_modules():
        if _splits_heads(name, attention, plan):
            why = _heads_indivisible(attention, degree)
            if why is not None:
                raise ConfigError(
                    f"parallel.mesh.tensor_plan splits the q, k and v of {name!r}, but {why} "
                    f"processes (parallel.mesh.tensor); choose a tensor degree that divides them, "
                    f"or leave {name!r}'s projections out of the plan"
                )


def _planned(module: nn.Module, name: str, style: str) -> nn.Module:
    kinds = TAKES.get(style)
    if kinds is None:
        raise ConfigError(
            f"parallel.mesh.tensor_plan gives {name!r} the style {style!r}; choose one of "
            f"{', '.join(TAKES)}"
        )
    try:
        layer = module.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            f"parallel.mesh.tensor_plan names {name!r}, which the model does not have; its "
            f"modules a plan can split are {_listed(_candidates(module, _ALL))}"
        ) from None
    if not isinstance(layer, kinds):
        raise ConfigError(
            f"parallel.mesh.tensor_plan names {name!r} ({style}), a {type(layer).__name__}; "
            f"{style} splits {' and '.join(f'nn.{k.__name__}' for k in kinds)} modules; name "
            f"one of {_listed(_candidates(module, kinds))}"
        )
    return layer


def _check_divides(name: str, style: str, layer: nn.Module, degree: int) -> None:
    if isinstance(layer, nn.Linear):
        size, what = (
            (layer.out_features, "outputs") if style == "colwise" else (layer.in_features, "inputs")
        )
    elif isinstance(layer, nn.Embedding):
        size, what = (
            (layer.embedding_dim, "embedding dimensions")
            if style == "colwise"
            else (layer.num_embeddings, "rows")
        )
    else:
        # a sequence norm's weights stay whole; torch splits the positions, evenly or not
        return
    if size % degree:
        raise ConfigError(
            f"parallel.mesh.tensor_plan: {name!r} ({style}) splits its {size} {what} over "
            f"parallel.mesh.tensor={degree} processes, which does not divide them; choose a "
            f"tensor degree that divides {size}, or leave {name!r} out of the plan"
        )


def apply_tensor_plan(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
    """Split the planned modules over `mesh` (the tensor dimension), and set each attention module
    whose q, k and v are split to count the heads this process holds."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree = mesh.size()
    check_plan(module, plan, degree)
    attentions = [(n, m) for n, m in module.named_modules() if _splits_heads(n, m, plan)]
    styles = {name: _style(module.get_submodule(name), style) for name, style in plan.items()}
    parallelize_module(module, mesh, styles)
    for _, attention in attentions:
        for names in (HEADS, KV_HEADS):
            attr = _attr_name(attention, names)
            if attr is not None:
                setattr(attention, attr, getattr(attention, attr) // degree)
    heads = {name: _int_attr(attention, HEADS) for name, attention in attentions}
    _watch_splits(module, plan, degree, mesh.get_local_rank(), heads)


def _watch_splits(
    module: nn.Module,
    plan: Mapping[str, str],
    degree: int,
    index: int,
    heads: Mapping[str, int | None],
) -> None:
    """Hooks on the split layers that tell `phalanx.random` where the forward's activations are
    this process's slice (`split_region.Split`): from a colwise layer's output to the next rowwise
    layer's input, or a sequence norm's output. A dropout there draws the masks of its slice of
    the whole tensor, as one process would. `heads`: each split attention's heads, this process's
    share."""
    from phalanx import split_region

    for name, style in plan.items():
        layer = module.get_submodule(name)
        if style == "rowwise":
            layer.register_forward_pre_hook(_closing)
            continue
        if style == "colwise":
            width = layer.out_features if isinstance(layer, nn.Linear) else 0
            if isinstance(layer, nn.Embedding):
                width = layer.embedding_dim
            split = split_region.Split(
                degree,
                index,
                f"between the colwise {name!r} and the rowwise layer after it",
                features=width // degree,
                heads=heads.get(name.rpartition(".")[0]),
            )
        else:
            split = split_region.Split(
                degree, index, f"after the sequence norm {name!r}", sequence=True
            )
        layer.register_forward_hook(functools.partial(_opening, split))
    # each forward starts whole (one that raised inside a split region left it open)
    module.register_forward_pre_hook(_closing)


def _opening(split: Any, module: nn.Module, args: Any, output: Any) -> None:
    from phalanx import split_region

    split_region.open_split(split)


def _closing(module: nn.Module, args: Any) -> None:
    from phalanx import split_region

    split_region.close_split()


def _style(layer: nn.Module, style: str) -> ParallelStyle:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    class Colwise(ColwiseParallel):
        # a DTensor input (a sequence norm's output, sharded by position) gathered whole
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            x = inputs[0]
            if isinstance(x, DTensor):
                return x.redistribute(placements=desired_input_layouts)
            return DTensor.from_local(x, device_mesh, input_layouts, run_check=False)

    class Sequence(SequenceParallel):
        # torch takes a plain input as this process's share of the positions; phalanx's is whole
        @staticmethod
        def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return x.redistribute(placements=sequence_sharding)

    if style == "colwise":
        return Colwise()
    if style == "sequence":
        return Sequence()
    # an embedding's input is token ids, the same on every process of the group
    return (
        RowwiseParallel(input_layouts=Replicate())
        if isinstance(layer, nn.Embedding)
        else (RowwiseParallel())
    )


def describe_plan(module: nn.Module, plan: Mapping[str, str] | str, degree: int) -> str:
    """For the run's first line: the styles the modules get, grouped by layer (`blocks.*.mlp.fc`),
    and under `auto` what it left whole and why."""
    resolved = resolve_plan(module, plan, degree)
    by_style: dict[str, list[str]] = {}
    for name, style in resolved.items():
        by_style.setdefault(style, []).append(name)
    said = "; ".join(f"{style} {_grouped(names)}" for style, names in by_style.items())
    line = f"tensor plan{' (auto)' if plan == 'auto' else ''} over {degree} processes: {said}"
    if plan == "auto":
        whole = find_plan(module, degree).whole
        reasons: dict[str, list[str]] = {}
        for name, why in whole.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            line += f"; {_grouped(names)} left whole: {why}"
    return line


def _found_nothing(module: nn.Module, degree: int, found: Found) -> str:
    whole = "".join(f"; {name} left whole: {why}" for name, why in found.whole.items())
    return (
        f"parallel.mesh.tensor_plan is auto, but it found nothing in {type(module).__name__} to "
        f"split over parallel.mesh.tensor={degree}: no Linear followed by a Linear of its output "
        f"size under the same parent (an MLP), and no attention module with separate q, k, v and "
        f"output Linears, a head_dim and heads that {degree} divides{whole}; name the modules to "
        "split, such as {fc: colwise, proj: rowwise}, or set parallel.mesh.tensor: 1"
    )


def no_plan(degree: int, example: str) -> str:
    return (
        f"parallel.mesh.tensor is {degree} but parallel.mesh.tensor_plan is empty; name the "
        f"modules to split, such as {{{example}: colwise}}, or give auto, or set "
        "parallel.mesh.tensor: 1"
    )


# --- the model's modules, as plans name them ---------------------------------------------------

_ALL = tuple({kind for kinds in TAKES.values() for kind in kinds})


def _candidates(module: nn.Module, kinds: tuple[type[nn.Module], ...]) -> list[str]:
    return [name for name, m in module.named_modules() if name and isinstance(m, kinds)]


def _listed(names: list[str], most: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _tied(module: nn.Module) -> dict[str, str]:
    """Modules whose parameters another module holds too -> the other modules' names."""
    holders: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for param in sub.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    tied: dict[str, str] = {}
    for names in holders.values():
        for name in names if len(set(names)) > 1 else []:
            tied[name] = ", ".join(repr(other) for other in names if other != name)
    return tied


def _splits_heads(name: str, attention: nn.Module, plan: Mapping[str, str]) -> bool:
    """Whether `plan` splits the q, k and v projections of `attention`, an attention module."""
    if _int_attr(attention, HEADS) is None:
        return False
    children = dict(attention.named_children())
    for role in ("q", "k", "v"):
        child = next((n for n in PROJECTIONS[role] if n in children), None)
        if child is None or plan.get(_join(name, child)) != "colwise":
            return False
    return True


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    name = _attr_name(module, names)
    return getattr(module, name) if name is not None else None


def _attr_name(module: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(vars(module).get(n), int)), None)


def _join(prefix: str, name: str | None) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _grouped(names: list[str]) -> str:
    """Names that differ only in the indices of the layers that hold them as one pattern:
    blocks.0.fc, blocks.1.fc -> blocks.*.fc (2); a name alone stays as it is."""
    patterns = [re.sub(r"(?<![^.])\d+(?=\.)", "*", name) for name in names]
    counts = Counter(patterns)
    said: list[str] = []
    for name, pattern in zip(names, patterns, strict=True):
        text = f"{pattern} ({counts[pattern]})" if counts[pattern] > 1 else name
        if text not in said:
            said.append(text)
    return ", ".join(said)


def check_tensor_plan(
    whole: nn.Module, tensor: Tensor, cuts: list[str], blocks: set[str], looped: str | None
) -> dict[str, str]:
    """A pipeline's tensor plan, resolved and checked against the whole model before the split:
    as any plan (`resolve_plan`); no stage starting (at one of `cuts`) where the activation is
    split over the tensor group (`SPLIT_BETWEEN`); and, where a process holds several stages
    (`looped`: the schedule that loops them), no split layer among the trunk's `blocks`, which
    pass an earlier stage's activation through (a split layer's own input and output layouts
    would change it)."""
    plan = resolve_plan(whole, tensor.plan, tensor.degree)
    order = {name: i for i, (name, _) in enumerate(whole.named_modules())}
    planned = sorted(plan, key=order.__getitem__)
    for before, after in zip(planned, planned[1:], strict=False):
        inside = [c for c in cuts if order[before] < order[c] <= order[after]]
        if (plan[before], plan[after]) in SPLIT_BETWEEN and inside:
            raise ConfigError(
                f"parallel.pipeline.split starts a stage at {inside[0]!r}, between {before!r} "
                f"({plan[before]}) and {after!r} ({plan[after]}), where the activation is split "
                f"over the tensor group; move the split point before {before!r} or after "
                f"{after!r}"
            )
    passing = [name for name in planned if name in blocks]
    if looped is not None and passing:
        raise ConfigError(
            f"parallel.mesh.tensor_plan splits {passing[0]!r}, a block the pipeline passes "
            f"activations through when a process holds several stages "
            f"(parallel.pipeline.schedule={looped}); plan the layers inside the blocks, or use a "
            "schedule of one stage a process (1f1b, gpipe)"
        )
    return plan
