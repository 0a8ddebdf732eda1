"""Where a model splits into pipeline stages, and each process keeping its stages' modules.

`parallel.pipeline.split` names the modules where a new stage starts, all children of one
`nn.Sequential` or `nn.ModuleList` (the *trunk*) that the model's forward calls in a chain, each
child taking the previous one's output (split by module name, as torchtitan does: torch's traced
front end breaks on real models). Before the first step, one forward of the whole model on a
micro-batch of the first samples (evaluation mode, no gradients: nothing the model holds moves)
checks the chain, finds the activations' shapes at each cut, and sorts the modules outside the trunk
by when the forward calls them: those before the trunk belong to the first stage, those after it to
the last (`probe`). Each process then keeps only its stages' modules; the others leave the module
tree, so its state dict holds the model's own names, its stages' part of them (`keep_stages`).

The model's own forward then runs a stage: the trunk's blocks before the stage pass their input
through, the stage's first block takes the activation received instead of its input, the next
stage's first block ends the forward with its input (`Cut`), and the modules before the trunk give
zeros of their outputs' shapes on later stages (`Active` says which stage runs). Where the forward
calls the trunk whole and it is a plain `nn.Sequential`, the trunk's own forward does the same
without calling the other stages' blocks at all; the blocks keep their own path for a forward
that calls them one by one (one that loops over them in training alone, say).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from phalanx.costs import partition
from phalanx.errors import ConfigError


class Cut(Exception):  # noqa: N818 - a signal, not an error: the stage's forward ends here
    def __init__(self, activation: torch.Tensor):
        self.activation = activation


@dataclass
class Split:
    """Where the model splits, as the probe found it."""

    trunk: str  # the trunk's name in the model
    cuts: list[int]  # the trunk's child index where each stage after the first starts
    size: int  # the trunk's children
    before: list[str]  # modules outside the trunk that the forward calls before it: stage 0's
    after: list[str]  # and after it: the last stage's
    shapes: list[tuple[torch.Size, torch.dtype]]  # the activation at each cut
    zeros: dict[str, Any] = field(default_factory=dict)  # what each module before the trunk gives
    # whether the forward calls the trunk, a plain `nn.Sequential`, whole: each stage's run of it
    # then calls its own blocks alone (`_run_range_of`)
    whole: bool = False


@dataclass
class Active:
    """What the model's forward does in this process now: the stage that runs (see the module's
    docstring)."""

    lo: int = 0  # the trunk's first child of the stage
    hi: int = 0  # the first child of the next stage (the trunk's size on the last stage)
    stage: int = 0
    received: torch.Tensor | None = None  # the activation from the previous stage
    captured: list[dict] = field(default_factory=list)  # the last stage's outputs
    # the trunk's own run of the stage's blocks is calling them (`_run_range_of`): as they are
    inside: bool = False
    chunks: list[dict] = field(default_factory=list)  # the step's micro-batches, in order
    batch: dict = field(default_factory=dict)  # the micro-batch a stage's forward runs
    rows: int = 0  # its samples

    def forget_batch(self) -> None:
        """The step's or round's micro-batches let go once the schedule has run them."""
        self.chunks, self.batch = [], {}


def stage_parts(model: nn.Module, split: Split, stage: int, stages: int) -> list[nn.Module]:
    """Stage `stage`'s modules: its blocks, and those around the trunk on the first and last."""
    bounds = [0, *split.cuts, split.size]
    trunk = model.get_submodule(split.trunk) if split.trunk else model
    parts = [trunk.get_submodule(str(i)) for i in range(bounds[stage], bounds[stage + 1])]
    if stage == 0:
        parts += [model.get_submodule(name) for name in split.before]
    if stage == stages - 1:
        parts += [model.get_submodule(name) for name in split.after]
    return parts


def probe(model: nn.Module, call: Callable, batch: Mapping, names: list[str], stages: int) -> Split:
    """One forward of the whole model (evaluation mode, no gradients) that finds where it splits."""
    trunk_name, cuts, trunk = _trunk(model, names)
    children = list(trunk.children())
    units = _units(model, trunk)
    order, inputs, outputs, zeros = _record(model, call, batch, trunk, children, units)
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
    # the trunk's own forward called once, around all its children's calls
    entered = [k for k, entry in enumerate(order) if entry[0] == "whole"]
    whole = (
        bool(trunk_name)
        and type(trunk).forward is nn.Sequential.forward
        and "forward" not in vars(trunk)  # no wrapper of its own (activation checkpointing)
        and len(entered) == 2
        and entered[0] < first
        and last < entered[1]
    )
    return Split(trunk_name, cuts, len(children), before, after, shapes, zeros, whole)


def _record(
    model: nn.Module,
    call: Callable,
    batch: Mapping,
    trunk: nn.Module,
    children: list[nn.Module],
    units: dict,
) -> tuple[list[tuple[str, Any]], dict[int, Any], dict[int, Any], dict[str, Any]]:
    """One forward of the whole model (evaluation mode, no gradients: nothing the model holds
    moves): the order of the trunk's own calls (entered and left), its children's and the units'
    calls, each child's first input and output, and each unit's output's shapes."""
    order: list[tuple[str, Any]] = []  # (what, detail) in call order
    inputs: dict[int, Any] = {}
    outputs: dict[int, Any] = {}
    zeros: dict[str, Any] = {}
    hooks = [
        trunk.register_forward_pre_hook(lambda *_: order.append(("whole", 0))),
        trunk.register_forward_hook(lambda *_: order.append(("whole", 1))),
    ]
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
            zeros.setdefault(name, tree_map(_on_meta, out))

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
    return order, inputs, outputs, zeros


def balance(
    model: nn.Module,
    call: Callable,
    batch: Mapping,
    stages: int,
    agree: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | None = None,
) -> tuple[list[str], list[float]]:
    """`split: auto`: split points that cut the model's largest chain of blocks (the
    `nn.Sequential` or `nn.ModuleList` with the most parameters and at least `stages` blocks) into
    `stages` stages of about equal time (`chain`'s times); `agree` makes the times every process's
    same (their mean), so that every process picks the same points. Returns the points and the
    blocks' times (ms)."""
    chain = chain_of(model, call, batch, stages, device)
    times = agree(torch.tensor([b.time_ms for b in chain.blocks])).tolist()
    valid = {i for i, b in enumerate(chain.blocks) if b.cut_before}
    cuts = partition(times, stages, valid, [b.param_bytes > 0 for b in chain.blocks])
    if cuts is None:
        raise ConfigError(
            f"parallel.pipeline.split=auto cannot cut {chain.name or 'the model'} into {stages} "
            f"stages that each hold parameters where the model passes one tensor from block to "
            f"block (valid points: {', '.join(chain.names(sorted(valid)))}); "
            "name the split points, or ask for fewer stages"
        )
    return chain.names(cuts), times


@dataclass(frozen=True)
class ChainBlock:
    time_ms: float  # its forward and backward on the probe's input
    param_bytes: int  # its trainable parameters'
    input_bytes: int  # the tensor entering it (0 where it is not one tensor)
    cut_before: bool  # whether a stage may start at it: the model passes it one tensor


@dataclass(frozen=True)
class Chain:
    name: str  # the chain's module name ('' for the model itself)
    blocks: list[ChainBlock]

    def names(self, indices: list[int]) -> list[str]:
        prefix = f"{self.name}." if self.name else ""
        return [f"{prefix}{i}" for i in indices]


def chain_of(
    model: nn.Module,
    call: Callable,
    batch: Mapping,
    stages: int = 2,
    device: torch.device | None = None,
) -> Chain:
    """The model's largest chain of at least `stages` blocks, each block's forward and backward
    timed on its input of `batch`, on a copy of it on `device` (default where it is), one block at
    a time (its running statistics and the random numbers stay as they were)."""
    trunk_name, trunk = _largest_chain(model, stages)
    children = list(trunk.children())
    _, inputs, outputs, _ = _record(model, call, batch, trunk, children, _units(model, trunk))
    valid = _valid_cuts(trunk_name, children, inputs, outputs)
    blocks = []
    for i, child in enumerate(children):
        given = inputs.get(i)
        blocks.append(
            ChainBlock(
                _timed(child, given, device),
                sum(p.numel() * p.element_size() for p in child.parameters() if p.requires_grad),
                given.numel() * given.element_size() if isinstance(given, torch.Tensor) else 0,
                i in valid,
            )
        )
    return Chain(trunk_name, blocks)


def _largest_chain(model: nn.Module, stages: int) -> tuple[str, nn.Module]:
    chains = [
        (sum(p.numel() for p in module.parameters()), name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) >= stages
    ]
    if not chains:
        raise ConfigError(
            f"parallel.pipeline.split=auto cuts an nn.Sequential or nn.ModuleList of the model "
            f"into {stages} stages, but the model has none of {stages} blocks or more; name the "
            "split points, or ask for fewer stages"
        )
    _, name, module = max(chains, key=lambda chain: chain[0])  # the first of the largest
    return name, module


def _timed(
    block: nn.Module, given: Any, device: torch.device | None = None, repeats: int = 3
) -> float:
    """A block's forward and backward on `given` (ms, the fastest of `repeats` after one to warm
    up), on a copy on `device` (default `given`'s), the random numbers restored after."""
    if not isinstance(given, torch.Tensor):
        return 0.0
    device = given.device if device is None else device
    copy = deepcopy(block).to(device).train()
    given = given.to(device)
    cuda = device.type == "cuda"
    best = float("inf")
    with torch.random.fork_rng(devices=[device] if cuda else []):
        for k in range(repeats + 1):
            x = given.detach().clone().requires_grad_(given.is_floating_point())
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = [t for t in tree_flatten(copy(x))[0] if isinstance(t, torch.Tensor)]
            grown = [t for t in out if t.requires_grad]
            if grown:
                torch.autograd.backward(grown, [torch.ones_like(t) for t in grown])
            if cuda:
                torch.cuda.synchronize(device)
            if k:
                best = min(best, 1e3 * (time.perf_counter() - start))
    return best


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


def _on_meta(value: Any) -> Any:
    """A tensor's shape and dtype, without its memory."""
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _zeros(meta: Any, device: torch.device) -> Any:
    """Zeros of the shapes `_on_meta` kept, on `device`."""
    return tree_map(
        lambda v: torch.zeros_like(v, device=device) if isinstance(v, torch.Tensor) else v, meta
    )


def keep_stages(
    model: nn.Module,
    split: Split,
    mine: list[int],
    stages: int,
    active: Active,
    device: torch.device,
    hooked: bool = False,
) -> None:
    """Remove every module that is not one of stages `mine`'s. The trunk's blocks run only in the
    running stage's range and pass through before it (`active` holds the range and the activation
    received); the modules before the trunk give zeros of their outputs on later stages.
    `hooked`: a stage's range is entered before the blocks' own hooks run (those of tensor
    parallelism, which lay out a block's input), not in their forward."""
    bounds = [0, *split.cuts, split.size]
    trunk = model.get_submodule(split.trunk) if split.trunk else model
    kept = {i for k in mine for i in range(bounds[k], bounds[k + 1])}
    if split.whole:
        _run_range_of(trunk, active)
    for i in range(split.size):
        child = trunk.get_submodule(str(i)) if i in kept else _Passing()
        _run_in_range(child, i, active, hooked)
        if i not in kept:
            setattr(trunk, str(i), child)
    for name in split.before:
        if 0 in mine:
            _zeros_after_the_first(model.get_submodule(name), split.zeros.get(name), device, active)
        else:
            _replace_path(model, name, _Zeros(split.zeros.get(name), device))
    for name in split.after:
        if stages - 1 not in mine:
            _replace_path(model, name, _Unreached(name))


def _zeros_after_the_first(
    module: nn.Module, meta: Any, device: torch.device, active: Active
) -> None:
    """A module before the trunk, in the process that also runs later stages: zeros there."""
    forward = module.forward

    def first_only(*args: Any, **kwargs: Any) -> Any:
        if active.stage:
            return _zeros(meta, device)
        return forward(*args, **kwargs)

    module.forward = first_only  # type: ignore[method-assign]  # on the instance: state names stay


def _run_in_range(child: nn.Module, i: int, active: Active, hooked: bool = False) -> None:
    """Child `i` of the trunk: before the stage it passes its input through, at the stage's first
    child the input becomes the activation received, and the next stage's first child ends the
    stage's forward with its input. `hooked`: the last two in a hook that runs before the
    child's own (a forward wrapper runs after them); the plain path has no hook to call."""
    forward = child.forward

    def entering(module: nn.Module, args: tuple) -> tuple | None:
        if active.inside:
            return None
        if i == active.hi:
            raise Cut(args[0])
        if i == active.lo and active.received is not None:
            return (active.received, *args[1:])
        return None

    def ranged(*args: Any, **kwargs: Any) -> Any:
        if active.inside:
            return forward(*args, **kwargs)
        if i < active.lo:
            return args[0]
        if not hooked:
            changed = entering(child, args)
            args = args if changed is None else changed
        return forward(*args, **kwargs)

    if hooked:
        child.register_forward_pre_hook(entering, prepend=True)
    child.forward = ranged  # type: ignore[method-assign]  # on the instance: state names stay


def _run_range_of(trunk: nn.Module, active: Active) -> None:
    """A trunk that the forward calls whole (a plain `nn.Sequential`): it runs the stage's blocks
    alone, from the activation received (its own input on the first stage), and ends the stage's
    forward with their output where a later stage follows. The blocks before and after the stage
    are not called at all, and the stage's own are called as they are (their hooks with them; their
    `_run_in_range` path, for a forward that calls them one by one, steps aside)."""
    modules = trunk._modules  # the blocks as they are when called (a wrapper may replace one)
    names = list(modules)
    size = len(names)

    def ranged(input: Any) -> Any:
        received = active.received
        x = input if received is None else received
        active.inside = True
        try:
            for i in range(active.lo, active.hi):
                x = modules[names[i]](x)  # type: ignore[misc]  # every block is a module
        finally:
            active.inside = False
        if active.hi < size:
            raise Cut(x)
        return x

    trunk.forward = ranged  # type: ignore[method-assign]  # on the instance: state names stay


def _replace_path(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


class _Passing(nn.Module):
    """A block of another stage: it holds nothing (its forward is `_run_in_range`'s)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a block of another pipeline stage was called outside its range")


class _Zeros(nn.Module):
    """A module the first stage runs, seen from a later one: zeros of what it gives."""

    def __init__(self, meta: Any, device: torch.device):
        super().__init__()
        self.meta, self.device = meta, device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _zeros(self.meta, self.device)


class _Unreached(nn.Module):
    """A module of the last stage, seen from an earlier one, whose forward stops before it."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} belongs to the last pipeline stage; it ran on another")
