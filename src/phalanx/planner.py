"""`phalanx plan`: will more devices help? Measure the config's model on the machine at hand for a
few seconds (one device's forward and backward at several micro-batch sizes, the optimizer's
step, the bytes it holds, each block of its largest chain, and the links that the candidate
setups would use), price every setup up to the devices asked for (`costs`), print them ranked with
the reason for each verdict, and write plan.json.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from phalanx import config, costs, environment, logs, strategies
from phalanx.errors import ConfigError, PhalanxError
from phalanx.files import write_text_atomic

# links between machines that cannot be measured from one: (latency s, bytes/s); the plan says
# which one it assumed
KNOWN_LINKS = {
    "ethernet-10g": (50e-6, 1.25e9),
    "ethernet-25g": (30e-6, 3.1e9),
    "ethernet-100g": (20e-6, 12.5e9),
    "infiniband-hdr": (5e-6, 25e9),
}
SMALL = 1024  # bytes: the messages that measure a link's latency


def plan(
    config_path: str,
    overrides: list[str],
    devices: int | None = None,
    nnodes: int = 1,
    link: str = "ethernet-10g",
    output: str | None = "plan.json",
    show: bool = True,
) -> dict[str, Any]:
    """Measure, predict, print the ranked table (where `show`) and write `output` (where given);
    returns what it writes."""
    started = time.perf_counter()
    cfg, _ = config.load(config_path, overrides)
    accelerator, _ = strategies.resolve_device(cfg)
    here = _devices_here(accelerator, devices)
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be 1 or more, got {nnodes}")
    if nnodes > 1 and link not in KNOWN_LINKS:
        raise ConfigError(f"--link {link!r} is not a known link; use one of {list(KNOWN_LINKS)}")
    threads = None if accelerator == "cuda" else max(1, strategies.cpu_cores() // here)
    one = [  # the config on one device, trained by this process
        *overrides,
        *(["~model.n_gpus"] if cfg.model.n_gpus is not None else []),
        "parallel.strategy=single",
        "parallel.devices=1",
        f"parallel.accelerator={accelerator}",
        "main_loop.extra_streams=[]",
        "hooks=[]",
    ]
    measured = measure(config_path, one, accelerator, here, threads)
    measured = _across_machines(measured, here, nnodes, link)
    predictions = costs.rank(measured, costs.candidates(measured, here * nnodes))
    report = {
        "config": str(config_path),
        "accelerator": accelerator,
        "devices_per_machine": here,
        "machines": nnodes,
        "cpu_threads_per_process": threads,
        "measured": _jsonable(asdict(measured)),
        "predictions": [_row(p) for p in predictions],
        "seconds": time.perf_counter() - started,
    }
    if show:
        _print(predictions, measured, report)
    if output:
        write_text_atomic(Path(output), json.dumps(report, indent=1))
        logs.out.print(f"wrote {output}")
    return report


def choose(config_path: str, overrides: list[str], devices: int | None) -> tuple[dict, dict]:
    """`parallel.strategy: plan`: the plan of the config (with the strategy left to it) on this
    machine, up to `devices`; returns the `parallel` settings of its fastest setup that fits and
    that a config can name, and the plan's report (its `choice` says which and why)."""
    report = plan(config_path, [*overrides, "parallel.strategy=auto"], devices, output=None)
    for p in report["predictions"]:
        if not p["fits"] or p["strategy"] == "placement":  # placement names devices by module
            continue
        settings: dict[str, Any] = {"strategy": p["strategy"], "devices": p["devices"]}
        if p["strategy"] == "pipeline":
            settings["pipeline"] = {
                "split": p["split"],
                "microbatches": p["microbatches"],
                "schedule": p["schedule"],
            }
        report["choice"] = (
            f"parallel.strategy=plan chose {p['setup']}: predicted {p['step_ms']:.1f} ms a step, "
            f"{p['speedup']:.2f}x of one device ({p['reason']})"
        )
        return settings, report
    raise ConfigError(
        "parallel.strategy=plan found no setup that fits this machine's devices (see the plan "
        "above); lower dataset.batch_size, or plan for more devices"
    )


# --- measuring ------------------------------------------------------------------------------


def measure(
    config_path: str,
    one: list[str],
    accelerator: str,
    devices: int,
    threads: int | None,
) -> costs.Measured:
    """Everything the cost model needs, measured in this process and, for the links, in
    `devices` processes started as the job's would be."""
    from phalanx import loading
    from phalanx.data import Micro, get_stream
    from phalanx.model import Forward
    from phalanx.trainer import Trainer

    if threads is not None:
        torch.set_num_threads(threads)
    cfg = config.load(config_path, one)[0]
    search = [Path(config_path).resolve().parent, Path.cwd()]
    try:
        trainer = Trainer(cfg, None, search, hooks=[])
    except PhalanxError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model or dataset failed to build
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"the config does not build: {type(e).__name__}: {first}") from e
    batch = cfg.dataset.batch_size
    accumulation = cfg.parallel.gradient_accumulation
    stream = get_stream(trainer.dataset, "train")
    largest = min(math.ceil(batch / accumulation), len(stream))

    def fetched(b: int) -> list:
        return [(Micro(list(range(b)), b), loading.collate([stream[i] for i in range(b)]))]

    sizes = sorted({largest, max(1, math.ceil(largest / devices)), max(1, math.ceil(largest / 16))})
    times, optimizer = {}, []
    for b in sizes:
        step = fetched(b)
        for _ in range(2):  # warm-up: the first steps allocate
            trainer.train_step(step)
        runs = []
        for _ in range(5):
            _sync(trainer.strategy.device)
            start = time.perf_counter()
            outcome = trainer.train_step(step)
            _sync(trainer.strategy.device)
            runs.append((time.perf_counter() - start - outcome.optimizer_s, outcome.optimizer_s))
        times[b] = min(r[0] for r in runs)
        optimizer.append(statistics.median(r[1] for r in runs))
    compute = _fit(times)
    model = trainer.model
    params = [p for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = trainer.optimizer.state_dict()["state"] if trainer.optimizer is not None else {}
    optimizer_bytes = sum(
        v.numel() * v.element_size()
        for s in state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )
    activations = _activation_bytes(trainer, fetched(largest), params) / largest
    data = _data_time(stream, largest)
    blocks, chain = _blocks(trainer, Forward(model, cfg.model, search), fetched(largest), compute)
    cuda = accelerator == "cuda"
    measured = costs.Measured(
        batch=batch,
        accumulation=accumulation,
        compute=compute,
        optimizer_s=statistics.median(optimizer),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=activations,
        data_s_per_sample=data,
        device_memory=_device_memory(accelerator, devices),
        all_reduce={},
        blocks=blocks,
        chain=chain,
        gpus=torch.cuda.device_count() if cuda else 0,
    )
    if devices < 2:
        return measured
    split = costs.balanced_split(blocks, devices)
    found = links(one, config_path, devices, threads, grad_bytes, split)
    return calibrated(measured, found, devices, split)


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
    computing = m.compute.time(micro) * crowding  # as the cost model prices it
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
    one = replace(m, accumulation=1)  # the workers measured one micro-batch a step
    if isinstance(found.get("fsdp_step"), str):
        m = replace(m, refused={**m.refused, "fsdp": found["fsdp_step"]})
    elif found.get("fsdp_step") is not None:
        priced = costs.predict(one, costs.Setup("fsdp", devices))
        paid = priced.parts["compute"] + priced.parts["communication"]
        units = costs.fsdp_units(m)
        m = replace(m, fsdp_unit_s=max(found["fsdp_step"] - paid, 0.0) / units)
    if isinstance(found.get("pipeline_step"), str):
        refused = found["pipeline_step"]
        m = replace(m, refused={**m.refused, "pipeline": refused, "placement": refused})
    elif split and found.get("pipeline_step") is not None:
        setup = costs.Setup("pipeline", devices, devices, 4, "1f1b", tuple(split))
        parts = costs.predict(one, setup).parts
        paid = parts["compute"] + parts["bubble"] + parts["communication"]
        m = replace(m, microbatch_s=max(found["pipeline_step"] - paid, 0.0) / 4)
    return m


def _devices_here(accelerator: str, asked: int | None) -> int:
    """The most devices on this machine the plan considers: those asked for, which it must have."""
    if accelerator == "cuda":
        have, what = torch.cuda.device_count(), "CUDA GPUs"
    else:
        have, what = strategies.cpu_cores(), "CPU cores (one process each)"
    if asked is None:
        return max(1, have)
    if asked < 1 or asked > have:
        raise ConfigError(
            f"--devices {asked}: this machine has {have} {what}; ask for 1 to {have}, or plan "
            "on the machine that will train"
        )
    return asked


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit(times: Mapping[int, float]) -> costs.Compute:
    """`fixed + per_sample * b` through the measured (b, seconds), by least squares (neither
    negative)."""
    sizes = list(times)
    if len(sizes) == 1:
        (b,) = sizes
        return costs.Compute(0.0, times[b] / b)
    mean_b = sum(sizes) / len(sizes)
    mean_t = sum(times.values()) / len(sizes)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    slope = sum((b - mean_b) * (times[b] - mean_t) for b in sizes) / spread
    slope = max(slope, 0.0)
    return costs.Compute(max(mean_t - slope * mean_b, 0.0), slope)


def _data_time(stream: Any, samples: int) -> float:
    """Seconds a sample costs the loop to fetch and collate (the fastest of 3 batches)."""
    from phalanx import loading

    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        loading.collate([stream[i] for i in range(samples)])
        best = min(best, time.perf_counter() - start)
    return best / samples


def _activation_bytes(trainer: Any, step: list, params: Sequence[torch.Tensor]) -> float:
    """What backward keeps of one forward: the tensors autograd saves, less the parameters."""
    owned = {p.untyped_storage().data_ptr() for p in params}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key[0] not in owned and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(step)
    return float(total)


def _on_device(trainer: Any, batch: Mapping) -> dict:
    """The batch as the engine gives it to the model: on the device, in the precision's dtype."""
    device = trainer.strategy.device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    precision = trainer.precision
    return batch if precision.passes_through else dict(precision.convert_batch(batch, None))


def _blocks(
    trainer: Any, call: Any, step: list, compute: costs.Compute
) -> tuple[tuple[costs.Block, ...], str]:
    """The blocks of the model's largest chain, each's share of the step's time (none where the
    model has no chain of two blocks)."""
    from phalanx.strategies.cutting import chain_of

    (micro, batch) = step[0]
    model = trainer.model
    batch = _on_device(trainer, batch)
    try:
        chain = chain_of(model, call, batch, 2)
    except ConfigError:
        return (), ""
    n = len(micro.shard)
    whole = max(1e3 * compute.time(n), sum(b.time_ms for b in chain.blocks), 1e-9)
    names = chain.names(list(range(len(chain.blocks))))
    return (
        tuple(
            costs.Block(name, b.time_ms / whole, b.param_bytes, b.input_bytes / n, b.cut_before)
            for name, b in zip(names, chain.blocks, strict=True)
        ),
        chain.name,
    )


def _device_memory(accelerator: str, devices: int) -> int:
    if accelerator == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // devices)  # the processes share the machine's memory


# --- the links ------------------------------------------------------------------------------


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

    from phalanx import loading
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
    micro = math.ceil(cfg.dataset.batch_size / cfg.parallel.gradient_accumulation)
    shard = [i for i in range(micro) if i % world == rank]
    stream = get_stream(trainer.dataset, "train")
    batch = loading.collate([stream[i] for i in shard])
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
    found["ddp_step"] = _gathered_max(_ddp_step(trainer, step, device), device)
    others = [*one, f"parallel.devices={world}"]
    found["fsdp_step"] = _strategy_step(config_path, [*others, "parallel.strategy=fsdp"], step)
    if split:
        whole = [
            (
                Micro(list(range(micro)), micro),
                loading.collate(list(map(stream.__getitem__, range(micro)))),
            )
        ]
        pipeline = f"parallel.pipeline={{split: [{', '.join(split)}], microbatches: 4}}"
        found["pipeline_step"] = _strategy_step(
            config_path, [*others, "parallel.strategy=pipeline", pipeline], whole
        )
    sizes = (SMALL, large)
    for n in range(2, world + 1):
        sub = dist.new_group(list(range(n)))  # every process makes every group
        if rank < n:
            found["all_reduce"][n] = [
                _timed(lambda x, g=sub: dist.all_reduce(x, group=g), size, device) for size in sizes
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

        found["p2p"] = [_timed(round_trip, size, device) / 2 for size in sizes]
    found["sizes"] = list(sizes)
    dist.barrier()
    if rank == 0:
        (folder / "links.json").write_text(json.dumps(found))
    strategy.shutdown()
    return 0


def _forward_backward(trainer: Any, batch: Mapping, device: torch.device, runs_here: bool) -> float:
    """The median seconds of the batch's forward and backward through a copy of the model, where
    `runs_here` (the others wait at the same barriers)."""
    import copy

    from phalanx.model import Forward

    model = copy.deepcopy(trainer.model)
    call = Forward(model, trainer.cfg.model, trainer.search_dirs)
    batch = _on_device(trainer, batch)
    runs = []
    for k in range(7):
        torch.distributed.barrier()
        if not runs_here:
            continue
        _sync(device)
        start = time.perf_counter()
        loss = call(batch)["loss"]
        loss.sum().backward()
        _sync(device)
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
    seconds = _ddp_step(trainer, step, trainer.strategy.device)
    return _gathered_max(seconds, trainer.strategy.device)


def _ddp_step(trainer: Any, step: list, device: torch.device) -> float:
    """The median seconds of the ddp step, less its optimizer's."""
    runs = []
    for k in range(7):
        torch.distributed.barrier()
        _sync(device)
        start = time.perf_counter()
        outcome = trainer.train_step(step)
        _sync(device)
        if k >= 2:
            runs.append(time.perf_counter() - start - outcome.optimizer_s)
    return statistics.median(runs)


def _gathered_max(seconds: float, device: torch.device) -> float:
    """The slowest process's figure: a step lasts as long as its slowest process."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _timed(op: Any, nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """The median seconds of `op` on a float32 tensor of `nbytes`, after two to warm up."""
    x = torch.zeros(max(1, nbytes // 4), device=device)
    runs = []
    for k in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        op(x)
        _sync(device)
        if k >= 2:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _across_machines(m: costs.Measured, here: int, nnodes: int, link: str) -> costs.Measured:
    """With several machines, the all-reduces over more processes than one machine has: the
    measured one over a machine's, slowed to the known link between machines."""
    if nnodes == 1:
        return m
    latency, bandwidth = KNOWN_LINKS[link]
    inner = m.all_reduce.get(here) if here > 1 else None
    reduce = dict(m.all_reduce)
    for n in range(here + 1, here * nnodes + 1):
        reduce[n] = costs.Link(
            latency + (inner.latency_s if inner else 0.0),
            min(bandwidth, inner.bandwidth) if inner else bandwidth,
            f"table: {link} (assumed, not measured)",
        )
    p2p = m.p2p or costs.Link(latency, bandwidth, f"table: {link} (assumed, not measured)")
    return replace(m, all_reduce=reduce, p2p=p2p)


# --- the report -----------------------------------------------------------------------------


def _row(p: costs.Prediction) -> dict[str, Any]:
    return {
        "setup": p.setup.label,
        "strategy": p.setup.strategy,
        "devices": p.setup.devices,
        "stages": p.setup.stages,
        "microbatches": p.setup.microbatches,
        "schedule": p.setup.schedule,
        "split": list(p.setup.split),
        "step_ms": 1e3 * p.step_s,
        "samples_per_s": p.samples_per_s,
        "speedup": p.speedup,
        "efficiency": p.efficiency,
        "memory_bytes": p.memory_bytes,
        "fits": p.fits,
        "parts_ms": {k: 1e3 * v for k, v in p.parts.items()},
        "reason": p.reason,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _print(predictions: list[costs.Prediction], m: costs.Measured, report: dict) -> None:
    shown = _shown(predictions)
    table = Table(
        title=f"phalanx plan: {report['config']}, {report['accelerator']}, up to "
        f"{report['devices_per_machine'] * report['machines']} device(s); global batch {m.batch}"
    )
    for column in ("", "setup", "step ms", "samples/s", "speedup", "efficiency", "memory", "why"):
        table.add_column(column, justify="left" if column in ("setup", "why") else "right")
    for i, p in enumerate(shown, 1):
        table.add_row(
            str(i),
            p.setup.label,
            f"{1e3 * p.step_s:.1f}",
            f"{p.samples_per_s:,.0f}",
            f"{p.speedup:.2f}x",
            f"{100 * p.efficiency:.0f}%",
            costs._mb(p.memory_bytes),
            p.reason,
        )
    logs.out.print(table)
    best = predictions[0]
    if best.setup.strategy == "single":
        logs.out.print(
            "one device is the fastest: more devices would make this config's steps slower"
        )
    else:
        logs.out.print(f"fastest: {best.setup.label}, {best.speedup:.2f}x of one device")
    for why in dict.fromkeys(m.refused.values()):
        refused = [name for name, said in m.refused.items() if said == why]
        logs.out.print(f"not planned: {', '.join(refused)}: {why}")
    sources = {link.source for link in m.all_reduce.values()}
    if m.p2p is not None:
        sources.add(m.p2p.source)
    logs.out.print(f"links: {', '.join(sorted(sources)) or 'none needed'}")


def _shown(predictions: list[costs.Prediction]) -> list[costs.Prediction]:
    """One row per family and device count (its best variant), at most 12, in rank order; every
    prediction stays in plan.json."""
    out, seen = [], set()
    for p in predictions:
        key = (p.setup.strategy, p.setup.devices, p.setup.stages)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out[:12]
