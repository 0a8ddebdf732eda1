"""`phalanx plan`: will more devices help? Measure the config's model on the machine at hand for a
few seconds (one device's forward and backward at several micro-batch sizes, the optimizer's
step, the bytes it holds, each block of its largest chain, each Linear layer, and the links that
the candidate setups would use), price every setup up to the devices asked for (`costs`), print
them ranked with the reason for each verdict, and write plan.json.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from rich.table import Table

from phalanx import config, costs, logs, strategies
from phalanx.errors import ConfigError, PhalanxError
from phalanx.files import check_output, write_text_atomic
from phalanx.probes import calibrated, linears, links, measured_steps, on_device, synchronize
from phalanx.strategies import pricing, registry

log = logging.getLogger("phalanx")

# links between machines that cannot be measured from one: (latency s, bytes/s); the plan says
# which one it assumed
KNOWN_LINKS = {
    "ethernet-10g": (50e-6, 1.25e9),
    "ethernet-25g": (30e-6, 3.1e9),
    "ethernet-100g": (20e-6, 12.5e9),
    "infiniband-hdr": (5e-6, 25e9),
}


# the most devices a plan prices: it prices every setup up to the devices asked for, a number of
# setups that grows with them (seconds at this bound)
MAX_DEVICES = 1024


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
    if here * nnodes > MAX_DEVICES:
        raise ConfigError(
            f"--nnodes {nnodes}: the plan prices every setup up to {here} x {nnodes} devices, "
            f"and it plans for {MAX_DEVICES:,} at most; give --nnodes {MAX_DEVICES // here} or "
            f"fewer (with {here} device(s) a machine), or fewer --devices"
        )
    if link not in KNOWN_LINKS:  # a misspelt link is said on one machine too, where none is used
        raise ConfigError(f"--link {link!r} is not a known link; use one of {list(KNOWN_LINKS)}")
    if output:  # before minutes of measuring
        check_output(output, "plan.json")
    threads = _threads(cfg, accelerator, here, here * nnodes)
    auto = _auto(cfg)
    measured = measure(config_path, _one(cfg, overrides, accelerator), accelerator, here, threads)
    measured = _across_machines(measured, here, nnodes, link)
    predictions = pricing.rank(measured, pricing.candidates(measured, here * nnodes), auto)
    report = {
        "config": str(config_path),
        "accelerator": accelerator,
        "devices_per_machine": here,
        "machines": nnodes,
        "cpu_threads_per_process": None if accelerator == "cuda" else threads,
        "auto_accumulation": auto,
        "measured": _jsonable(asdict(measured)),
        "predictions": [_row(p) for p in predictions],
        "not_planned": unplanned(measured, here * nnodes),
        "notes": notes(measured, predictions),
        "seconds": time.perf_counter() - started,
    }
    if show:
        _print(predictions, measured, report)
    if output:
        write_text_atomic(Path(output), json.dumps(report, indent=1))
        logs.out.print(f"wrote {output}")
    return report


def _one(cfg: config.Config, overrides: list[str], accelerator: str) -> list[str]:
    """The overrides that make the config one device's, trained by this process."""
    return [
        *overrides,
        *(["~model.n_gpus"] if cfg.model.n_gpus is not None else []),
        *(
            ["parallel.gradient_accumulation=1"]
            if cfg.parallel.gradient_accumulation == "auto"
            else []
        ),
        f"parallel.strategy={registry.auto(several=False)}",
        "parallel.devices=1",
        f"parallel.accelerator={accelerator}",
        "main_loop.extra_streams=[]",
        "hooks=[]",
    ]


def _threads(cfg: config.Config, accelerator: str, here: int, most: int) -> dict[int, int]:
    """torch's threads in each process of a setup of 1..`most` processes (at most `here` a machine),
    by the setup's process count, as the runs will set them (`strategies.cpu_threads`): one
    process alone keeps this one's. On GPUs the threads do not compute: this process's for all."""
    own = torch.get_num_threads()
    if accelerator == "cuda":
        return dict.fromkeys(range(1, most + 1), own)
    setting = cfg.parallel.cpu_threads
    return {n: strategies.cpu_threads(setting, min(n, here)) or own for n in range(1, most + 1)}


def _auto(cfg: config.Config) -> bool:
    return cfg.parallel.gradient_accumulation == "auto"


def accumulation_for(config_path: str, overrides: list[str]) -> tuple[int, str]:
    """`parallel.gradient_accumulation: auto`: the fewest micro-batches a step whose predicted
    peak memory fits each device under the config's own strategy and devices (measured on one
    device, in this process, for a few seconds); and what to log about it."""
    cfg = config.load(config_path, overrides)[0]
    accelerator, devices = strategies.resolve_device(cfg)
    name = strategies.strategy_name(cfg)
    family = registry.get(name)
    # the setup to price, from the measurements (a strategy that cannot be priced refuses here,
    # before anything is measured)
    if family.cost is None:
        raise ConfigError(
            f"parallel.gradient_accumulation=auto prices the step's peak memory under the run's "
            f"strategy, and the plan does not price {name}; give a number"
        )
    setup_of = (
        family.accumulation_setup(cfg, devices)
        if family.accumulation_setup is not None
        else lambda m: costs.Setup(name, devices)
    )
    # the run's own processes' threads: what one device is measured with (the memory is what
    # counts here)
    threads = {1: _threads(cfg, accelerator, devices, devices)[devices]}
    m = measure(config_path, _one(cfg, overrides, accelerator), accelerator, 1, threads)
    # one device measured, and no link: the peak memory decides here, which no link changes
    unmeasured = costs.Link(0.0, math.inf, "not measured: memory alone decides")
    m = replace(
        m,
        device_memory=_device_memory(cfg, accelerator, devices),
        all_reduce=dict.fromkeys(range(2, devices + 1), unmeasured),
    )
    setup = setup_of(m)
    p = pricing.fitting(m, setup)
    said = (
        f"parallel.gradient_accumulation=auto chose {p.accumulation}: a predicted peak of "
        f"{costs.mb_text(p.memory_bytes)} of {costs.mb_text(m.device_memory)} a device "
        f"({pricing.label(setup)})"
    )
    if not p.fits:
        sharding = " or ".join(n for n, f in registry.families().items() if f.shards_state)
        raise ConfigError(
            f"parallel.gradient_accumulation=auto found no count that fits: {said}; lower "
            f"dataset.batch_size, or use more devices or {sharding}"
        )
    return p.accumulation, said


def choose(config_path: str, overrides: list[str], devices: int | None) -> tuple[dict, dict]:
    """`parallel.strategy: plan`: the plan of the config (with the strategy left to it) on this
    machine, up to `devices`; returns the `parallel` settings of its fastest setup that fits and
    that a config can name, and the plan's report (its `choice` says which and why)."""
    report = plan(config_path, [*overrides, "parallel.strategy=auto"], devices, output=None)
    for p in report["predictions"]:
        # a row's own settings; None where a config cannot name it (devices by module)
        own = registry.get(p["strategy"]).plan_settings(p) if p["fits"] else None
        if own is None:
            continue
        settings: dict[str, Any] = {"strategy": p["strategy"], "devices": p["devices"]}
        if report["auto_accumulation"]:
            settings["gradient_accumulation"] = p["accumulation"]
        settings.update(own)
        accumulated = (
            f" with gradient_accumulation={p['accumulation']} (auto)"
            if report["auto_accumulation"]
            else ""
        )
        report["choice"] = (
            f"parallel.strategy=plan chose {p['setup']}{accumulated}: predicted "
            f"{p['step_ms']:.1f} ms a step, {p['speedup']:.2f}x of one device ({p['reason']})"
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
    threads: Mapping[int, int],
) -> costs.Measured:
    """Everything the cost model needs, measured in this process and, for the links, in
    `devices` processes started as the job's would be. `threads`: torch's threads in each process
    of a setup, by its process count; the computation is measured at each count, and this
    process's own threads are as they were after."""
    own = torch.get_num_threads()
    try:
        return _measure(config_path, one, accelerator, devices, threads)
    finally:
        torch.set_num_threads(own)


def _measure(
    config_path: str,
    one: list[str],
    accelerator: str,
    devices: int,
    threads: Mapping[int, int],
) -> costs.Measured:
    from phalanx import batching
    from phalanx.data import Micro, get_stream
    from phalanx.model import Forward
    from phalanx.trainer import Trainer

    torch.set_num_threads(threads[1])
    cfg = config.load(config_path, one)[0]
    search = [Path(config_path).resolve().parent, Path.cwd()]
    log.info("plan: building the model and the dataset on one %s device", accelerator)
    try:
        trainer = Trainer(cfg, None, search, hooks=[])
    except PhalanxError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's model or dataset failed to build
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"the config does not build: {type(e).__name__}: {first}") from e
    batch = cfg.dataset.batch_size
    accumulation = cfg.parallel.accumulation
    stream = get_stream(trainer.dataset, "train")
    largest = min(math.ceil(batch / accumulation), len(stream))

    def fetched(b: int) -> list:
        return [(Micro(list(range(b)), b), batching.collate([stream[i] for i in range(b)]))]

    sizes = sorted({largest, max(1, math.ceil(largest / devices)), max(1, math.ceil(largest / 16))})
    log.info(
        "plan: timing one device's training step (7 of each) at micro-batches of %s samples",
        ", ".join(map(str, sizes)),
    )
    steps = {b: fetched(b) for b in sizes}
    compute, optimizer = _compute(trainer, steps)
    # a process of several computes with its share of the cores: measured at each share
    at: dict[int, costs.Compute] = {threads[1]: compute}
    for n in sorted(threads):
        if n > 1 and threads[n] not in at:
            torch.set_num_threads(threads[n])
            at[threads[n]] = _compute(trainer, steps)[0]
    torch.set_num_threads(threads[1])
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
    log.info(
        "plan: measuring the memory a step's backward keeps, the time to load a batch, each "
        "block of the model's largest chain and each Linear layer (for tensor parallelism)"
    )
    activations = _activation_bytes(trainer, fetched(largest), params) / largest
    data = _data_time(stream, largest)
    blocks, chain = _blocks(trainer, Forward(model, cfg.model, search), fetched(largest), compute)
    layers = linears(trainer, fetched(largest))
    cuda = accelerator == "cuda"
    measured = costs.Measured(
        batch=batch,
        accumulation=accumulation,
        compute=compute,
        computes={n: at[t] for n, t in threads.items() if n > 1 and at[t] is not compute},
        optimizer_s=optimizer,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=activations,
        data_s_per_sample=data,
        device_memory=_device_memory(cfg, accelerator, devices),
        all_reduce={},
        blocks=blocks,
        chain=chain,
        gpus=torch.cuda.device_count() if cuda else 0,
        linears=layers,
        settings=_sections(cfg),
    )
    if devices < 2:
        return measured
    split = costs.balanced_split(blocks, devices)
    log.info(
        "plan: starting %d processes to measure the links between them and %s on them",
        devices,
        measured_steps(split),
    )
    found = links(one, config_path, devices, threads[devices], grad_bytes, split)
    return calibrated(measured, found, devices, split)


def _sections(cfg: config.Config) -> dict[str, Any]:
    """The config's own section of each strategy that has one, as the plan.json keeps it."""
    out = {}
    for name in registry.sections():
        section = getattr(cfg.parallel, name, None)
        if section is not None:
            # a settings model, or a plain mapping (placement's)
            plain = isinstance(section, BaseModel)
            out[name] = section.model_dump(mode="json") if plain else section
    return out


def _compute(trainer: Any, steps: Mapping[int, list]) -> tuple[costs.Compute, float]:
    """The forward and backward of each batch size's step (the fastest of 5, after 2 that warm
    up), fitted to `fixed + per_sample * b`; and the optimizer's step (the median)."""
    times, optimizer = {}, []
    for b, step in steps.items():
        for _ in range(2):  # warm-up: the first steps allocate
            trainer.train_step(step)
        runs = []
        for _ in range(5):
            synchronize(trainer.strategy.device)
            start = time.perf_counter()
            outcome = trainer.train_step(step)
            synchronize(trainer.strategy.device)
            runs.append((time.perf_counter() - start - outcome.optimizer_s, outcome.optimizer_s))
        times[b] = min(r[0] for r in runs)
        optimizer.append(statistics.median(r[1] for r in runs))
    return _fit(times), statistics.median(optimizer)


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
    from phalanx import batching

    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        batching.collate([stream[i] for i in range(samples)])
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


def _blocks(
    trainer: Any, call: Any, step: list, compute: costs.Compute
) -> tuple[tuple[costs.Block, ...], str]:
    """The blocks of the model's largest chain, each's share of the step's time (none where the
    model has no chain of two blocks)."""
    from phalanx.strategies.cutting import chain_of

    (micro, batch) = step[0]
    model = trainer.model
    batch = on_device(trainer, batch)
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


def _device_memory(cfg: config.Config, accelerator: str, devices: int) -> int:
    if cfg.parallel.device_memory_gb is not None:
        return int(cfg.parallel.device_memory_gb * (1 << 30))
    if accelerator == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // devices)  # the processes share the machine's memory


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
        "setup": pricing.label(p.setup),
        "strategy": p.setup.strategy,
        "devices": p.setup.devices,
        "stages": p.setup.stages,
        "microbatches": p.setup.microbatches,
        "schedule": p.setup.schedule,
        "split": list(p.setup.split),
        "mesh": list(p.setup.mesh),
        "tensor_plan": dict(p.setup.tensor_plan),
        "step_ms": 1e3 * p.step_s,
        "samples_per_s": p.samples_per_s,
        "speedup": p.speedup,
        "efficiency": p.efficiency,
        "memory_bytes": p.memory_bytes,
        "fits": p.fits,
        "accumulation": p.accumulation,
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
            pricing.label(p.setup),
            f"{1e3 * p.step_s:.1f}",
            f"{p.samples_per_s:,.0f}",
            f"{p.speedup:.2f}x",
            f"{100 * p.efficiency:.0f}%",
            costs.mb_text(p.memory_bytes),
            p.reason,
        )
    logs.out.print(table)
    best = predictions[0]
    if best.setup.strategy == registry.auto(several=False):
        logs.out.print(
            "one device is the fastest: more devices would make this config's steps slower"
        )
    else:
        logs.out.print(f"fastest: {pricing.label(best.setup)}, {best.speedup:.2f}x of one device")
    left = report["not_planned"]
    for why in dict.fromkeys(left.values()):
        logs.out.print(
            f"not planned: {', '.join(n for n, said in left.items() if said == why)}: {why}"
        )
    for note in report["notes"]:
        logs.out.print(note)
    sources = {link.source for link in m.all_reduce.values()}
    if m.p2p is not None:
        sources.add(m.p2p.source)
    logs.out.print(f"links: {', '.join(sorted(sources)) or 'none needed'}")
    threads = report["cpu_threads_per_process"]
    if threads:  # as each setup's runs will have them, which the plan measured with
        most = max(threads)
        said = [f"{threads[1]} for one process"] + [
            f"{t} each for {n}"
            for n, t in threads.items()
            if n > 1 and (t != threads[n - 1] or n == most)
        ]
        logs.out.print(f"CPU threads: {', '.join(said)} (parallel.cpu_threads)")


def unplanned(m: costs.Measured, devices: int) -> dict[str, str]:
    """The strategies the plan has no row for, and why: those that cannot train the model
    (`m.refused`), and those that the devices, this machine or the model leave out."""
    out = dict(m.refused)
    for name, family in registry.families().items():
        why = family.unplanned(m, devices) if family.unplanned is not None else None
        if why:
            out.setdefault(name, why)
    return out


def notes(m: costs.Measured, predictions: list[costs.Prediction]) -> list[str]:
    """What each strategy says under the table about its rows (`Family.notes`)."""
    return [
        line
        for family in registry.families().values()
        if family.notes is not None
        for line in family.notes(m, predictions)
    ]


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
