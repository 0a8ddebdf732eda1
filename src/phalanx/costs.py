"""The planner's cost model: from what was measured on the machine at hand (`Measured`), each
candidate setup's step time, throughput, scaling and peak memory per device, and the reason for
its verdict in numbers. Pure arithmetic, no torch and no clock: `planner` measures, this predicts,
and the tests feed it synthetic measurements.

Every setup trains the same global batch (the contract), so a setup is faster exactly when its
step is shorter. A step is the roofline of its parts: compute (the measured forward and backward
of a micro-batch, `fixed + per_sample * b`, so that a small shard does not pay less than a call
costs), the communication that computation does not hide, a pipeline's bubble and its messages,
and the optimizer on the parameters a device holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev")
TWO_A_PROCESS = ("interleaved", "zero_bubble", "zbv", "dualpipev")  # stages per process: 2
# the idle slots a pipeline of P processes pays per step, in its busiest process's slots of one
# micro-batch, by schedule: GPipe and 1F1B P - 1; two stages a process halve them; the
# zero-bubble schedules fill about two thirds of what is left with the backward's weight halves
# (approximations of the schedules' own tables, for ranking)
_BUBBLE = {
    "gpipe": 1.0,
    "1f1b": 1.0,
    "interleaved": 0.5,
    "zero_bubble": 1 / 6,
    "zbv": 1 / 6,
    "dualpipev": 1 / 6,
}
# a process's cuts a micro-batch crosses, each way: one stage a process has one; two, two
_CROSSINGS = {s: 2 if s in TWO_A_PROCESS else 1 for s in SCHEDULES}


@dataclass(frozen=True)
class Link:
    """A collective's or a message's time: `latency_s + bytes / bandwidth`; `source` says where
    the figures come from (measured, or a table of known links)."""

    latency_s: float
    bandwidth: float  # bytes per second
    source: str = "measured"

    def time(self, nbytes: float) -> float:
        return self.latency_s + max(nbytes, 0.0) / self.bandwidth


@dataclass(frozen=True)
class Compute:
    """One forward and backward of `b` samples on one device: `fixed_s + per_sample_s * b`."""

    fixed_s: float
    per_sample_s: float
    backward_share: float = 2 / 3  # of a forward and backward, the backward's

    def time(self, samples: float) -> float:
        return self.fixed_s + self.per_sample_s * samples if samples > 0 else 0.0


@dataclass(frozen=True)
class Block:
    """One block of the model's largest chain (what a pipeline or a placement splits)."""

    name: str
    share: float  # of the whole model's forward and backward time
    param_bytes: int
    input_bytes_per_sample: float  # the activation entering it: what a cut before it sends
    cut_before: bool  # whether a stage may start here (the model passes one tensor to it)


@dataclass(frozen=True)
class Measured:
    batch: int  # samples an optimizer step (the global batch)
    accumulation: int  # micro-batches a step
    compute: Compute
    optimizer_s: float  # the optimizer's step over the whole model
    param_bytes: int
    grad_bytes: int  # the trainable parameters'
    optimizer_bytes: int
    activation_bytes_per_sample: float  # what backward keeps of a forward, per sample
    device_memory: int  # bytes one device offers
    all_reduce: dict[int, Link]  # by process count
    p2p: Link | None = None  # a message between two processes
    blocks: tuple[Block, ...] = ()
    chain: str = ""  # the chain's module name
    # the share of a backward that a reduction overlapping it hides (NCCL on its own stream: all;
    # gloo on CPU cores that the backward keeps busy: little)
    overlap: float = 1.0
    gpus: int = 0
    # how much slower a device computes while the others on its machine compute too
    crowding: float = 1.0
    # what a step of several processes pays beyond its collectives' own time: waiting for the
    # slowest process, waking the communication threads (from a measured ddp step)
    sync_s: float = 0.0
    fsdp_unit_s: float = 0.0  # what fsdp pays a unit and micro-batch beyond its collectives
    microbatch_s: float = 0.0  # what a pipeline pays a micro-batch beyond its stages and messages
    refused: dict[str, str] = field(default_factory=dict)  # strategies that cannot train it: why
    data_s_per_sample: float = 0.0  # fetching and collating a sample, in the training loop
    # one process's compute in a setup of several processes, by their count, where it differs from
    # `compute` (one process alone): on the CPU each has its share of the cores, not all of them
    computes: dict[int, Compute] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Measured:
        """The measurements as a plan wrote them (`plan.json`'s "measured"), to price again: the
        same predictions without measuring anything."""
        return cls(
            **{
                **raw,
                "compute": Compute(**raw["compute"]),
                "computes": {int(n): Compute(**c) for n, c in raw.get("computes", {}).items()},
                "all_reduce": {int(n): Link(**link) for n, link in raw["all_reduce"].items()},
                "p2p": Link(**raw["p2p"]) if raw.get("p2p") else None,
                "blocks": tuple(Block(**block) for block in raw.get("blocks", ())),
            }
        )


@dataclass(frozen=True)
class Setup:
    strategy: str
    devices: int
    stages: int = 1
    microbatches: int = 1
    schedule: str = ""
    split: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.strategy != "pipeline":
            return f"{self.strategy} x{self.devices}" if self.devices > 1 else self.strategy
        copies = self.devices // self.stages
        more = f" x{copies} copies" if copies > 1 else ""
        return f"pipeline {self.stages} stages{more}, {self.microbatches} mb, {self.schedule}"


@dataclass
class Prediction:
    setup: Setup
    step_s: float
    memory_bytes: float  # the peak on the fullest device
    fits: bool
    parts: dict[str, float]  # seconds a step: compute, communication, bubble, optimizer
    reason: str
    samples_per_s: float = 0.0
    accumulation: int = 1  # micro-batches a step it was priced at
    speedup: float = 1.0  # one device's step time over this one's
    efficiency: float = 1.0  # the speedup over the device count
    notes: list[str] = field(default_factory=list)


def compute_of(m: Measured, setup: Setup) -> Compute:
    """What a process of `setup` computes with: towers and placement are one process."""
    alone = setup.strategy in ("single", "towers", "placement")
    return m.compute if alone else m.computes.get(setup.devices, m.compute)


def predict(m: Measured, setup: Setup) -> Prediction:
    """One setup's prediction (its speedup filled in by `rank`)."""
    kind = {
        "single": _single,
        "ddp": _ddp,
        "towers": _ddp,
        "fsdp": _fsdp,
        "pipeline": _pipeline,
        "placement": _pipeline,
    }[setup.strategy]
    prediction = kind(m, setup)
    if m.data_s_per_sample:  # each process fetches the samples it computes on (all of its copy's)
        readers = {"ddp": setup.devices, "fsdp": setup.devices}.get(setup.strategy, 1)
        if setup.strategy == "pipeline":
            readers = setup.devices // setup.stages
        prediction.parts["data"] = m.data_s_per_sample * math.ceil(m.batch / readers)
        prediction.step_s += prediction.parts["data"]
    prediction.samples_per_s = m.batch / prediction.step_s if prediction.step_s > 0 else 0.0
    return prediction


def candidates(m: Measured, devices: int) -> list[Setup]:
    """Every setup up to `devices` devices that the measurements can price."""
    out = [Setup("single", 1)]
    for n in range(2, devices + 1):
        out += [Setup("ddp", n), Setup("fsdp", n)]
        if m.gpus >= n:
            out.append(Setup("towers", n))
    for stages in range(2, devices + 1):  # processes in a copy of the pipeline
        for schedule in SCHEDULES:
            per = 2 if schedule in TWO_A_PROCESS else 1
            split = balanced_split(m.blocks, per * stages)
            if split is None:
                continue
            for copies in range(1, devices // stages + 1):
                for mb in (1, 2, 4, 8, 16):
                    # interleaved 1F1B with one micro-batch: the stages alternate between the
                    # processes, taking turns (the placement study's exaggerated split)
                    alternating = schedule == "interleaved" and mb == 1 and copies == 1
                    if per > 1 and (mb < stages or mb % stages or copies > 1) and not alternating:
                        continue  # their schedules' own conditions; one copy here
                    setup = Setup("pipeline", stages * copies, stages, mb, schedule, tuple(split))
                    out.append(setup)
        split = balanced_split(m.blocks, stages)
        if m.gpus >= stages and split is not None:
            out.append(Setup("placement", stages, stages, 1, "gpipe", tuple(split)))
    return [s for s in out if s.strategy not in m.refused]


def fitting(m: Measured, setup: Setup) -> Prediction:
    """The setup at the fewest micro-batches a step, from the measured count up by doubling, whose
    predicted peak fits a device (`gradient_accumulation: auto`); the last tried where none does."""
    accumulation = m.accumulation
    while True:
        prediction = predict(replace(m, accumulation=accumulation), setup)
        prediction.accumulation = accumulation
        if prediction.fits or accumulation >= m.batch:
            return prediction
        accumulation = min(2 * accumulation, m.batch)


def rank(m: Measured, setups: list[Setup], auto: bool = False) -> list[Prediction]:
    """The predictions, fastest first among those that fit, then those that do not; speedups and
    efficiencies against one device. `auto`: each setup at the fewest micro-batches a step that
    fit (`fitting`)."""
    predictions = [fitting(m, s) if auto else predict(m, s) for s in setups]
    for p in predictions:
        if not auto:
            p.accumulation = m.accumulation
    one = next((p.step_s for p in predictions if p.setup.strategy == "single"), None)
    for p in predictions:
        if one and p.step_s > 0:
            p.speedup = one / p.step_s
            p.efficiency = p.speedup / p.setup.devices
            if p.setup.devices > 1:
                p.reason += f": {p.speedup:.2f}x of one device"
    return sorted(predictions, key=lambda p: (not p.fits, p.step_s))


# --- the families ---------------------------------------------------------------------------


def _single(m: Measured, setup: Setup) -> Prediction:
    micro = math.ceil(m.batch / m.accumulation)
    compute = m.accumulation * m.compute.time(micro)
    memory = _whole(m) + m.activation_bytes_per_sample * micro
    return _made(
        m,
        setup,
        {"compute": compute, "optimizer": m.optimizer_s},
        memory,
        f"one device computes the batch of {m.batch} in {_ms(compute)}",
    )


def _ddp(m: Measured, setup: Setup) -> Prediction:
    n = setup.devices
    micro = math.ceil(m.batch / (m.accumulation * n))
    one = compute_of(m, setup).time(micro) * m.crowding
    compute = m.accumulation * one
    reduce = _link(m, n).time(m.grad_bytes)
    hidden = min(reduce, m.overlap * m.compute.backward_share * one)
    exposed = reduce - hidden
    memory = _whole(m) + m.activation_bytes_per_sample * micro
    what = "the gradients' sum over the GPUs" if setup.strategy == "towers" else "the all-reduce"
    if exposed > compute:
        reason = (
            f"{what} of {_mb(m.grad_bytes)} at {_rate(m.grad_bytes, reduce)} takes "
            f"{_ms(reduce)}, longer than the {_ms(compute)} of computing each device's "
            f"{micro} samples that it would overlap"
        )
    else:
        reason = (
            f"each device computes {micro} samples in {_ms(compute)}; {what} of "
            f"{_mb(m.grad_bytes)} takes {_ms(reduce)}, {_ms(exposed)} of it not hidden"
        )
    parts = {"compute": compute, "communication": exposed + m.sync_s, "optimizer": m.optimizer_s}
    return _made(m, setup, parts, memory, reason)


def _fsdp(m: Measured, setup: Setup) -> Prediction:
    n = setup.devices
    micro = math.ceil(m.batch / (m.accumulation * n))
    one = compute_of(m, setup).time(micro) * m.crowding
    compute = m.accumulation * one
    # each unit (a block of the chain, and the rest of the model) gathers its parameters for
    # each micro-batch's forward and again for its backward, and reduce-scatters its gradients
    # once a step: each collective moves what half an all-reduce of its bytes moves, and pays
    # its latency
    link = _link(m, n)
    units = fsdp_units(m)
    gathers = 2 * m.accumulation * units * link.time(m.param_bytes / (2 * units))
    scatter = units * link.time(m.grad_bytes / (2 * units))
    reduce = gathers + scatter
    hidden = min(reduce, m.overlap * m.compute.backward_share * compute)
    reduce += m.accumulation * units * m.fsdp_unit_s  # its own work around each collective
    exposed = reduce - hidden
    largest = max((b.param_bytes for b in m.blocks), default=m.param_bytes)
    memory = _whole(m) / n + largest + m.activation_bytes_per_sample * micro
    parts = {
        "compute": compute,
        "communication": exposed + m.sync_s,
        "optimizer": m.optimizer_s / n,
    }
    reason = (
        f"each device computes {micro} samples in {_ms(compute)}; gathering and scattering "
        f"{_mb(m.param_bytes)} of parameters takes {_ms(reduce)}, {_ms(exposed)} of it not hidden"
    )
    return _made(m, setup, parts, memory, reason)


def _pipeline(m: Measured, setup: Setup) -> Prediction:
    p, mb = setup.stages, setup.microbatches  # processes in a copy of the pipeline
    copies = setup.devices // p
    index = {b.name: i for i, b in enumerate(m.blocks)}
    bounds = [0, *(index[n] for n in setup.split), len(m.blocks)]
    shares = [sum(b.share for b in m.blocks[lo:hi]) for lo, hi in pairwise(bounds)]
    held = [float(sum(b.param_bytes for b in m.blocks[lo:hi])) for lo, hi in pairwise(bounds)]
    outside = max(0.0, 1.0 - sum(shares))  # the model's modules around the chain
    shares[0] += outside / 2
    shares[-1] += outside / 2
    rest = (m.param_bytes - sum(held)) / 2
    held[0] += rest
    held[-1] += rest
    mine = _stages_of(setup.schedule, p, len(shares))  # each process's stages
    share = max(sum(shares[k] for k in ks) for ks in mine)  # the busiest process's part
    micro = math.ceil(m.batch / (m.accumulation * copies * mb))
    whole = compute_of(m, setup).time(micro)
    if setup.strategy == "pipeline":  # processes on one machine slow each other while both compute
        whole *= 1 + (m.crowding - 1) * _together(p, mb, copies)
    slot = share * whole  # the busiest process's forward and backward of one micro-batch
    crossing = max(m.blocks[i].input_bytes_per_sample for i in bounds[1:-1]) * micro
    # each micro-batch's activation goes forward and its gradient back at each of the process's
    # cuts; one micro-batch alone crosses every cut in turn, nothing beside it
    crossings = _CROSSINGS[setup.schedule] if mb > 1 else len(shares) - 1
    message = 0.0 if m.p2p is None else 2 * crossings * m.p2p.time(crossing)
    compute = m.accumulation * mb * slot
    # too few micro-batches to fill the pipeline leave nothing for a cleverer schedule to overlap
    idle = _BUBBLE[setup.schedule] if mb >= p else 1.0
    # filling and draining: a micro-batch passes every stage, the others' while the busiest waits
    # (P - 1 of its slots where the stages are even; one micro-batch: the whole model in turn)
    bubble = m.accumulation * idle * max(whole - slot, 0.0)
    messages = m.accumulation * mb * (message + m.microbatch_s)
    communication = messages
    if setup.strategy == "pipeline":  # the step's loss and stop flag, agreed by every process
        communication += _link(m, setup.devices).latency_s + m.sync_s
        if copies > 1:  # each stage's copies add their gradients
            communication += _link(m, copies).time(share * m.grad_bytes)
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
        f"process {_ms(slot)} each: a bubble of {_ms(bubble)}, {_ms(messages)} of messages "
        f"({_mb(crossing)} at a cut)"
    )
    return _made(m, setup, parts, memory, reason)


def _together(processes: int, microbatches: int, copies: int) -> float:
    """The share of a pipeline's step in which its processes compute at once: none with one
    micro-batch (they take turns), the steady state's `mb - 1` of its `mb + P - 1` slots with more;
    copies side by side always."""
    if copies > 1:
        return 1.0
    return (microbatches - 1) / (microbatches + processes - 1)


def _stages_of(schedule: str, processes: int, stages: int) -> list[list[int]]:
    """Each process's stages: one each; looped (p, p + P, ...) for interleaved and zero_bubble; in
    a V (p and 2P - 1 - p) for zbv and dualpipev."""
    if stages == processes:
        return [[k] for k in range(processes)]
    if schedule in ("zbv", "dualpipev"):
        return [[k, 2 * processes - 1 - k] for k in range(processes)]
    return [list(range(k, stages, processes)) for k in range(processes)]


# --- helpers ------------------------------------------------------------------------------


def _made(
    m: Measured, setup: Setup, parts: dict[str, float], memory: float, reason: str
) -> Prediction:
    fits = memory <= m.device_memory
    if not fits:
        reason = f"does not fit: {_mb(memory)} a device of {_mb(m.device_memory)}; " + reason
    return Prediction(setup, sum(parts.values()), memory, fits, parts, reason)


def _whole(m: Measured) -> float:
    return m.param_bytes + m.grad_bytes + m.optimizer_bytes


def _link(m: Measured, n: int) -> Link:
    """The all-reduce over `n` processes: measured, or the nearest measured count's."""
    if n in m.all_reduce:
        return m.all_reduce[n]
    if not m.all_reduce:
        raise ValueError("no all-reduce was measured")
    nearest = min(m.all_reduce, key=lambda k: abs(k - n))
    return m.all_reduce[nearest]


def partition(
    times: list[float], stages: int, valid: set[int], holds: list[bool]
) -> list[int] | None:
    """Where `stages` contiguous stages of the blocks start (each after the first at a `valid`
    point, each holding a block with parameters) so that the slowest stage is the fastest it can
    be; None where no such cut exists."""
    n = len(times)
    sums = [0.0]
    for t in times:
        sums.append(sums[-1] + t)
    owns = [0]
    for h in holds:
        owns.append(owns[-1] + int(h))
    starts = [0, *sorted(i for i in valid if 0 < i < n)]
    inf = float("inf")
    # best[k][i]: the slowest stage of blocks [0, i) cut into k stages; back[k][i]: the last start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in [*starts[1:], n] if k < stages else [n]:
            for j in starts:
                if j >= i or best[k - 1][j] == inf or owns[i] == owns[j]:
                    continue
                cost = max(best[k - 1][j], sums[i] - sums[j])
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    if best[stages][n] == inf:
        return None
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = back[k][i]
        cuts.append(i)
    return sorted(cuts)


def fsdp_units(m: Measured) -> int:
    """The units fsdp shards the model into: each block of the chain that holds parameters, and
    the rest of the model."""
    return 1 + sum(1 for b in m.blocks if b.param_bytes)


def balanced_split(blocks: tuple[Block, ...], stages: int) -> list[str] | None:
    """The module names where stages 2.. start, the slowest stage by the blocks' time as fast as
    it can be (None where the blocks cannot be cut into `stages`)."""
    if len(blocks) < stages:
        return None
    cut = partition(
        [b.share for b in blocks],
        stages,
        {i for i, b in enumerate(blocks) if b.cut_before},
        [b.param_bytes > 0 for b in blocks],
    )
    return None if cut is None else [blocks[i].name for i in cut]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _mb(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    return f"{nbytes / 1024:.1f} KB"


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-12) / 1e9:.2f} GB/s"
