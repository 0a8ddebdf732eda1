"""The plan's prices of the `mesh` strategy. Its candidate shapes are data x tensor degrees whose
product is the device count, tensor > 1 (the pure data shapes are `ddp`'s and `fsdp`'s rows), the
data degrees either sharded or replicated. Each is priced as one tensor rank sees the model: the
planned Linears' parameters, gradients and optimizer state divided by the tensor degree, and
their share of the FLOPs too (the rest of the model, and a call's fixed cost, stay whole), through
the data dimensions' own price (`single`'s, `ddp`'s or `fsdp`'s, unchanged), plus the tensor
dimension's all-reduces of activations, which nothing hides.

The tensor plan priced is the config's `parallel.mesh.tensor_plan` where it names one; otherwise
an MLP's pairs: a Linear whose output one other Linear alone takes (through an activation,
dropout: operations of one input each, as measured), split colwise then rowwise.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from phalanx.costs import (
    ONE_DEVICE,
    Block,
    Linear,
    Link,
    Measured,
    Prediction,
    Setup,
    link_of,
    made,
    mb_text,
    ms,
    whole_bytes,
)
from phalanx.strategies import ddp, fsdp, pricing, registry, single

if TYPE_CHECKING:
    from phalanx.config import Config

DIMS = ("replicate", "shard", "tensor")
# a bus bandwidth (bytes/s) beyond PCIe 5 x16's 64 GB/s a direction: a GPU link such as NVLink
NVLINK_CLASS = 100e9
# the fastest link the plan imagines where tensor parallelism does not pay on the measured one:
# beyond NVLink 4's 900 GB/s
FASTEST_LINK = 1e12


@dataclass(frozen=True)
class _Split:
    """What a tensor plan splits, of the measured Linears."""

    share: float  # of the step's counted FLOPs
    param_bytes: int
    # bytes a sample of each all-reduce of a micro-batch: a rowwise layer's outputs summed in the
    # forward, a colwise layer's input gradient summed in the backward
    reduced: tuple[float, ...]


def _pairs(m: Measured) -> list[tuple[Linear, Linear]]:
    """An MLP's pairs, to split colwise then rowwise: each Linear whose output exactly one Linear
    of as many input features takes, and that Linear."""
    # to be shared with `tensor_plan: auto`'s resolver once the strategy has one: one rule for
    # the pairs a run splits and the pairs the plan prices
    by_name = {layer.name: layer for layer in m.linears}
    takers = Counter(layer.fed_by for layer in m.linears if layer.fed_by)
    out: list[tuple[Linear, Linear]] = []
    paired: set[str] = set()
    for layer in m.linears:
        first = by_name.get(layer.fed_by)
        if first is None or takers[first.name] != 1 or {first.name, layer.name} & paired:
            continue
        if first.out_features == layer.in_features:
            out.append((first, layer))
            paired |= {first.name, layer.name}
    return out


def _named(m: Measured) -> dict[str, str]:
    """The config's tensor plan, or {} where it names none (or leaves it to `auto`)."""
    named = m.settings.get("mesh", {}).get("tensor_plan")
    return dict(named) if isinstance(named, dict) else {}


def plan_for(m: Measured, degree: int) -> dict[str, str]:
    """The tensor plan priced at `degree`: the config's, where `degree` divides the features each
    of its Linears splits (its outputs colwise, its inputs rowwise), else none; or the MLP pairs
    whose hidden features `degree` divides."""
    named = _named(m)
    if not named:
        return {
            name: style
            for first, second in _pairs(m)
            if first.out_features % degree == 0
            for name, style in ((first.name, "colwise"), (second.name, "rowwise"))
        }
    for layer in m.linears:
        style = named.get(layer.name)
        size = layer.out_features if style == "colwise" else layer.in_features
        if style in ("colwise", "rowwise") and size % degree:
            return {}
    return named


def _split(m: Measured, plan: dict[str, str]) -> _Split:
    by_name = {layer.name: layer for layer in m.linears}
    planned = [
        (by_name[n], style)
        for n, style in plan.items()
        if n in by_name and style in ("colwise", "rowwise")
    ]
    reduced = tuple(
        layer.output_bytes_per_sample if style == "rowwise" else layer.input_bytes_per_sample
        for layer, style in planned
        if style == "rowwise" or layer.input_grad
    )
    return _Split(
        sum(layer.share for layer, _ in planned),
        sum(layer.param_bytes for layer, _ in planned),
        reduced,
    )


def setups(m: Measured, devices: int) -> list[Setup]:
    """Each count from 2 to `devices` at each tensor degree that divides it and the planned Linears,
    its data degrees sharded, or replicated."""
    out = []
    for n in range(2, devices + 1):
        for tensor in range(2, n + 1):
            plan = plan_for(m, tensor) if n % tensor == 0 else {}
            if not plan:
                continue
            data = n // tensor
            for replicate, shard in sorted({(1, data), (data, 1)}):
                shape = (replicate, shard, tensor)
                out.append(Setup("mesh", n, mesh=shape, tensor_plan=tuple(plan.items())))
    return out


def unplanned(m: Measured, devices: int) -> str | None:
    """Why the plan has no mesh row, where it has none."""
    if devices < 2:
        return ONE_DEVICE
    if setups(m, devices):
        return None
    named = _named(m)
    if named:
        return (
            f"no tensor degree from 2 to {devices} divides every split that "
            f"parallel.mesh.tensor_plan names ({', '.join(named)})"
        )
    pairs = _pairs(m)
    if not pairs:
        return (
            "the model has no pair of Linear layers to split (one taking another's output "
            "through an activation, as an MLP's); name them in parallel.mesh.tensor_plan"
        )
    hidden = sorted({first.out_features for first, _ in pairs})
    return (
        f"no tensor degree from 2 to {devices} divides the hidden features of the model's "
        f"MLP pairs ({', '.join(map(str, hidden))})"
    )


def _tensor_traffic(m: Measured, setup: Setup) -> tuple[int, float]:
    """The all-reduces over the tensor dimension a step makes, and the bytes they reduce."""
    replicate, shard, _ = setup.mesh
    micro = math.ceil(m.batch / (m.accumulation * replicate * shard))
    reduced = _split(m, dict(setup.tensor_plan)).reduced
    return m.accumulation * len(reduced), m.accumulation * micro * sum(reduced)


def _held(m: Measured, setup: Setup, split: _Split) -> Measured:
    """The measurements as one tensor rank sees the model: the planned Linears' state and their
    share of the per-sample compute divided by the tensor degree, its processes' links."""
    replicate, shard, tensor = setup.mesh
    cut = 1 - 1 / tensor
    params = m.param_bytes - cut * split.param_bytes
    kept = params / max(m.param_bytes, 1)
    own = m.computes.get(setup.devices, m.compute)
    compute = replace(own, per_sample_s=own.per_sample_s * (1 - cut * split.share))
    data = replicate * shard
    if data == 1:  # `single`'s price knows no crowding: the tensor group computes side by side
        compute = replace(
            compute,
            fixed_s=compute.fixed_s * m.crowding,
            per_sample_s=compute.per_sample_s * m.crowding,
        )
    return replace(
        m,
        compute=compute,
        computes={data: compute},
        param_bytes=int(params),
        grad_bytes=int(max(m.grad_bytes - cut * split.param_bytes, 0)),
        optimizer_bytes=int(m.optimizer_bytes * kept),
        optimizer_s=m.optimizer_s * kept,
        blocks=_held_blocks(m, dict(setup.tensor_plan), cut),
        all_reduce={data: _data_link(m, setup)} if data > 1 else {},
    )


def _held_blocks(m: Measured, plan: dict[str, str], cut: float) -> tuple[Block, ...]:
    """The chain's blocks as a tensor rank holds them: less the `cut` of their planned Linears'
    parameters (fsdp's units are the blocks)."""
    out = []
    for block in m.blocks:
        inside = [x for x in m.linears if x.name in plan and x.name.startswith(block.name + ".")]
        split = cut * sum(x.param_bytes for x in inside)
        out.append(replace(block, param_bytes=int(block.param_bytes - split)))
    return tuple(out)


def _data_link(m: Measured, setup: Setup) -> Link:
    """A data group's all-reduce: its processes stand a tensor degree apart, so on several
    machines it crosses them as the whole job does (the slower of the two measured links)."""
    replicate, shard, _ = setup.mesh
    own, whole = link_of(m, replicate * shard), link_of(m, setup.devices)
    return own if own.bandwidth <= whole.bandwidth else whole


def _data_price(held: Measured, setup: Setup) -> Prediction:
    """The data dimensions' price, as the strategy of the same layout prices it: fsdp's where they
    shard (HSDP where they replicate too: a replica holds its shard group's whole state), ddp's
    where they only replicate, one process's where there are none."""
    replicate, shard, _ = setup.mesh
    data = replicate * shard
    if shard > 1:
        p = fsdp.price(held, Setup("fsdp", data))
        p.memory_bytes += whole_bytes(held) * (1 / shard - 1 / data)
        return p
    if replicate > 1:
        return ddp.price(held, Setup("ddp", replicate))
    p = single.price(held, Setup("single", 1))
    p.parts["communication"] = held.sync_s
    return p


def price(m: Measured, setup: Setup) -> Prediction:
    """A mesh shape's step: its data dimensions' price on what one tensor rank holds and computes,
    and the tensor all-reduces of its activations, which nothing hides."""
    replicate, shard, tensor = setup.mesh
    split = _split(m, dict(setup.tensor_plan))
    data = _data_price(_held(m, setup, split), setup)
    count, volume = _tensor_traffic(m, setup)
    link = link_of(m, tensor)
    tensor_s = count * link.latency_s + volume / link.bandwidth
    parts = {**data.parts, "tensor": tensor_s}
    micro = math.ceil(m.batch / (m.accumulation * replicate * shard))
    reason = (
        f"each tensor group of {tensor} computes {micro} samples, {100 * split.share:.0f}% of "
        f"the FLOPs split {tensor} ways, in {ms(parts['compute'])}; its all-reduces of "
        f"{mb_text(volume)} of activations take {ms(tensor_s)}"
    )
    if replicate * shard > 1:
        reason += f", the data dimensions' {ms(parts['communication'])} not hidden"
    return made(m, setup, parts, data.memory_bytes, reason)


def label(setup: Setup) -> str:
    """The degrees above 1, as the plan's table names the row: "mesh shard 2 x tensor 2"."""
    if not setup.mesh:
        return f"mesh x{setup.devices}"
    shown = [f"{dim} {degree}" for dim, degree in zip(DIMS, setup.mesh, strict=True) if degree > 1]
    return " ".join(["mesh", " x ".join(shown)]) if shown else "mesh"


def readers(setup: Setup) -> int:
    """A tensor group's processes each fetch their group's shard."""
    return setup.mesh[0] * setup.mesh[1] if setup.mesh else setup.devices


def plan_settings(row: dict[str, Any]) -> dict[str, Any]:
    """The section that trains a plan's mesh row."""
    replicate, shard, tensor = row["mesh"]
    return {
        "mesh": {
            "replicate": replicate,
            "shard": shard,
            "tensor": tensor,
            "tensor_plan": dict(row["tensor_plan"]),
        }
    }


def accumulation_setup(cfg: Config, devices: int) -> Callable[[Measured], Setup]:
    """`gradient_accumulation: auto` under the config's mesh: its degrees and its plan, the config
    checked first as its run will check it (degrees whose product is not `devices`: one error)."""
    from phalanx import strategies

    strategies.check(cfg, devices)
    layout = cfg.parallel.section("mesh", registry.get("mesh").settings)
    shape = (layout.replicate, layout.shard, layout.tensor)

    def setup(m: Measured) -> Setup:
        plan = plan_for(m, layout.tensor) if layout.tensor > 1 else {}
        return Setup("mesh", devices, mesh=shape, tensor_plan=tuple(plan.items()))

    return setup


def notes(m: Measured, predictions: list[Prediction]) -> list[str]:
    """Where a mesh row would be the fastest on faster links but is not on the measured ones: in
    one line, the bandwidth from which it would be."""
    found = pays_from(m, predictions)
    if found is None:
        return []
    scale, winner = found
    tensor = winner.setup.mesh[2]
    have = bus_bandwidth(link_of(m, tensor).bandwidth, tensor)
    needed = bus_bandwidth(link_of(_faster(m, scale), tensor).bandwidth, tensor)
    kind = ", an NVLink-class GPU link" if needed >= NVLINK_CLASS else ""
    return [
        f"tensor parallelism does not pay on the measured links ({have / 1e9:.2f} GB/s between "
        f"{tensor} devices): on links {scale:.1f}x as fast ({needed / 1e9:.1f} GB/s{kind}), "
        f"{label(winner.setup)} would be the fastest setup"
    ]


def pays_from(m: Measured, predictions: list[Prediction]) -> tuple[float, Prediction] | None:
    """Where the fastest setup that fits is not a mesh row, but would be with every link measured
    on this machine faster (up to `FASTEST_LINK`): the least such factor (to 1%), and that mesh
    row's prediction there; else None. Each setup keeps its micro-batches a step: what fits does
    not depend on the links."""
    best = next((p for p in predictions if p.fits), None)
    if best is None or best.setup.strategy == "mesh":
        return None
    contenders = _contenders(predictions)
    measured = [x.bandwidth for x in m.all_reduce.values() if x.source == "measured"]
    if not any(s.strategy == "mesh" for s, _ in contenders) or not measured:
        return None

    def fastest(scale: float) -> Prediction | None:
        faster = _faster(m, scale)
        priced = [pricing.predict(replace(faster, accumulation=a), s) for s, a in contenders]
        winner = min((p for p in priced if p.fits), key=lambda p: p.step_s, default=None)
        return winner if winner is not None and winner.setup.strategy == "mesh" else None

    low, high = 1.0, max(FASTEST_LINK / max(measured), 1.0)
    if fastest(high) is None:
        return None
    while high > 1.01 * low:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if fastest(middle) is not None else (middle, high)
    winner = fastest(high)
    return (high, winner) if winner is not None else None


def _contenders(predictions: list[Prediction]) -> list[tuple[Setup, int]]:
    """Every mesh row, and each other strategy's best row at each device count and stage count,
    with the micro-batches a step each was priced at."""
    out, seen = [], set()
    for p in predictions:
        key = (p.setup.strategy, p.setup.devices, p.setup.stages)
        if p.setup.strategy == "mesh" or key not in seen:
            seen.add(key)
            out.append((p.setup, p.accumulation))
    return out


def _faster(m: Measured, scale: float) -> Measured:
    """The measurements with the links measured on this machine `scale` times the bandwidth (the
    links assumed between machines as they are)."""

    def sped(link: Link) -> Link:
        return (
            replace(link, bandwidth=link.bandwidth * scale) if link.source == "measured" else link
        )

    p2p = sped(m.p2p) if m.p2p is not None else None
    return replace(m, all_reduce={n: sped(x) for n, x in m.all_reduce.items()}, p2p=p2p)


def bus_bandwidth(bandwidth: float, tensor: int) -> float:
    """A ring all-reduce's bus bandwidth, the figure GPU links are quoted in: each device sends
    2 (T-1)/T of the bytes reduced (`bandwidth`: bytes reduced a second)."""
    return bandwidth * 2 * (tensor - 1) / tensor
