"""Shared pieces of the benchmarks: the data, the model, a dataset class that hands phalanx the very
same dataset object the other loops read, a thread-based coroutine for loops that own their control
flow, statistics and a description of the machine.

Importable as `bench.common` (the benchmarks put the repository root on sys.path), which is also the
dotted path phalanx's config uses to find `MLP` and `SharedStreams`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Items(Dataset):
    """A map-style dataset of dict items, {"x": features, "y": class index}, held in memory."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def make_items(n: int, features: int, classes: int, seed: int = 0) -> Items:
    """Gaussian blobs: `n` samples of `features` floats, one of `classes` labels each."""
    g = torch.Generator().manual_seed(seed)
    centers = 2 * torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return Items(x, y)


class MLP(nn.Module):
    """The tiny MLP every loop trains: features -> hidden -> hidden -> classes, ReLU between."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_sequences(n: int, tokens: int, features: int, classes: int, seed: int = 0) -> Items:
    """`make_items` as sequences of `tokens` positions, each sequence a random length (1 to
    `tokens`), its labels -100 beyond its end: the padded, variable-length batches of a language
    model."""
    g = torch.Generator().manual_seed(seed)
    centers = 2 * torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (n, tokens), generator=g)
    x = centers[y] + torch.randn(n, tokens, features, generator=g)
    lengths = torch.randint(1, tokens + 1, (n, 1), generator=g)
    return Items(x, torch.where(torch.arange(tokens) < lengths, y, -100))


def hand_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches,
    k: int,
    total: torch.Tensor,
    clip: float | None = None,
    world: int = 1,
) -> None:
    """`k` steps of the loop one writes by hand (`model` may be wrapped in DDP, `world` processes):
    zero_grad, forward, cross-entropy (over the global batch's real tokens, for sequences: with
    several processes, their count all-reduced before backward), backward, gradient clipping where
    asked, step, the loss added to `total` for the log."""
    for _ in range(k):
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        y = batch["y"]
        if y.dim() == 1:
            loss = F.cross_entropy(model(batch["x"]), y)
        elif (
            world == 1
        ):  # the mean over the batch's real tokens: one process's token-weighted objective
            loss = F.cross_entropy(model(batch["x"]).flatten(0, -2), y.flatten())
        # the sum over this rank's, divided by the global count (times the world: DDP averages)
        else:
            import torch.distributed as dist

            count = (y != -100).sum()
            dist.all_reduce(count)
            loss = F.cross_entropy(
                model(batch["x"]).flatten(0, -2), y.flatten(), reduction="sum"
            ) * (world / count)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        total += loss.detach()


def tensor_and_shard(
    module: nn.Module, shard: int, tensor: int, plan: dict[str, str]
) -> tuple[nn.Module, int]:
    """The loop one writes for a shard x tensor device mesh of this group's processes (tensor
    innermost): `plan` (module name -> colwise or rowwise) on the tensor dimension with
    `parallelize_module`, then `fully_shard` of each Linear and of the model over the shard
    dimension, default settings (FSDP averages over the shard dimension). Returns the model and
    this process's shard coordinate (its data rank: a tensor group reads one shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (shard, tensor), mesh_dim_names=("shard", "tensor"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(module, mesh["tensor"], {name: styles[s]() for name, s in plan.items()})
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    return fully_shard(module, mesh=mesh["shard"]), mesh["shard"].get_local_rank()


# Datasets registered by the benchmark process, so that a phalanx config can name one by key and
# phalanx trains on the same object as the hand-written loop (not on a copy built from the config).
REGISTRY: dict[str, Dataset] = {}


class SharedStreams:
    """A phalanx dataset class whose `train` stream is the dataset registered under `key`."""

    def __init__(self, key: str):
        self._streams = {"train": REGISTRY[key]}

    def streams(self) -> dict[str, Dataset]:
        return self._streams


class Coroutine:
    """Runs `body(pause)` in a worker thread, strictly alternating with the caller.

    `resume()` lets the body run until it calls `pause()` (or returns) and only then returns, so at
    any moment exactly one of the two threads runs and the other waits on a semaphore: the body is
    timed as if it ran on the caller's thread. Used for trainers that own their loop (Lightning's
    `fit`), so that their epochs can be interleaved with the other loops' epochs in one process.
    """

    def __init__(self, body: Callable[[Callable[[], None]], Any], name: str = "coroutine"):
        self._body = body
        self._to_worker, self._to_caller = threading.Semaphore(0), threading.Semaphore(0)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.error: BaseException | None = None
        self.finished = False

    def _main(self) -> None:
        self._to_worker.acquire()
        try:
            self._body(self.pause)
        except BaseException as e:  # handed to the caller by resume()
            self.error = e
        finally:
            self.finished = True
            self._to_caller.release()

    def pause(self) -> None:
        """Called from the body: hand control back to the caller and wait to be resumed."""
        self._to_caller.release()
        self._to_worker.acquire()

    def resume(self) -> None:
        if self.finished:
            raise RuntimeError("the coroutine has finished")
        if not self._thread.is_alive():
            self._thread.start()
        self._to_worker.release()
        self._to_caller.acquire()
        if self.error is not None:
            raise self.error

    def join(self, timeout: float = 60.0) -> None:
        self._thread.join(timeout)


def mlp_model(hidden: int, features: int = 32, classes: int = 10) -> dict[str, Any]:
    """The `model` section of a phalanx config for `MLP`, in the plain-module form (inputs,
    outputs and a torch.nn.functional loss), as the overhead benchmarks train it."""
    return {
        "class": "bench.common.MLP",
        "features": features,
        "hidden": hidden,
        "classes": classes,
        "inputs": {"x": "x"},
        "outputs": "logits",
        "loss": {"function": "cross_entropy", "output": "logits", "target": "y"},
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """The benchmark's JSON, with the folder made if needed; says where it went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


def summary(values: list[float]) -> dict[str, float]:
    """Median, quartiles, min and max of a list of numbers."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "q1": q[0],
        "q3": q[2],
        "min": ordered[0],
        "max": ordered[-1],
    }


def against_hand(mine: list[float], base: list[float]) -> dict[str, Any]:
    """Figures of a loop's windows (seconds per step) against the hand loop's of the same rounds."""
    return {
        "ms_per_step": summary([1e3 * t for t in mine]),
        "ratio_vs_hand": summary([a / b for a, b in zip(mine, base, strict=True)]),
        "ratio_of_medians": statistics.median(mine) / statistics.median(base),
        "ratio_of_totals": sum(mine) / sum(base),
    }


def with_epoch_end(
    phalanx: list[tuple[float, float]],
    hand: list[tuple[float, float]],
    ends: list[tuple[float, float]],
    per_epoch: int,
    steps: int,
) -> dict[str, Any]:
    """The row 'phalanx incl. epoch end': per epoch, phalanx's chunks plus its after_epoch hooks,
    against the hand loop's chunks of that epoch. Windows and ends are (wall, CPU) seconds."""
    entry: dict[str, Any] = {}
    for i, kind in enumerate(("wall", "cpu")):

        def epochs(ws, i=i):
            return [
                sum(w[i] for w in ws[e : e + per_epoch]) / steps
                for e in range(0, len(ws), per_epoch)
            ]

        mine = [t + e[i] / steps for t, e in zip(epochs(phalanx), ends, strict=True)]
        entry[kind] = {
            **against_hand(mine, epochs(hand)),
            "per_epoch_ms_per_step": [round(1e3 * t, 5) for t in mine],
        }
    entry["epoch_end_ms"] = {
        "wall": summary([1e3 * e[0] for e in ends]),
        "cpu": summary([1e3 * e[1] for e in ends]),
    }
    return entry


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    for name in ("phalanx", "lightning", "accelerate"):
        try:
            module = __import__(name)
            facts[name] = getattr(module, "__version__", "?")
        except ImportError:
            facts[name] = None
    return facts


def measured_source() -> dict[str, Any]:
    """`source_state` of the phalanx this process imports: the repository its package lies in (a
    checkout of another commit on PYTHONPATH, where a benchmark compares commits)."""
    import phalanx

    package = Path(phalanx.__file__).resolve().parent  # <repository>/src/phalanx
    return source_state(package.parent.parent)


def source_state(root: Path) -> dict[str, Any]:
    """The phalanx source measured: its commit, whether src/ differs from it, a digest of src/. A
    tree that is not a git work tree's top (an archive of an older commit unpacked inside this
    one, say) has no commit it can name: None, and the digest tells it apart."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    for path in sorted((root / "src").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != root.resolve():
        return {"commit": None, "src_modified": None, "src_sha256": digest.hexdigest()[:16]}
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "src_modified": bool(git("status", "--porcelain", "src")),
        "src_sha256": digest.hexdigest()[:16],
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_results(results: dict[str, Any], width: int) -> None:
    """The results table both overhead benchmarks print: wall-clock and CPU, median and IQR of
    ratios, and the ratio of total times where the results have it."""
    totals = all("ratio_of_totals" in r["wall"] for r in results.values())
    header = (
        f"{'loop':<{width}}{'ms/step':>9}{'ratio':>9}{'ratio IQR':>14}{'total':>8}"
        if totals
        else f"{'loop':<{width}}{'ms/step':>9}{'ratio':>9}{'ratio IQR':>14}"
    ) + f"  |{'CPU ms/step':>12}{'CPU ratio':>10}{'CPU IQR':>14}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        cells = []
        for kind in ("wall", "cpu"):
            ms, ratio = r[kind]["ms_per_step"], r[kind]["ratio_vs_hand"]
            cells.append((ms["median"], ratio["median"], f"{ratio['q1']:.3f}-{ratio['q3']:.3f}"))
        (w_ms, w_r, w_iqr), (c_ms, c_r, c_iqr) = cells
        total = f"{r['wall']['ratio_of_totals']:>7.3f}x" if totals else ""
        print(
            f"{name:<{width}}{w_ms:>9.4f}{w_r:>8.3f}x{w_iqr:>14}{total}  "
            f"|{c_ms:>12.4f}{c_r:>9.3f}x{c_iqr:>14}"
        )


def phalanx_trainer(
    raw: dict[str, Any], tmp: Path, extra_hooks: list, search_dirs: list[Path], strategy=None
):
    """A phalanx Trainer built as `phalanx train` builds one from the config dict `raw`: a validated
    config, a real run directory, log.txt, and the hooks of `phalanx.hooks.default_hooks` less
    ShowProgress (a terminal progress bar), followed by `extra_hooks` (a benchmark's driver).

    The console log handler is removed, log.txt kept: phalanx's epoch lines would bury a
    benchmark's table. Returns the trainer, its run directory and `raw` with the hooks it got. The
    caller ends with `phalanx.logs.setup(None)` to close log.txt. `strategy`: the one the config
    would choose, unless given.
    """
    import logging

    from phalanx import config, logs, rundir
    from phalanx.hooks import build_hooks, default_hooks
    from phalanx.trainer import Trainer

    raw = {**raw, "hooks": [s for s in default_hooks(config.validate(raw)) if s != "ShowProgress"]}
    cfg = config.validate(raw)
    run_dir = rundir.create(cfg, tmp / f"{cfg.name}.yaml")
    logs.setup(run_dir)
    phalanx_log = logging.getLogger("phalanx")
    for handler in list(phalanx_log.handlers):
        if not isinstance(handler, logging.FileHandler):
            phalanx_log.removeHandler(handler)
    hooks = [*build_hooks(cfg, search_dirs), *extra_hooks]
    return Trainer(cfg, run_dir, search_dirs, hooks=hooks, strategy=strategy), run_dir, raw


def print_profile(profiler, steps: int, heading: str, top: int) -> None:
    """A cProfile of `steps` phalanx steps, per step: by own time, by cumulative time, and phalanx's
    own functions by cumulative time (`heading` says what was profiled)."""
    import pstats

    package = str(Path(__import__("phalanx").__file__).parent)
    rows = [
        (
            tt,
            ct,
            nc,
            f"{Path(file).name}:{line}({func})" if line else func,
            file.startswith(package),
        )
        for (file, line, func), (cc, nc, tt, ct, _) in pstats.Stats(profiler).stats.items()
    ]
    print(f"cProfile of {steps} {heading} (times inflated by the profiler), per step:")
    for title, key, only_phalanx in (
        ("by own time", 0, False),
        ("by cumulative time", 1, False),
        ("phalanx's own functions, by cumulative time", 1, True),
    ):
        print(f"\n{title}\n{'own us':>10}{'cum us':>10}{'calls':>8}  function")
        chosen = [r for r in rows if r[4] or not only_phalanx]
        for tt, ct, nc, where, _ in sorted(chosen, key=lambda r: r[key], reverse=True)[:top]:
            print(f"{1e6 * tt / steps:>10.2f}{1e6 * ct / steps:>10.2f}{nc / steps:>8.2f}  {where}")


def free_port() -> int:
    """A TCP port on loopback that no process holds now, for a group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of a gloo group of `world` on loopback, one thread, with the
    environment a launcher gives its workers."""
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def first_result(ctx: Any, target: Callable, args_of: list[tuple]) -> Any:
    """Start a process for each argument tuple (`target(*args, queue)`) and return the first
    value one of them puts on the queue; a process that ends with an error ends the wait (its
    traceback is on stderr) instead of leaving it hanging."""
    import queue as queues

    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for args in args_of]
    for p in procs:
        p.start()
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a benchmark process failed; its error is above") from None
    for p in procs:
        p.join(timeout=60)
    return result


def step_on_first_batch(raw: dict[str, Any], root: Path, read: bool = True) -> Callable[[], Any]:
    """A Trainer of the config dict `raw` (no run directory, no hooks), and a function that runs
    one optimizer step (`Trainer.train_step`) on the first global batch, fetched once: the step
    alone, without the data loader. Each process fetches its data shard of each micro-batch, as the
    loop's loader does (a tensor group's processes the same one). `read=False`: the caller reads no
    step's loss (`Trainer.train_step`'s `read`)."""
    from phalanx import batching, config, data
    from phalanx.trainer import Trainer

    cfg = config.validate(raw)
    trainer = Trainer(cfg, None, [root], hooks=[])
    batch, strategy = cfg.dataset.batch_size, trainer.strategy
    plan = data.Plan(
        range(batch),
        batch,
        cfg.parallel.accumulation,
        strategy.data_rank,
        strategy.data_world_size,
    )
    stream = data.get_stream(trainer.dataset, "train")
    fetched = [(m, batching.collate([stream[i] for i in m.shard])) for m in plan.step(0)]
    return lambda: trainer.train_step(fetched, read=read)
