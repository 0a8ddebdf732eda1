"""The planner's cost model: from what was measured on the machine at hand (`Measured`), each
candidate setup's step time, throughput, scaling and peak memory per device, and the reason for
its verdict in numbers. Pure arithmetic, no clock: `planner` measures, this predicts, and the
tests feed it synthetic measurements. Each strategy prices its own setups (its
`registry.Family.setups` and `cost`, in its module) and `strategies.pricing` asks each; this module
holds the measurements, the setups and the arithmetic they share.

Every setup trains the same global batch (the contract), so a setup is faster exactly when its
step is shorter. A step is the roofline of its parts: compute (the measured forward and backward
of a micro-batch, `fixed + per_sample * b`, so that a small shard does not pay less than a call
costs), the communication that computation does not hide, the bubble of stages and their messages,
and the optimizer on the parameters a device holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """One block of the model's largest chain (what a split into stages cuts)."""

    name: str
    share: float  # of the whole model's forward and backward time
    param_bytes: int
    input_bytes_per_sample: float  # the activation entering it: what a cut before it sends
    cut_before: bool  # whether a stage may start here (the model passes one tensor to it)


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of the model, in the order its forward first calls them: what a tensor plan
    splits."""

    name: str
    in_features: int
    out_features: int
    param_bytes: int
    input_bytes_per_sample: float
    output_bytes_per_sample: float
    share: float  # of the FLOPs of the step's forward and backward that torch counts
    # the Linear whose output this one's input is, through operations of one input each (an
    # activation, dropout), or "": a pair a tensor plan splits colwise then rowwise
    fed_by: str = ""
    input_grad: bool = True  # whether backward computes its input's gradient (not the data's)


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
    # slowest process, waking the communication threads (from a measured step of one process a
    # device)
    sync_s: float = 0.0
    fsdp_unit_s: float = 0.0  # what fsdp pays a unit and micro-batch beyond its collectives
    microbatch_s: float = 0.0  # what stages pay a micro-batch beyond their compute and messages
    refused: dict[str, str] = field(default_factory=dict)  # strategies that cannot train it: why
    data_s_per_sample: float = 0.0  # fetching and collating a sample, in the training loop
    # one process's compute in a setup of several processes, by their count, where it differs from
    # `compute` (one process alone): on the CPU each has its share of the cores, not all of them
    computes: dict[int, Compute] = field(default_factory=dict)
    linears: tuple[Linear, ...] = ()
    # the config's own section of each strategy (`parallel.<name>`, as pydantic dumps it): what a
    # strategy's setups start from (the mesh's tensor plan)
    settings: dict[str, Any] = field(default_factory=dict)

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
                "linears": tuple(Linear(**linear) for linear in raw.get("linears", ())),
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
    mesh: tuple[int, ...] = ()  # the mesh strategy's degrees: replicate, shard, tensor
    tensor_plan: tuple[tuple[str, str], ...] = ()  # (module name, style), in the model's order


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


# --- helpers ------------------------------------------------------------------------------


# why the plan has no row of a strategy, where the devices or the model leave it out
ONE_DEVICE = "one device is planned for; give --devices 2 or more"
NO_CHAIN = (
    "the model has no chain of blocks to cut (an nn.Sequential or nn.ModuleList whose blocks its "
    "forward calls in turn, each passing one tensor to the next)"
)


def gpus_here(m: Measured) -> str:
    """The GPUs of the machine measured, in words."""
    return f"this machine has {m.gpus or 'no'} GPU{'' if m.gpus == 1 else 's'}"


def made(
    m: Measured, setup: Setup, parts: dict[str, float], memory: float, reason: str
) -> Prediction:
    fits = memory <= m.device_memory
    if not fits:
        reason = (
            f"does not fit: {mb_text(memory)} a device of {mb_text(m.device_memory)}; " + reason
        )
    return Prediction(setup, sum(parts.values()), memory, fits, parts, reason)


def whole_bytes(m: Measured) -> float:
    return m.param_bytes + m.grad_bytes + m.optimizer_bytes


def link_of(m: Measured, n: int) -> Link:
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


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def mb_text(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    return f"{nbytes / 1024:.1f} KB"


def rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-12) / 1e9:.2f} GB/s"
