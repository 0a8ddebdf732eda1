"""What `phalanx plan` measures in the processes a job would start: their computation side by
side, a real ddp, fsdp and pipeline step, and the bare links (the backend's all-reduce and a
message between two processes); and how those figures calibrate the cost model's links to what
training pays for them.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from phalanx import config, costs, environment
from phalanx.errors import ConfigError, PhalanxError
from phalanx.strategies import pricing

# bytes: the messages that measure a link's latency
SMALL = 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(trainer: Any, batch: Mapping) -> dict:
    """The batch as the engine gives it to the model: on the device, in the precision's dtype."""
    device = trainer.strategy.device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    precision = trainer.precision
    return batch if precision.passes_through else dict(precision.convert_batch(batch, None))


def links(
    one: list[str],
    config_path: str,
    devices: int,
    threads: int | None,
    grad_bytes: int,
    split: list[str] | None = None,
) -> dict[str, Any]:
    """What `devices` processes started as the job's would be measure: each one's forward and
    backward of its shard while the others run theirs (processes that share a machine slow each
    other), the same step under ddp (its communication as training pays it: the reduction, the
    waiting for the slowest, the threads that compete with computation), and the bare links: the
    all-reduce over 2..`devices` processes and a message between two, at a small size and at
    the gradients' (at least 256 KiB, at most 64 MiB); and where they can, an fsdp step and a
    pipeline's (`split`, 4 micro-batches, 1f1b), for what each costs beyond its collectives.
    `one`: the overrides that make the config one device's."""
    from phalanx import launch

    large = int(min(max(grad_bytes, 256 << 10), 64 << 20))
    with tempfile.TemporaryDirectory(prefix="phalanx-plan-") as tmp:
        folder = Path(tmp)
        launch.launch(folder, devices, links_worker, config_path, one, threads, large, split)
        found = json.loads((folder / "links.json").read_text())
    return found


def pipelined(split: list[str]) -> list[str]:
    """The overrides of the pipeline the links worker times: `split` at those blocks, 4
    micro-batches. The names are quoted (JSON is YAML's flow style): a Sequential's are numbers."""
    return [
        "parallel.strategy=pipeline",
        "parallel.pipeline=" + json.dumps({"split": split, "microbatches": 4}),
    ]


def measured_steps(split: list[str] | None) -> str:
    """The steps `links` measures, in words."""
    return f"a step of ddp, fsdp{' and a pipeline' if split else ''}"


def _link(small: int, large: int, t_small: float, t_large: float) -> costs.Link:
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    return costs.Link(max(t_small - small / bandwidth, 1e-7), bandwidth)


def links_worker(
    folder: Path,
    config_path: str,
    one: list[str],
    threads: int | None,
    large: int,
    split: list[str] | None,
) -> int:
    """One process of `links`: rank 0 writes links.json."""
    import torch.distributed as dist

    from phalanx import batching
    from phalanx.data import Micro, get_stream
    from phalanx.trainer import Trainer

    if threads is not None:
        torch.set_num_threads(threads)
    place = environment.here()
    world, rank = place.world_size, place.rank
    cfg = config.load(config_path, [*one, "parallel.strategy=ddp", f"parallel.devices={world}"])[0]
    trainer = Trainer(cfg, None, [Path(config_path).resolve().parent, Path.cwd()], hooks=[])
    strategy = trainer.strategy
    device = strategy.device
    micro = math.ceil(cfg.dataset.batch_size / cfg.parallel.accumulation)
    shard = [i for i in range(micro) if i % world == rank]
    stream = get_stream(trainer.dataset, "train")
    batch = batching.collate([stream[i] for i in shard])
    if batch is None:
        raise ConfigError(
            f"a micro-batch of {micro} samples leaves process {rank} of {world} none to measure; "
            "plan for fewer devices (--devices), or a larger dataset.batch_size"
        )
    step = [(Micro(shard, micro), batch)]
    found: dict[str, Any] = {"all_reduce": {}}
    # the shard's forward and backward on a copy of the model: the first process alone, then
    # every process at once, with no reduction
    found["compute_alone"] = _forward_backward(trainer, batch, device, rank == 0)
    found["compute_side_by_side"] = _gathered_max(
        _forward_backward(trainer, batch, device, True), device
    )
    found["ddp_step"] = _gathered_max(_step_seconds(trainer, step, device), device)
    others = [*one, f"parallel.devices={world}"]
    found["fsdp_step"] = _strategy_step(config_path, [*others, "parallel.strategy=fsdp"], step)
    if split:
        whole = [
            (
                Micro(list(range(micro)), micro),
                batching.collate([stream[i] for i in range(micro)]),
            )
        ]
        found["pipeline_step"] = _strategy_step(config_path, [*others, *pipelined(split)], whole)
    sizes = (SMALL, large)
    for n in range(2, world + 1):
        sub = dist.new_group(list(range(n)))  # every process makes every group
        if rank < n:
            found["all_reduce"][n] = [
                _time_op(lambda x, g=sub: dist.all_reduce(x, group=g), size, device)
                for size in sizes
            ]
        dist.barrier()
    if rank < 2:
        other = 1 - rank

        def round_trip(x: torch.Tensor) -> None:
            if rank == 0:
                dist.send(x, other)
                dist.recv(x, other)
            else:
                dist.recv(x, other)
                dist.send(x, other)

        found["p2p"] = [_time_op(round_trip, size, device) / 2 for size in sizes]
    found["sizes"] = list(sizes)
    dist.barrier()
    if rank == 0:
        (folder / "links.json").write_text(json.dumps(found))
    strategy.shutdown()
    return 0


def linears(trainer: Any, step: list) -> tuple[costs.Linear, ...]:
    """The model's Linear layers as one training step first calls them: each one's features and
    parameter bytes, the bytes a sample's input and output take, its share of the step's FLOPs
    (as torch's counter counts them: matrix products), and the Linear whose output it takes
    through operations of one input each (`fed_by`): what the plan prices a tensor plan from."""
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    samples = max(len(step[0][0].shard), 1)
    layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, nn.Linear)}
    names: dict[nn.Module, str] = {m: n for n, m in layers.items()}
    found: dict[str, dict[str, Any]] = {}
    made_by: dict[Any, str] = {}  # the autograd node of a Linear's output -> the Linear

    def called(module: nn.Module, args: tuple, output: Any) -> None:
        name = names[module]
        if name in found or not args or not isinstance(output, torch.Tensor):
            return
        x, layer = args[0], layers[name]
        rows = x.numel() // max(layer.in_features, 1)
        # forward, and backward's products for the weight's and the input's gradients
        products = 1 + int(layer.weight.requires_grad) + int(x.requires_grad)
        found[name] = {
            "input": x.numel() * x.element_size() / samples,
            "output": output.numel() * output.element_size() / samples,
            "flops": products * 2 * rows * layer.in_features * layer.out_features,
            "fed_by": _fed_by(x, made_by),
            "input_grad": x.requires_grad,
        }
        if output.grad_fn is not None:
            made_by[output.grad_fn] = name

    handles = [m.register_forward_hook(called) for m in names]
    try:
        with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
            # the counter's own module hooks, which a compiled model calls once more: harmless
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there")
            trainer.train_step(step)
    finally:
        for handle in handles:
            handle.remove()
    total = max(counter.get_total_flops(), sum(f["flops"] for f in found.values()), 1)
    return tuple(
        costs.Linear(
            name,
            layers[name].in_features,
            layers[name].out_features,
            sum(p.numel() * p.element_size() for p in layers[name].parameters()),
            f["input"],
            f["output"],
            f["flops"] / total,
            f["fed_by"],
            f["input_grad"],
        )
        for name, f in found.items()
    )


def _fed_by(x: torch.Tensor, made_by: Mapping[Any, str]) -> str:
    """The Linear whose output `x` is, through operations of one input each (an activation,
    dropout, a cast), or "" (the data, a sum of two, a norm with parameters)."""
    node = x.grad_fn
    while node is not None and node not in made_by:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return ""
        node = inputs[0]
    return made_by.get(node, "") if node is not None else ""


def _forward_backward(trainer: Any, batch: Mapping, device: torch.device, runs_here: bool) -> float:
    """The median seconds of the batch's forward and backward through a copy of the model, where
    `runs_here` (the others wait at the same barriers)."""
    import copy

    from phalanx.model import Forward

    model = copy.deepcopy(trainer.model)
    call = Forward(model, trainer.cfg.model, trainer.search_dirs)
    batch = on_device(trainer, batch)
    runs = []
    for k in range(7):
        torch.distributed.barrier()
        if not runs_here:
            continue
        synchronize(device)
        start = time.perf_counter()
        loss = call(batch)["loss"]
        loss.sum().backward()
        synchronize(device)
        if k >= 2:
            runs.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(runs) if runs else 0.0


def _strategy_step(config_path: str, overrides: list[str], step: list) -> float | str:
    """The slowest process's step of the config under `overrides` (less its optimizer's), or why
    the strategy cannot train the model (every process fails alike as it builds)."""
    from phalanx.trainer import Trainer

    try:
        cfg = config.load(config_path, overrides)[0]
        trainer = Trainer(cfg, None, [Path(config_path).resolve().parent, Path.cwd()], hooks=[])
    except PhalanxError as e:
        return str(e)
    seconds = _step_seconds(trainer, step, trainer.strategy.device)
    return _gathered_max(seconds, trainer.strategy.device)


def _step_seconds(trainer: Any, step: list, device: torch.device) -> float:
    """The median seconds of the trainer's step (its strategy's), less its optimizer's."""
    runs = []
    for k in range(7):
        torch.distributed.barrier()
        synchronize(device)
        start = time.perf_counter()
        outcome = trainer.train_step(step)
        synchronize(device)
        if k >= 2:
            runs.append(time.perf_counter() - start - outcome.optimizer_s)
    return statistics.median(runs)


def _gathered_max(seconds: float, device: torch.device) -> float:
    """The slowest process's figure: a step lasts as long as its slowest process."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _time_op(op: Any, nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """The median seconds of `op` on a float32 tensor of `nbytes`, after two to warm up."""
    x = torch.zeros(max(1, nbytes // 4), device=device)
    runs = []
    for k in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        op(x)
        synchronize(device)
        if k >= 2:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def calibrated(
    m: costs.Measured, found: dict[str, Any], devices: int, split: list[str] | None = None
) -> costs.Measured:
    """The measured links, and what training pays beyond them: from the ddp step of `devices`
    processes, beyond their computation side by side, the time its reduction took more than the
    bare all-reduce (waiting for the slowest process, waking threads: every step of several
    processes pays it), or how much of the reduction backward hid; how much slower each process
    computes beside the others; and what an fsdp step pays a unit, and a pipeline's a
    micro-batch, beyond what the model prices (hooks, gathering, the schedule's own work)."""
    small, large = found["sizes"]
    reduce = {int(n): _link(small, large, *t) for n, t in found["all_reduce"].items()}
    bare = reduce[devices].time(m.grad_bytes)
    crowding = max(found["compute_side_by_side"] / max(found["compute_alone"], 1e-9), 1.0)
    micro = math.ceil(m.batch / (m.accumulation * devices))
    # as priced
    computing = pricing.compute_of(m, costs.Setup("ddp", devices)).time(micro) * crowding
    exposed = max(found["ddp_step"] - computing, 0.0)
    backward = m.compute.backward_share * computing
    sync, overlap = max(exposed - bare, 0.0), 0.0
    if exposed < bare:
        overlap = min(1.0, (bare - exposed) / max(backward, 1e-9))
    m = replace(
        m,
        all_reduce=reduce,
        p2p=_link(small, large, *found["p2p"]),
        overlap=overlap,
        crowding=crowding,
        sync_s=sync,
    )
    # the workers measured one micro-batch a step
    one = replace(m, accumulation=1)
    if isinstance(found.get("fsdp_step"), str):
        m = replace(m, refused={**m.refused, "fsdp": found["fsdp_step"]})
    elif found.get("fsdp_step") is not None:
        priced = pricing.predict(one, costs.Setup("fsdp", devices))
        paid = priced.parts["compute"] + priced.parts["communication"]
        from phalanx.strategies.fsdp import units as fsdp_units

        units = fsdp_units(m)
        m = replace(m, fsdp_unit_s=max(found["fsdp_step"] - paid, 0.0) / units)
    if isinstance(found.get("pipeline_step"), str):
        refused = found["pipeline_step"]
        m = replace(m, refused={**m.refused, "pipeline": refused, "placement": refused})
    elif split and found.get("pipeline_step") is not None:
        setup = costs.Setup("pipeline", devices, devices, 4, "1f1b", tuple(split))
        parts = pricing.predict(one, setup).parts
        paid = parts["compute"] + parts["bubble"] + parts["communication"]
        m = replace(m, microbatch_s=max(found["pipeline_step"] - paid, 0.0) / 4)
    return m
