"""The pipeline's schedules, in one table: the names `parallel.pipeline.schedule` takes, each one's
class by `torch.distributed.pipelining.schedules.get_schedule_class`'s names, how it lays stages
on processes, and what the planner prices of it. The settings' choices, the strategy's checks and
the costs all read `SCHEDULES`.

The table holds torch's names, not its classes: torch's pipelining module takes a second to import,
and the config's schema (which lists the choices) is built by every process, pipeline or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from phalanx.costs import (
    Measured,
    Prediction,
    Setup,
    balanced_split,
    link_of,
    made,
    mb_text,
    ms,
)
from phalanx.strategies.pricing import compute_of


@dataclass(frozen=True)
class Schedule:
    torch_name: str  # its class by `get_schedule_class`
    per_process: int  # stages a process holds by default
    in_v: bool  # two stages a process in a V (process p: stages p and 2P - 1 - p), else looped
    # its conditions on the micro-batch count: at least one a stage; in rounds of one a process
    fills: bool
    in_rounds: bool
    # the idle slots a pipeline of P processes pays per step, in its busiest process's slots of
    # one micro-batch: GPipe and 1F1B P - 1; two stages a process halve them; the zero-bubble
    # schedules fill about two thirds of what is left with the backward's weight halves
    # (approximations of the schedules' own tables, for ranking)
    bubble: float
    description: str


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("GPipe", 1, False, False, False, 1.0, "every forward, then every backward"),
    "1f1b": Schedule(
        "1F1B", 1, False, True, False, 1.0, "one forward, one backward (fewer activations held)"
    ),
    "interleaved": Schedule(
        "Interleaved1F1B",
        2,
        False,
        False,
        True,
        0.5,
        "1f1b over several stages per process (a smaller bubble)",
    ),
    "zero_bubble": Schedule(
        "InterleavedZeroBubble",
        2,
        False,
        False,
        True,
        1 / 6,
        "interleaved, each backward split into its input and weight halves",
    ),
    "zbv": Schedule("ZBVZeroBubble", 2, True, False, False, 1 / 6, ""),
    "dualpipev": Schedule("DualPipeV", 2, True, True, False, 1 / 6, ""),
}


def describe() -> str:
    """The settings' description of the schedules, from the table."""
    said = [f"{name}: {s.description}" for name, s in SCHEDULES.items() if s.description]
    v = [name for name, s in SCHEDULES.items() if s.in_v]
    return (
        "; ".join(said)
        + f"; {' and '.join(v)}: two stages per process in a V (process p: stages p and 2P - 1 - "
        "p), zero-bubble, and DualPipe's overlap of one micro-batch's forward with another's "
        "backward"
    )


def torch_class(name: str) -> Any:
    """The schedule's class in torch."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(SCHEDULES[name].torch_name)


def takes_stages(name: str) -> bool:
    """Whether torch's schedule runs several stages a process (it takes a list of them)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(torch_class(name), PipelineScheduleMulti)


def stages_of(name: str, processes: int, stages: int) -> list[list[int]]:
    """Each process's stages: one each; in a V (p and 2P - 1 - p) for the V schedules; else looped
    (p, p + P, ...)."""
    if stages == processes:
        return [[k] for k in range(processes)]
    if SCHEDULES[name].in_v:
        return [[k, 2 * processes - 1 - k] for k in range(processes)]
    return [list(range(k, stages, processes)) for k in range(processes)]


# --- what `phalanx plan` prices of a pipeline (and of a placement, one micro-batch in turn) ---


def setups(m: Measured, devices: int) -> list[Setup]:
    """The pipelines up to `devices` devices: each schedule at each depth, copies and micro-batch
    count that its conditions allow, the chain cut evenly by the blocks' time."""
    out = []
    for stages in range(2, devices + 1):  # processes in a copy of the pipeline
        for name, schedule in SCHEDULES.items():
            per = schedule.per_process
            split = balanced_split(m.blocks, per * stages)
            if split is None:
                continue
            for copies in range(1, devices // stages + 1):
                for mb in (1, 2, 4, 8, 16):
                    # interleaved 1F1B with one micro-batch: the stages alternate between the
                    # processes, taking turns (the placement study's exaggerated split)
                    alternating = name == "interleaved" and mb == 1 and copies == 1
                    if per > 1 and (mb < stages or mb % stages or copies > 1) and not alternating:
                        continue  # their schedules' own conditions; one copy here
                    out.append(Setup("pipeline", stages * copies, stages, mb, name, tuple(split)))
    return out


def label(setup: Setup) -> str:
    copies = setup.devices // setup.stages
    more = f" x{copies} copies" if copies > 1 else ""
    return f"pipeline {setup.stages} stages{more}, {setup.microbatches} mb, {setup.schedule}"


def price(m: Measured, setup: Setup, pipelined: bool = True) -> Prediction:
    """A pipeline's step, or with `pipelined` False a placement's (one process taking turns
    through the devices): the busiest process's compute, the bubble of filling and draining, the
    messages at the cuts, and the memory of its stages' state and activations in flight."""
    p, mb = setup.stages, setup.microbatches  # processes in a copy of the pipeline
    copies = setup.devices // p
    index = {b.name: i for i, b in enumerate(m.blocks)}
    bounds = [0, *(index[n] for n in setup.split), len(m.blocks)]
    shares, held = _parts(m, bounds)
    mine = stages_of(setup.schedule, p, len(shares))  # each process's stages
    share = max(sum(shares[k] for k in ks) for ks in mine)  # the busiest process's part
    micro = math.ceil(m.batch / (m.accumulation * copies * mb))
    whole = compute_of(m, setup).time(micro)
    if pipelined:  # processes on one machine slow each other while both compute
        whole *= 1 + (m.crowding - 1) * _together(p, mb, copies)
    slot = share * whole  # the busiest process's forward and backward of one micro-batch
    crossing = max(m.blocks[i].input_bytes_per_sample for i in bounds[1:-1]) * micro
    # each micro-batch's activation goes forward and its gradient back at each of the process's
    # cuts (one stage a process has one; two, two); one micro-batch alone crosses every cut in
    # turn, nothing beside it
    crossings = SCHEDULES[setup.schedule].per_process if mb > 1 else len(shares) - 1
    message = 0.0 if m.p2p is None else 2 * crossings * m.p2p.time(crossing)
    compute = m.accumulation * mb * slot
    # too few micro-batches to fill the pipeline leave nothing for a cleverer schedule to overlap
    idle = SCHEDULES[setup.schedule].bubble if mb >= p else 1.0
    # filling and draining: a micro-batch passes every stage, the others' while the busiest waits
    # (P - 1 of its slots where the stages are even; one micro-batch: the whole model in turn)
    bubble = m.accumulation * idle * max(whole - slot, 0.0)
    messages = m.accumulation * mb * (message + m.microbatch_s)
    communication = messages
    if pipelined:  # the step's loss and stop flag, agreed by every process
        communication += link_of(m, setup.devices).latency_s + m.sync_s
        if copies > 1:  # each stage's copies add their gradients
            communication += link_of(m, copies).time(share * m.grad_bytes)
    state = max(sum(held[k] for k in ks) for ks in mine)
    state *= 1 + (m.grad_bytes + m.optimizer_bytes) / max(m.param_bytes, 1)
    in_flight = mb if setup.schedule == "gpipe" else min(mb, p)
    memory = state + in_flight * m.activation_bytes_per_sample * micro * share
    parts = {
        "compute": compute,
        "bubble": bubble,
        "communication": communication,
        "optimizer": m.optimizer_s * share,
    }
    stages = f"{len(shares)} stages on {p} processes" if len(shares) != p else f"{p} stages"
    reason = (
        f"{mb} micro-batch{'es' if mb != 1 else ''} of {micro} through {stages}, the busiest "
        f"process {ms(slot)} each: a bubble of {ms(bubble)}, {ms(messages)} of messages "
        f"({mb_text(crossing)} at a cut)"
    )
    return made(m, setup, parts, memory, reason)


def _parts(m: Measured, bounds: list[int]) -> tuple[list[float], list[float]]:
    """Each stage's share of the step's time and the parameter bytes it holds, the model's
    modules around the chain halved between the first stage and the last."""
    shares = [sum(b.share for b in m.blocks[lo:hi]) for lo, hi in pairwise(bounds)]
    held = [float(sum(b.param_bytes for b in m.blocks[lo:hi])) for lo, hi in pairwise(bounds)]
    outside = max(0.0, 1.0 - sum(shares))  # the model's modules around the chain
    shares[0] += outside / 2
    shares[-1] += outside / 2
    rest = (m.param_bytes - sum(held)) / 2
    held[0] += rest
    held[-1] += rest
    return shares, held


def _together(processes: int, microbatches: int, copies: int) -> float:
    """The share of a pipeline's step in which its processes compute at once: none with one
    micro-batch (they take turns), the steady state's `mb - 1` of its `mb + P - 1` slots with more;
    copies side by side always."""
    if copies > 1:
        return 1.0
    return (microbatches - 1) / (microbatches + processes - 1)
