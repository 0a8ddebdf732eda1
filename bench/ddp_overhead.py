"""Per-step overhead of phalanx's `ddp` strategy against a hand-written DistributedDataParallel loop
(or, with `--strategy fsdp`, of its `fsdp` strategy against a hand-written FSDP2 loop; with
`--strategy mesh`, of its `mesh` strategy on data shard 2 x tensor 2, four processes, against the
loop one writes with `parallelize_module` and `fully_shard` on the same device mesh): two CPU
processes (four for mesh) joined by gloo on 127.0.0.1, one torch thread each, the tiny MLP and
in-memory dataset of bench/common.py, both loops taking turns every 20 steps inside each process.

    .venv/bin/python bench/ddp_overhead.py            # defaults: 60 epochs of 100 steps, ~1 min
    .venv/bin/python bench/ddp_overhead.py --strategy fsdp --out bench/results/fsdp_overhead.json
    .venv/bin/python bench/ddp_overhead.py --strategy mesh --rounds 20   # 4 processes
    .venv/bin/python bench/ddp_overhead.py --steps 100 --rounds 10 --out /tmp/ddp.json
    .venv/bin/python bench/ddp_overhead.py --tokens 16 --clip 1.0  # token-weighted, clipped
    .venv/bin/python bench/ddp_overhead.py --breakdown  # where phalanx's extra time goes, ~3 min
    .venv/bin/python bench/ddp_overhead.py --profile    # cProfile of phalanx's steps (no JSON)
    .venv/bin/python bench/ddp_overhead.py --samples    # each loop's CPU by library (no JSON)

What is timed (see BENCHMARKS.md): in each of the two processes,

1. *hand DDP*: `DistributedDataParallel(model)` with default settings (*hand FSDP2*: `fully_shard`
   on each Linear, then on the model, default settings; *hand TP + FSDP2*: `init_device_mesh` of
   (shard 2, tensor 2), `parallelize_module` with the first Linear colwise and the second rowwise
   on the tensor dimension, then `fully_shard` of each Linear and of the model on the shard
   dimension, the sampler's rank the shard coordinate), AdamW, a DataLoader whose
   batch sampler takes each global batch (2 x 64 samples) of a per-epoch permutation and yields
   this rank's contiguous half (no DistributedSampler: the same data work as phalanx), forward,
   `F.cross_entropy`, backward, step; the loss summed as `loss.detach()` every step and all-reduced
   once per epoch for logging.
2. *phalanx ddp*: a `Trainer` built from a config dict (`parallel.accelerator=cpu`,
   `parallel.devices=2`, global batch 128, the default hooks minus ShowProgress) inside the
   process group the benchmark opened; `strategies.create` sees RANK/WORLD_SIZE and returns DDP,
   which on CPUs reads each next batch while the step's gradient all-reduce runs, where the hand
   loop waits for it inside backward (*phalanx fsdp*: `parallel.strategy=fsdp`,
   `parallel.fsdp.shard=[Linear]`, as the hand loop shards).

The loops take turns every `--chunk` steps: a round is one chunk of phalanx, then one of hand DDP,
every chunk starting right after a barrier, so both ranks start it together. The machine changes
speed about once a second; chunks of 20 steps (well under 0.1 s) keep most pairs inside one speed,
where whole epochs did not. An epoch's set-up falls into its first chunk; the hand loop's
once-per-epoch loss all-reduce into its last, phalanx's once-per-epoch stop agreement
(`Trainer.any_rank`, one all-reduce) into the next epoch's first. phalanx's epoch end (after_epoch
hooks: statistics all-reduces, log, CSV, TensorBoard, SaveLatest checkpoint) is outside and timed
apart. A chunk's wall time for a loop is the slower rank's window; its CPU time is both ranks'
together.

`--samples` runs the same measurement under Linux perf (`perf record -e cpu-clock`, stamped with
the monotonic clock that each rank stamps its windows with) and gives each sample to the loop
whose window it falls in: each loop's main-thread samples by library (the interpreter, torch's
libraries, the C library, the kernel) and the other threads' in all, both ranks, the warm-up
left out. It needs `perf` and leave to sample the ranks (`kernel.perf_event_paranoid` 2 or lower
for one's own processes). The sampler slows both loops a little, so it writes no JSON.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch is imported, here and in the spawned ranks

import argparse  # noqa: E402
import bisect  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing as mp  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.common import (  # noqa: E402
    MLP,
    REGISTRY,
    against_hand,
    free_port,
    hand_steps,
    machine,
    make_items,
    make_sequences,
    measured_source,
    mlp_model,
    print_profile,
    print_results,
    summary,
    tensor_and_shard,
    with_epoch_end,
    write_report,
)

LR = 1e-3
DATA_KEY = "ddp_overhead"
FEATURES, CLASSES = 32, 10
WORLD = 2  # the data-parallel processes: each takes its half of a global batch
PROCESSES = 2  # the processes started: WORLD, times the tensor degree under mesh
TENSOR_PLAN = {"net.0": "colwise", "net.2": "rowwise"}  # MLP's first two Linears, under mesh
HAND, PHALANX, PHALANX_END = "hand DDP", "phalanx ddp", "phalanx incl. epoch end"
TARGETS = {
    "ddp": 1.03,
    "fsdp": 1.10,
    "mesh": 1.05,
}  # phalanx's allowed ratio to the hand loop, per strategy


def make_dataset(args) -> Any:
    n = args.steps * WORLD * args.batch_size
    return (
        make_sequences(n, args.tokens, FEATURES, CLASSES)
        if args.tokens
        else make_items(n, FEATURES, CLASSES)
    )


def name_loops(strategy: str) -> None:
    """The loops' names for `strategy` (in the parent and in each rank: the figures are keyed by
    them)."""
    global HAND, PHALANX, PROCESSES
    HAND, PHALANX = {
        "fsdp": ("hand FSDP2", "phalanx fsdp"),
        "mesh": ("hand TP + FSDP2", "phalanx mesh"),
    }.get(strategy, ("hand DDP", "phalanx ddp"))
    PROCESSES = 2 * WORLD if strategy == "mesh" else WORLD


LOSS_SETUP, SETUP = (
    "hand DDP, phalanx's loss and DDP options",
    "hand DDP, phalanx's set-up (+ carrier)",
)
NO_HOOKS = "phalanx ddp, no hooks"


def now() -> tuple[float, float]:
    """Wall-clock and this process's CPU time (all its threads, gloo's included)."""
    return time.perf_counter(), time.process_time()


def since(
    start: tuple[float, float], end: tuple[float, float] | None = None
) -> tuple[float, float]:
    end = end or now()
    return end[0] - start[0], end[1] - start[1]


# --- 1 and 2. the hand-written DDP loops ----------------------------------------------------------


class ShardBatches:
    """Batch sampler: global batches of a per-epoch permutation, each cut into contiguous per-rank
    pieces in rank order (as phalanx's data plan does); yields this rank's piece."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int = 0):
        self.n, self.global_batch, self.rank, self.world, self.seed = (
            n,
            global_batch,
            rank,
            world,
            seed,
        )
        self.epoch = 0

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        for begin in range(0, self.n, self.global_batch):
            batch = order[begin : begin + self.global_batch]
            base, extra = divmod(len(batch), self.world)
            lo = self.rank * base + min(self.rank, extra)
            yield batch[lo : lo + base + (self.rank < extra)]

    def __len__(self) -> int:
        return -(-self.n // self.global_batch)


class _WithCarrier(nn.Module):
    """The model and a two-element parameter beside it, as phalanx's ddp strategy sets DDP up: the
    parameter's gradient carries (loss share, stop flag) through DDP's own gradient all-reduce."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.carrier = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.module(x)


class HandDDP:
    """What one would write with torch's DistributedDataParallel and no framework, run a chunk of
    steps at a time.

    `like_phalanx`: the same loop with phalanx's set-up, by hand: DDP without the buffer broadcast
    and with gradients as bucket views, the per-sample loss (`cross_entropy(reduction="none")`,
    back-propagated with a 1/n gradient vector, then its mean for the log) and, unless `carrier` is
    False, the loss share and a stop flag carried through the gradient all-reduce in a parameter
    beside the model, written as its gradient and handed to DDP's reducer, read back after the
    step."""

    def __init__(
        self,
        dataset,
        args,
        rank: int,
        like_phalanx: bool = False,
        carrier: bool = True,
        name: str | None = None,
    ):
        self.name = name or HAND
        self.like_phalanx, self.carrier = like_phalanx, like_phalanx and carrier
        self.global_batch = WORLD * args.batch_size
        torch.manual_seed(0)
        module = MLP(FEATURES, args.hidden, CLASSES)
        if args.strategy == "mesh":
            self.model, rank = tensor_and_shard(module, WORLD, 2, TENSOR_PLAN)
        elif (
            args.strategy == "fsdp"
        ):  # the FSDP2 loop one writes: each layer a unit, then the model
            from torch.distributed.fsdp import fully_shard

            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            self.model = fully_shard(module)
        else:
            options = (
                {"broadcast_buffers": False, "gradient_as_bucket_view": True}
                if like_phalanx
                else {}
            )
            self.model = DistributedDataParallel(
                _WithCarrier(module) if self.carrier else module, **options
            )
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        self.sampler = ShardBatches(len(dataset), self.global_batch, rank, WORLD)
        self.loader = DataLoader(dataset, batch_sampler=self.sampler)
        self.steps_per_epoch = len(self.sampler)
        self.clip = args.clip
        self.epoch_losses: list[float] = []
        self.spans: list[tuple[float, float]] = []  # each chunk's start and end (monotonic)
        self._step, self._batches, self._total = 0, None, None

    def chunk(self, k: int) -> tuple[float, float]:
        """The next `k` steps of the current epoch, from a barrier; returns their window (wall, CPU
        seconds) on this rank. An epoch's set-up counts in its first chunk, its loss all-reduce in
        its last."""
        dist.barrier()
        start = now()
        if self._step == 0:
            self.sampler.epoch += 1
            self.model.train()
            self._batches, self._total = iter(self.loader), torch.zeros(())
        if self.like_phalanx:
            self._phalanx_like_steps(k)
        else:
            hand_steps(self.model, self.optimizer, self._batches, k, self._total, self.clip, WORLD)
        self._step += k
        if self._step == self.steps_per_epoch:
            dist.all_reduce(self._total)  # the epoch's mean loss over ranks, for the log
            # over every process (a tensor group's two hold one shard's loss alike)
            self.epoch_losses.append(self._total.item() / (self._step * PROCESSES))
            self._step = 0
        window = since(start)
        self.spans.append((start[0], start[0] + window[0]))
        return window

    def epoch(self, epoch: int) -> tuple[float, float]:
        """One whole epoch (the --breakdown mode's unit)."""
        return self.chunk(self.steps_per_epoch)

    def _phalanx_like_steps(self, k: int) -> None:
        model, optimizer, batches = self.model, self.optimizer, self._batches
        carrier = self.model.module.carrier if self.carrier else None
        no_stop, mark_ready = torch.zeros(()), model.reducer._autograd_hook
        gradients: dict[int, torch.Tensor] = {}  # 1/n per sample, kept as the engine keeps it
        for _ in range(k):
            batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
            n = len(loss)
            part = loss.detach().mean()
            if (
                carrier is not None
            ):  # each rank's half of the global mean, times the 2 that DDP divides by
                carrier.grad = torch.stack((part * (n * WORLD / self.global_batch), no_stop))
                mark_ready(0)  # the carrier is _WithCarrier's own parameter: the reducer's first
            gradient = gradients.get(n)
            if gradient is None:
                gradient = gradients[n] = torch.full((n,), 1.0 / n)
            loss.backward(gradient)
            optimizer.step()
            if carrier is not None:
                part, flag = carrier.grad.clone().unbind()
                flag.item()  # the stop flag, read on the host as phalanx reads it
            self._total += part


# --- 3. phalanx -----------------------------------------------------------------------------------


def phalanx_config(args, output_root: str) -> dict[str, Any]:
    """No `hooks:` key would mean the defaults; they are listed without ShowProgress."""
    return {
        "name": "ddp_overhead",
        "model": mlp_model(args.hidden, FEATURES, CLASSES),
        "optimizer": {
            "class": "AdamW",
            "lr": LR,
            **({"max_grad_norm": args.clip} if args.clip else {}),
        },
        # phalanx's batch_size is the global batch: WORLD x the per-rank batch of the hand loop
        "dataset": {
            "class": "bench.common.SharedStreams",
            "key": DATA_KEY,
            "batch_size": WORLD * args.batch_size,
        },
        "parallel": {
            "accelerator": "cpu",
            "devices": PROCESSES,
            "strategy": args.strategy,
            **({"fsdp": {"shard": ["Linear"]}} if args.strategy in ("fsdp", "mesh") else {}),
            **(
                {"mesh": {"shard": WORLD, "tensor": 2, "tensor_plan": TENSOR_PLAN}}
                if args.strategy == "mesh"
                else {}
            ),
        },
        "seed": 0,
        "main_loop": {"epochs": args.warmup + args.rounds},
        "output_root": output_root,
    }


def make_driver_hook(chunk: int, steps: int, on_chunk):
    """The last hook: times phalanx's chunks of `chunk` steps and, after each, calls
    `on_chunk(epoch)`, which runs the hand loop's chunk. Every phalanx window starts right after a
    barrier; the epoch end (after_epoch hooks) is timed apart, outside the windows. It works on this
    rank's own data (`gathers = False`); its after_batch is one comparison on most steps."""
    from phalanx.hooks import Hook

    class Driver(Hook):
        gathers = False  # a gathering hook would make the trainer all-gather every batch

        def __init__(self):
            self.start = (0.0, 0.0)
            self.windows: list[tuple[float, float]] = []
            # each window's start and end on the monotonic clock (perf_counter's, on Linux)
            self.spans: list[tuple[float, float]] = []
            self.epoch_ends: list[tuple[float, float]] = []

        def before_training(self) -> None:
            dist.barrier()
            self.start = now()

        def after_batch(self, stream: str, batch: dict) -> None:
            trainer = self.trainer
            if trainer.training and trainer.step_in_epoch % chunk == 0:
                window = since(self.start)
                self.windows.append(window)
                self.spans.append((self.start[0], self.start[0] + window[0]))
                on_chunk(trainer.epoch + 1)
                if trainer.step_in_epoch == steps:  # the epoch end comes next: its own figure
                    self.start = now()
                else:
                    dist.barrier()
                    self.start = now()

        def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
            self.epoch_ends.append(since(self.start))
            dist.barrier()
            self.start = now()

    return Driver()


def build_phalanx(args, run_root: Path, driver):
    """A Trainer as `phalanx train` builds one in each worker (`worker.build_worker_trainer`):
    logs on rank 0 (log.txt kept, the console copy dropped), the config checked alike on every
    rank, the launcher's stop file watched; its hooks those the config lists, then `driver`."""
    from phalanx import __version__, config, launch, logs, rundir, strategies
    from phalanx.hooks import build_hooks, default_hooks
    from phalanx.strategies.distributed import check_same_config
    from phalanx.trainer import Trainer

    raw = phalanx_config(args, str(run_root))
    specs = default_hooks(config.validate(raw))
    raw["hooks"] = [s for s in specs if s != "ShowProgress"]
    assert len(raw["hooks"]) == len(specs) - 1, specs
    cfg = config.validate(raw)
    strategy = strategies.create(cfg)
    assert type(strategy).__name__.upper() == args.strategy.upper(), strategy
    assert strategy.world_size == PROCESSES, strategy
    box = [str(rundir.create(cfg, run_root / "ddp_overhead.yaml")) if strategy.is_main else None]
    dist.broadcast_object_list(box, src=0)
    run_dir = Path(box[0])
    logs.setup(
        run_dir if strategy.is_main else None, logging.INFO if strategy.is_main else logging.WARNING
    )
    phalanx_log = logging.getLogger("phalanx")
    for handler in list(phalanx_log.handlers):
        if not isinstance(handler, logging.FileHandler):
            phalanx_log.removeHandler(handler)
    check_same_config(
        strategy, rundir.resolved(cfg), {"phalanx": __version__, "torch": torch.__version__}
    )
    trainer = Trainer(
        cfg, run_dir, [ROOT], hooks=[*build_hooks(cfg, [ROOT]), driver], strategy=strategy
    )
    trainer.stop.watch(run_dir / launch.STOP_FILE)
    return trainer, run_dir, raw


# --- the ranks ------------------------------------------------------------------------------------


@contextlib.contextmanager
def shared_tmp(rank: int):
    """A temporary folder made by rank 0, its path the same on every rank (the config names it, and
    every rank must run the same config); removed by rank 0 once every rank is done with it."""
    with (
        tempfile.TemporaryDirectory(prefix="phalanx-ddp-bench-")
        if rank == 0
        else contextlib.nullcontext()
    ) as tmp:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        try:
            yield Path(box[0])
        finally:
            dist.barrier()


def rank_main(rank: int, port: int, args, queue) -> None:
    name_loops(args.strategy)  # a spawned process starts from the module's defaults
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(PROCESSES),
        LOCAL_WORLD_SIZE=str(PROCESSES),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        result = (
            profile_rank if args.profile else breakdown_rank if args.breakdown else measure_rank
        )(rank, args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported by the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        from phalanx import logs

        logs.setup(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_rank(rank: int, args) -> dict[str, Any] | None:
    source = (
        measured_source() if rank == 0 else None
    )  # the phalanx this process imports, before it runs
    dataset = make_dataset(args)
    REGISTRY[DATA_KEY] = dataset
    hand = HandDDP(dataset, args, rank)
    windows: list[tuple[float, float]] = []
    total, per_epoch = args.warmup + args.rounds, args.steps // args.chunk

    def chunk_of_hand(epoch: int) -> None:
        windows.append(hand.chunk(args.chunk))
        if rank == 0 and len(windows) % per_epoch == 0:
            mine, theirs = driver.windows[-per_epoch:], windows[-per_epoch:]
            print(
                f"  epoch {epoch}/{total}{' (warm-up)' if epoch <= args.warmup else ''}: "
                f"{PHALANX} {1e3 * sum(w[0] for w in mine) / args.steps:.3f}, "
                f"{HAND} {1e3 * sum(w[0] for w in theirs) / args.steps:.3f} ms/step (rank 0)",
                flush=True,
            )

    driver = make_driver_hook(args.chunk, args.steps, chunk_of_hand)
    with shared_tmp(rank) as tmp:
        trainer, run_dir, raw = build_phalanx(args, tmp / "runs", driver)
        if trainer.steps_per_epoch != args.steps:
            raise RuntimeError(
                f"phalanx plans {trainer.steps_per_epoch} steps per epoch, not {args.steps}"
            )
        hook_names = [type(h).__name__ for h in trainer.hooks]
        if rank == 0:
            print(
                f"phalanx hooks: {', '.join(hook_names)} (Driver: the benchmark's); strategy "
                f"{type(trainer.strategy).__name__}, world size {trainer.strategy.world_size}",
                flush=True,
            )
        started = time.perf_counter()
        code = trainer.run()
        wall_s = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"the phalanx run ended with exit code {code} on rank {rank}")
        checkpoints = (
            sorted(p.name for p in (run_dir / "checkpoints").iterdir()) if rank == 0 else None
        )
    mine = {
        "windows": {PHALANX: driver.windows, HAND: windows},
        "spans": {PHALANX: driver.spans, HAND: hand.spans},
        "pid": os.getpid(),
        "epoch_ends": driver.epoch_ends,
        "losses": {HAND: hand.epoch_losses},
    }
    every: list[Any] = [None] * PROCESSES
    dist.all_gather_object(every, mine)
    if rank != 0:
        return None
    report = make_report(args, every, hook_names, checkpoints, raw, wall_s)
    report["phalanx_source"] = source
    if measured_source() != source:
        report["phalanx_source"]["changed_during_run"] = True
        print(
            "warning: src/ changed while the benchmark ran; the figures are those of the source "
            f"at its start (digest {source['src_sha256']})",
            flush=True,
        )
    print_table(report)
    if args.samples:  # the sampler slows both loops a little: these figures are not kept
        skip = args.warmup * (args.steps // args.chunk)
        return {"spans": [(r["pid"], {k: v[skip:] for k, v in r["spans"].items()}) for r in every]}
    write_report(report, args.out)
    return {"ratio": report["target"]["phalanx_ratio"]}


def make_report(args, every: list[dict], hook_names, checkpoints, raw, wall_s) -> dict[str, Any]:
    per_epoch, k = args.steps // args.chunk, args.chunk
    n = args.warmup * per_epoch  # chunks not counted

    def rounds(name: str) -> list[tuple[float, float]]:
        """Per measured chunk: the slower rank's wall time, both ranks' CPU time together."""
        per_rank = [r["windows"][name][n:] for r in every]
        return [
            (max(w[0] for w in ws), sum(w[1] for w in ws)) for ws in zip(*per_rank, strict=True)
        ]

    measured = {name: rounds(name) for name in (HAND, PHALANX)}
    results: dict[str, Any] = {}
    for name in (HAND, PHALANX):
        results[name] = {}
        for i, kind in enumerate(("wall", "cpu")):
            mine, base = [w[i] / k for w in measured[name]], [w[i] / k for w in measured[HAND]]
            results[name][kind] = {
                **against_hand(mine, base),
                "per_chunk_ms_per_step": [round(1e3 * t, 5) for t in mine],
            }
        results[name]["wall"]["per_rank_ms_per_step"] = [
            summary([1e3 * w[0] / k for w in r["windows"][name][n:]]) for r in every
        ]
    ends = [r["epoch_ends"][args.warmup :] for r in every]
    end = [
        (max(e[0] for e in es), sum(e[1] for e in es)) for es in zip(*ends, strict=True)
    ]  # the slower rank; CPU of both
    results[PHALANX_END] = with_epoch_end(
        measured[PHALANX], measured[HAND], end, per_epoch, args.steps
    )
    ratio = results[PHALANX]["wall"]["ratio_vs_hand"]["median"]
    return {
        "benchmark": "ddp_overhead"
        + ("" if args.strategy == "ddp" else f" --strategy {args.strategy}"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "settings": {
            "strategy": args.strategy,
            "processes": PROCESSES,
            "backend": "gloo",
            "address": "127.0.0.1",
            "steps": args.steps,
            "chunk": k,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "batch_size_per_rank": args.batch_size,
            "global_batch": WORLD * args.batch_size,
            "hidden": args.hidden,
            "tokens": args.tokens,
            "clip": args.clip,
            "features": FEATURES,
            "classes": CLASSES,
            "samples": args.steps * WORLD * args.batch_size,
            "optimizer": f"AdamW(lr={LR})",
            "threads_per_process": torch.get_num_threads(),
        },
        "machine": machine(),
        "phalanx_source": None,
        "method": "the loops take turns every `chunk` steps (a round is one chunk of each), "
        "every chunk starting after a barrier; per chunk: wall = the slower rank's window, "
        "CPU = both ranks' process CPU time; ms/step = median over chunks of (wall / chunk); "
        "ratio = median over rounds of the paired ratio to the hand loop's chunk; "
        "ratio_of_totals = all measured windows added up; windows exclude phalanx's "
        "epoch-end hooks (row 'incl. epoch end' adds them, per epoch)",
        "phalanx_hooks": hook_names,
        "phalanx_checkpoints": checkpoints,
        "phalanx_config": raw,
        "target": {
            "phalanx_ratio_max": args.target,
            "phalanx_ratio": ratio,
            "met": ratio <= args.target,
        },
        "results": results,
        "final_epoch_loss": {name: every[0]["losses"][name][-1] for name in every[0]["losses"]},
        "wall_s": wall_s,
    }


def print_table(report: dict[str, Any]) -> None:
    s, m = report["settings"], report["machine"]
    print(
        f"\n{s['processes']} processes (gloo, {s['address']}), {s['rounds']} epochs of "
        f"{s['steps']} steps in chunks of {s['chunk']} (after {s['warmup']} warm-up), batch "
        f"{s['batch_size_per_rank']} per rank ({s['global_batch']} global), hidden {s['hidden']}, "
        f"{s['threads_per_process']} thread per process; torch {m['torch']}, {m['cpu_count']} "
        f"CPUs, {m['processor']}"
    )
    print_results(report["results"], 26)
    end = report["results"][PHALANX_END]["epoch_end_ms"]["wall"]
    print(
        "\nms/step: median over chunks of the slower rank's window / steps (CPU: both ranks "
        f"together); ratio: median of the per-chunk ratios to {HAND}'s chunk of the same "
        f"round.\nphalanx's epoch end (after_epoch hooks) took a median {end['median']:.1f} ms per "
        "epoch, outside the windows."
    )
    t = report["target"]
    print(
        f"target: {PHALANX} <= {t['phalanx_ratio_max']:.2f}x {HAND} (wall-clock): "
        f"{'met' if t['met'] else 'NOT met'} ({t['phalanx_ratio']:.3f}x)",
        flush=True,
    )


# --- diagnostics ----------------------------------------------------------------------------------


def profile_rank(rank: int, args) -> None:
    """cProfile of phalanx's ddp steps alone on each rank (no warm-up epochs); rank 0 prints."""
    import cProfile

    REGISTRY[DATA_KEY] = make_dataset(args)
    profiler = cProfile.Profile()

    def on_epoch_end(epoch: int) -> None:
        if epoch == args.warmup:
            profiler.enable()

    driver = make_driver_hook(args.steps, args.steps, on_epoch_end)
    with shared_tmp(rank) as tmp:
        trainer, _, _ = build_phalanx(args, tmp / "runs", driver)
        trainer.run()
        profiler.disable()
    if rank != 0:
        return None
    steps = args.rounds * args.steps
    print_profile(
        profiler,
        steps,
        "phalanx ddp steps on rank 0, default hooks minus ShowProgress, epoch ends included",
        args.profile_top,
    )
    return None


class PhalanxEpochs:
    """A phalanx Trainer driven epoch by epoch (`Trainer.train_epoch`), for --breakdown: its window
    runs from a barrier to its last step's after_batch hooks, as in the main benchmark."""

    def __init__(self, name: str, trainer, steps: int):
        from phalanx.hooks import Hook

        self.name, self.trainer = name, trainer
        timer = self

        class LastStep(Hook):
            gathers = False

            def after_batch(self, stream: str, batch: dict) -> None:
                if self.trainer.step_in_epoch == steps:
                    timer.last_step = now()

        trainer.add_hook(LastStep())
        self.last_step = (0.0, 0.0)
        trainer.begin_training()

    def epoch(self, epoch: int) -> tuple[float, float]:
        dist.barrier()
        start = now()
        self.trainer.train_epoch()
        return since(start, self.last_step)


def breakdown_rank(rank: int, args) -> dict[str, Any] | None:
    """Where phalanx's extra time goes: the main benchmark's method (epochs interleaved round by
    round, a window per epoch, the median of per-round ratios) over more variants of both loops.
    Diagnostic: it drives phalanx's Trainer epoch by epoch (Trainer.train_epoch); the phalanx
    trainers have no run directory, so the writers and SaveLatest do nothing at the epoch end."""
    from phalanx import strategies
    from phalanx.trainer import Trainer

    source = measured_source() if rank == 0 else None
    dataset = make_dataset(args)
    REGISTRY[DATA_KEY] = dataset
    with shared_tmp(rank) as tmp:
        from phalanx.hooks import Hook

        first, _, _ = build_phalanx(
            args, tmp / "runs", Hook()
        )  # validated config, strategy, logs as measured
        cfg = first.cfg

        def trainer(hooks):  # a strategy of its own: a strategy serves the one module it set up
            return Trainer(cfg, None, [ROOT], hooks=hooks, strategy=strategies.create(cfg))

        loops = [
            HandDDP(dataset, args, rank),
            HandDDP(dataset, args, rank, like_phalanx=True, carrier=False, name=LOSS_SETUP),
            HandDDP(dataset, args, rank, like_phalanx=True, name=SETUP),
            PhalanxEpochs(PHALANX, trainer(None), args.steps),
            PhalanxEpochs(NO_HOOKS, trainer([]), args.steps),
        ]
        windows: dict[str, list[tuple[float, float]]] = {loop.name: [] for loop in loops}
        total = args.warmup + args.rounds
        if rank == 0:
            print(
                "loops, in the order of the figures on each round's line:\n"
                + "\n".join(f"  {i + 1}. {loop.name}" for i, loop in enumerate(loops)),
                flush=True,
            )
        for epoch in range(1, total + 1):
            for loop in loops:
                windows[loop.name].append(loop.epoch(epoch))
            if rank == 0:
                print(
                    f"  round {epoch}/{total}{' (warm-up)' if epoch <= args.warmup else ''}: "
                    + " ".join(f"{1e3 * w[-1][0] / args.steps:.3f}" for w in windows.values())
                    + " ms/step (rank 0)",
                    flush=True,
                )
        losses = {loop.name: loop.epoch_losses[-1] for loop in loops if isinstance(loop, HandDDP)}
        for loop in loops:
            if isinstance(loop, PhalanxEpochs):
                loop.trainer.end_training()
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, windows)
    if rank != 0:
        return None
    n, steps = args.warmup, args.steps

    def rounds(name: str) -> list[float]:  # the slower rank's window per measured round, per step
        return [
            max(ws) / steps
            for ws in zip(*[[w[0] for w in r[name][n:]] for r in every], strict=True)
        ]

    measured = {name: rounds(name) for name in windows}
    base = measured[HAND]
    rows = {
        name: {
            "ms_per_step": summary([1e3 * t for t in ts]),
            "ratio_vs_hand": summary([t / h for t, h in zip(ts, base, strict=True)]),
            "extra_us_per_step_vs_hand": summary(
                [1e6 * (t - h) for t, h in zip(ts, base, strict=True)]
            ),
        }
        for name, ts in measured.items()
    }

    def diff(a: str, b: str) -> dict[str, float]:
        """Paired per-round difference b - a (us/step) and ratio b / a."""
        return {
            "us_per_step": statistics.median(
                [1e6 * (y - x) for x, y in zip(measured[a], measured[b], strict=True)]
            ),
            "ratio": statistics.median(
                [y / x for x, y in zip(measured[a], measured[b], strict=True)]
            ),
        }

    parts = [
        ("per-sample loss and DDP without the buffer broadcast, by hand", HAND, LOSS_SETUP),
        ("the carrier: (loss, stop) through the gradient all-reduce, by hand", LOSS_SETUP, SETUP),
        (
            "the rest of phalanx's step and loop, no hooks (engine, Forward, data plan, loop)",
            SETUP,
            NO_HOOKS,
        ),
        ("phalanx's default hooks' after_batch (minus ShowProgress)", NO_HOOKS, PHALANX),
        ("all of phalanx's extra time", HAND, PHALANX),
    ]
    found = {label: diff(a, b) for label, a, b in parts}
    print(
        f"\n--breakdown: {args.rounds} rounds of {steps} steps (after {n} warm-up), 2 processes, "
        f"batch {args.batch_size} per rank; per round, the slower rank's window; medians over "
        "rounds"
    )
    print(f"{'loop':<44}{'ms/step':>9}{'ratio vs hand':>15}{'extra us/step':>15}")
    for name, r in rows.items():
        print(
            f"{name:<44}{r['ms_per_step']['median']:>9.3f}{r['ratio_vs_hand']['median']:>14.3f}x"
            f"{r['extra_us_per_step_vs_hand']['median']:>15.0f}"
        )
    print(f"\n{'part (paired per round: B - A)':<84}{'us/step':>9}{'ratio':>8}")
    for label, _, _ in parts:
        print(f"{label:<84}{found[label]['us_per_step']:>9.0f}{found[label]['ratio']:>8.3f}")
    report = {
        "benchmark": "ddp_overhead --breakdown",
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": machine(),
        "phalanx_source": source,
        "loops": rows,
        "parts": found,
        "final_epoch_loss_hand_loops": losses,
        "per_round_ms_per_step": {k: [round(1e3 * t, 5) for t in v] for k, v in measured.items()},
    }
    if args.breakdown_out:
        Path(args.breakdown_out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.breakdown_out}", flush=True)
    return None


# --- the parent -----------------------------------------------------------------------------------


def launch(args) -> int:
    """Start the two ranks; fail (and leave no process behind) if either fails or hangs."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(rank, port, args, queue), name=f"rank{rank}")
        for rank in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    sampler = start_sampler(args, [p.pid for p in procs]) if args.samples else None
    failed, found = False, None
    try:
        for _ in range(PROCESSES):
            rank, ok, value = queue.get(timeout=args.timeout)
            if not ok:
                print(f"rank {rank} failed:\n{value}", file=sys.stderr, flush=True)
                failed = True
                break
            if rank == 0:
                found = value
    finally:
        for p in procs:
            p.join(timeout=10 if not failed else 2)
            if p.is_alive():
                p.kill()
                p.join()
        if sampler is not None:
            sampler[0].send_signal(signal.SIGINT)
            _, said = sampler[0].communicate(timeout=60)
    if sampler is not None and not failed and found is not None:
        print_samples(sampler[1], found["spans"], said)
    return 1 if failed else 0


# --- where each loop's CPU goes, by library (--samples) ---------------------------------------


def start_sampler(args, pids: list[int]) -> tuple[subprocess.Popen, Path]:
    """Linux perf sampling the ranks' CPU time (cpu-clock, stamped with the monotonic clock the
    ranks stamp their windows with) into a temporary file."""
    data = Path(tempfile.mkdtemp(prefix="phalanx-ddp-samples-")) / "perf.data"
    command = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.samples_hz)]
    command += ["-k", "CLOCK_MONOTONIC", "-p", ",".join(map(str, pids)), "-o", str(data)]
    sampler = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    return sampler, data


def print_samples(data: Path, ranks: list, recorded: str) -> None:
    """Each loop's main-thread samples by library (both ranks, the measured windows), and the
    other threads' in all; `recorded`: what perf record said (why it sampled nothing)."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "pid,tid,time,ip,dso"],
        capture_output=True,
        text=True,
        check=False,
    )
    shutil.rmtree(data.parent, ignore_errors=True)
    spans = {
        pid: sorted((s, e, name) for name, ws in loops.items() for s, e in ws)
        for pid, loops in ranks
    }
    starts = {pid: [s for s, _, _ in ws] for pid, ws in spans.items()}
    counts: dict[tuple[str, str], int] = collections.Counter()
    sample = re.compile(r"^\s*(\d+)/(\d+)\s+([\d.]+):.*\((.*)\)\s*$")
    for line in script.stdout.splitlines():
        m = sample.match(line)
        if m is None or int(m[1]) not in spans:
            continue
        pid, at = int(m[1]), float(m[3])
        i = bisect.bisect_right(starts[pid], at) - 1
        if i < 0 or at > spans[pid][i][1]:
            continue  # outside the measured windows
        name = spans[pid][i][2]
        where = Path(m[4]).name if int(m[2]) == pid else "other threads"
        counts[(name, where)] += 1
    if not counts:
        why = (recorded + script.stderr).strip()[:300]
        print(f"perf recorded no samples in the windows: {why or 'it said nothing'}")
        return
    places = sorted(
        {w for _, w in counts}, key=lambda w: -(counts[(HAND, w)] + counts[(PHALANX, w)])
    )
    main = [w for w in places if w != "other threads"]
    print("\nCPU samples in the measured windows, both ranks' main threads, by library:")
    print(f"{'library':<36}{HAND:>12}{PHALANX:>14}{'difference':>14}")
    for w in [*main[:12], "other threads"]:
        hand, mine = counts[(HAND, w)], counts[(PHALANX, w)]
        print(f"{w[:35]:<36}{hand:>12,}{mine:>14,}{mine - hand:>+14,}")
    hand, mine = (sum(counts[(n, w)] for w in main) for n in (HAND, PHALANX))
    print(
        f"{'main threads, all':<36}{hand:>12,}{mine:>14,}{mine - hand:>+14,} ({mine / hand:.3f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="optimizer steps per epoch (per round, per loop)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured epochs of each loop; default 60, 30 with --breakdown, 10 with --profile",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=20,
        help="steps each loop runs before handing over (a divisor of --steps)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="uncounted epochs first")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP")
    parser.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="samples are padded sequences of this many tokens (token-weighted loss; the hand loop "
        "all-reduces the global token count before backward); 0: classes",
    )
    parser.add_argument(
        "--clip", type=float, default=None, help="clip the gradient norm to this (both loops)"
    )
    parser.add_argument(
        "--strategy",
        choices=sorted(TARGETS),
        default="ddp",
        help="phalanx's ddp against hand DDP (default), its fsdp against hand FSDP2, or its mesh "
        "(shard 2 x tensor 2, four processes) against hand TP + FSDP2",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="phalanx's allowed ratio to the hand loop (default: 1.05 for ddp and mesh, 1.10 for "
        "fsdp)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the JSON report (default: bench/results/<strategy>_overhead.json)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="instead: cProfile phalanx's ranks alone (no JSON)"
    )
    parser.add_argument("--profile-top", type=int, default=30, help="rows of the profile")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: more variants of both loops, to split phalanx's extra time (no JSON unless "
        "--breakdown-out)",
    )
    parser.add_argument(
        "--breakdown-out", default=None, help="where --breakdown writes its JSON (default: none)"
    )
    parser.add_argument(
        "--samples",
        action="store_true",
        help="also: sample both loops' CPU with Linux perf and print each one's main-thread "
        "samples by library (no JSON)",
    )
    parser.add_argument(
        "--samples-hz", type=int, default=999, help="how often --samples samples, a second"
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds before a silent rank counts as hung"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 30 if args.breakdown else 10 if args.profile else 60
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        parser.error("--steps, --rounds and --warmup must be at least 1")
    if args.chunk < 1 or args.steps % args.chunk:
        parser.error(f"--chunk must divide --steps ({args.steps}); got {args.chunk}")
    if args.strategy == "mesh" and (args.clip or args.tokens):
        parser.error(
            "--strategy mesh times the plain step: leave out --clip and --tokens (the hand loop's "
            "clip_grad_norm_ cannot take parameters on two device meshes)"
        )
    if args.breakdown and args.strategy != "ddp":
        parser.error(
            "--breakdown splits ddp's extra time (its variants are DDP loops); leave out --strategy"
        )
    if args.samples and (args.profile or args.breakdown):
        parser.error(
            "--samples splits the benchmark's own loops: leave out --profile and --breakdown"
        )
    if args.samples and shutil.which("perf") is None:
        parser.error("--samples needs Linux perf on PATH (Debian: apt install linux-perf)")
    args.target = TARGETS[args.strategy] if args.target is None else args.target
    args.out = str(
        Path(args.out or ROOT / "bench" / "results" / f"{args.strategy}_overhead.json").resolve()
    )
    name_loops(args.strategy)
    return launch(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
