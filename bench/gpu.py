"""Training throughput on one GPU: one workload written four ways (a hand-written PyTorch loop,
phalanx, Lightning and Accelerate), the loops interleaved chunk by chunk in one process as in
bench/overhead.py, so that the machine's changes of speed affect each of them alike.

    python bench/gpu.py --workload gpt2-small    # GPT-2-small, bf16, compiled: tokens/s and MFU
    python bench/gpu.py --workload resnet50      # ResNet-50, bf16, channels-last, compiled
    python bench/gpu.py --workload launch-bound  # the tiny MLP, fp32: per-step overhead on a GPU
    python bench/gpu.py --workload gpt2-small --smoke                # tiny, fp32, eager, on the CPU
    python bench/gpu.py --workload gpt2-small --smoke --device cuda  # the same on the GPU

Every loop trains its own copy of the model (the same initial weights) with the same optimizer, on
the same in-memory data set object (seeded random data, never downloaded), read by a DataLoader with
the workers and pinned memory that phalanx uses on a GPU. A loop runs `--chunk` optimizer steps,
then hands over; a round is one chunk of each, in the order phalanx, Lightning, Accelerate, hand
loop. On CUDA a window starts and ends with `torch.cuda.synchronize()`, so that it holds its own
loop's GPU work and nothing of another's, and the allocator's peak is reset at its start. The first
`--warmup` epochs are not counted: they hold the compilation (phalanx, which runs first, pays most
of it, since dynamo's cache serves the compiled code to the other copies of the model). Each loop's
DataLoader workers start in the first window of each of its epochs. phalanx's epoch end (its
after_epoch hooks, the SaveLatest checkpoint among them) is outside the windows, and no other loop
saves anything.

Figures: ms/step and samples/s are medians over chunks; "vs hand" is the median over rounds of the
hand loop's chunk time over the loop's (a throughput ratio: above 1 is faster than the hand loop);
MFU is FLOPs per sample (counted by torch's FLOP counter on the meta device, as phalanx's
LogThroughput counts them) x samples/s / the device's peak (phalanx.metrics' table, or
--peak-flops).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, default_collate  # noqa: E402

from bench.common import (  # noqa: E402
    REGISTRY,
    Coroutine,
    machine,
    make_items,
    measured_source,
    phalanx_trainer,
    summary,
    write_report,
)

DATA_KEY = "gpu"
GPT_CONFIG = ROOT / "examples" / "gpt" / "gpt2-small.yaml"
HAND = "hand loop"
# The targets: phalanx's throughput against the hand loop's, and GPT-2-small's MFU.
TARGET_RATIO = {"gpt2-small": 0.98, "resnet50": 0.98}
TARGET_MFU = {"gpt2-small": 0.40}
# global batch, optimizer steps per epoch, steps per chunk, measured epochs: for an H100, then
# --smoke
SIZES = {
    "gpt2-small": (
        {"batch_size": 32, "steps": 60, "chunk": 10, "rounds": 8},
        {"batch_size": 8, "steps": 4, "chunk": 2, "rounds": 2},
    ),
    "launch-bound": (
        {"batch_size": 64, "steps": 200, "chunk": 20, "rounds": 20},
        {"batch_size": 64, "steps": 10, "chunk": 5, "rounds": 2},
    ),
    "resnet50": (
        {"batch_size": 256, "steps": 40, "chunk": 10, "rounds": 6},
        {"batch_size": 4, "steps": 4, "chunk": 2, "rounds": 2},
    ),
}
FAST = {
    "gpt2-small": True,
    "launch-bound": False,
    "resnet50": True,
}  # bf16 and torch.compile by default


# --- the workloads ------------------------------------------------------------------------------


@dataclass
class Workload:
    """A training workload, described once for the four loops."""

    model_class: str  # dotted path, as phalanx's config names it
    model_kwargs: dict[str, Any]
    plain: dict[str, Any]  # phalanx's plain-module keys (inputs, outputs, loss); empty for GPT
    loss: Callable[
        [nn.Module, dict], torch.Tensor
    ]  # the batch's mean loss, for the loops other than phalanx
    dataset: Dataset
    optimizer: tuple[str, dict[str, Any]]
    tokens_per_sample: int = 0
    unit: str = "samples"
    notes: list[str] = field(default_factory=list)

    def build(self) -> nn.Module:
        from phalanx.construct import import_object

        torch.manual_seed(0)  # every copy starts from the same weights, phalanx's too (seed 0)
        return import_object(self.model_class, [ROOT])(**self.model_kwargs)


class SyntheticImages(Dataset):
    """Seeded random images {"image": float32 [3, S, S], "label": class}: `n` items over a pool of
    at most `pool` distinct images, so that memory stays small whatever the number of steps."""

    def __init__(self, n: int, size: int, classes: int, pool: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(min(n, pool), 3, size, size, generator=g)
        self.labels = torch.randint(classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i % len(self.images)], "label": self.labels[i]}


def gpt_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["tokens"], batch["targets"])["loss"].mean()


def classification_loss(x: str, y: str) -> Callable[[nn.Module, dict], torch.Tensor]:
    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch[x]), batch[y])

    return loss


def plain_mapping(x: str, y: str) -> dict[str, Any]:
    return {
        "inputs": {x: "x"},
        "outputs": "logits",
        "loss": {"function": "cross_entropy", "output": "logits", "target": y},
    }


def gpt_workload(args) -> Workload:
    """examples/gpt's model at gpt2-small.yaml's sizes and optimizer (without its warm-up and
    schedule), on seeded random bytes."""
    from examples.gpt.data import Windows
    from phalanx.yamltext import safe_load

    yaml = safe_load(GPT_CONFIG.read_text())
    sizes = {k: v for k, v in yaml["model"].items() if k != "class"}
    sizes["block_size"] = args.seq_len
    notes = ["optimizer as gpt2-small.yaml, without its warm-up and cosine schedule"]
    if args.smoke:
        sizes.update(n_layer=2, n_head=4, n_embd=64)
        notes.append("smoke: 2 layers, 4 heads, 64 wide instead of gpt2-small.yaml's shape")
    optimizer = {k: v for k, v in yaml["optimizer"].items() if k not in ("class", "warmup_steps")}
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch_size
    data = torch.randint(
        0, sizes["vocab_size"], (n * args.seq_len + 1,), generator=g, dtype=torch.uint8
    )
    return Workload(
        yaml["model"]["class"],
        sizes,
        {},
        gpt_loss,
        Windows(data, args.seq_len),
        (yaml["optimizer"]["class"], optimizer),
        tokens_per_sample=args.seq_len,
        notes=notes,
    )


def mlp_workload(args) -> Workload:
    """bench/overhead.py's workload: so small that a step is nearly all launches and framework."""
    sizes = {"features": 32, "hidden": 128, "classes": 10}
    data = make_items(args.steps * args.batch_size, sizes["features"], sizes["classes"])
    return Workload(
        "bench.common.MLP",
        sizes,
        plain_mapping("x", "y"),
        classification_loss("x", "y"),
        data,
        ("AdamW", {"lr": 1e-3}),
    )


def resnet_workload(args) -> Workload:
    import torchvision  # noqa: F401 - not importable: the workload is skipped

    arch, notes = "resnet50", []
    if args.smoke:  # resnet50's optimizer step alone takes ~0.3 s on one CPU thread
        arch = "resnet18"
        notes.append("smoke: resnet18 instead of resnet50, for the CPU's sake")
    data = SyntheticImages(args.steps * args.batch_size, args.image_size, 1000)
    return Workload(
        f"torchvision.models.{arch}",
        {"weights": None, "num_classes": 1000},
        plain_mapping("image", "label"),
        classification_loss("image", "label"),
        data,
        ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}),
        unit="images",
        notes=notes,
    )


BUILDERS = {"gpt2-small": gpt_workload, "launch-bound": mlp_workload, "resnet50": resnet_workload}


# --- pieces every loop uses ---------------------------------------------------------------------


class Window(NamedTuple):
    seconds: float
    peak: int  # bytes allocated at most during the window (CUDA; the whole process's)
    resident: (
        int  # bytes allocated when it began: every loop's weights, gradients and optimizer state
    )


class Meter:
    """Opens and closes timing windows. On CUDA both ends wait for the device, so that a window
    holds its loop's queued work and none of another's; the allocator's peak restarts at the
    open."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def open(self) -> tuple[float, int]:
        resident = 0
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        return time.perf_counter(), resident

    def close(self, opened: tuple[float, int]) -> Window:
        peak = 0
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        return Window(time.perf_counter() - opened[0], peak, opened[1])


def make_optimizer(
    spec: tuple[str, dict], model: nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    """torch.optim.<name>(params, **kwargs), with the fused kernel on CUDA where the class has one:
    phalanx's own rule, so that every loop steps the same optimizer."""
    name, kwargs = spec
    factory = getattr(torch.optim, name)
    if device.type == "cuda" and "fused" in inspect.signature(factory).parameters:
        kwargs = {**kwargs, "fused": True}
    return factory(model.parameters(), **kwargs)


def make_loader(dataset: Dataset, args, device: torch.device) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
    )


def to_device(batch: dict, device: torch.device, channels_last: bool) -> dict:
    """The batch on the device (asynchronously from pinned memory), images channels-last: what
    phalanx does with a batch."""
    out = {}
    for key, value in batch.items():
        value = value.to(device, non_blocking=True)
        if channels_last and value.dim() == 4:
            value = value.contiguous(memory_format=torch.channels_last)
        out[key] = value
    return out


def prepared(work: Workload, args) -> nn.Module:
    model = work.build()
    return model.to(memory_format=torch.channels_last) if args.channels_last else model


def autocast(args, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


# --- 1. the hand-written loop -------------------------------------------------------------------


class ChunkedLoop:
    """A loop that owns its steps, run `k` steps at a time; it keeps its epoch's iterator between
    chunks. Subclasses say what one step is."""

    name = ""

    def __init__(
        self,
        work: Workload,
        args,
        device: torch.device,
        meter: Meter,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader,
    ):
        self.work, self.args, self.device, self.meter = work, args, device, meter
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.epoch_losses: list[float] = []
        self._step, self._batches, self._total = 0, None, None

    def step(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def chunk(self, k: int) -> Window:
        """The next `k` steps of the epoch; an epoch's set-up and its loss read-out fall in its
        first and last chunks. The loss is summed on the device and read once per epoch."""
        opened = self.meter.open()
        if self._step == 0:
            self.model.train()
            self._batches, self._total = iter(self.loader), torch.zeros((), device=self.device)
        for _ in range(k):
            batch = to_device(next(self._batches), self.device, self.args.channels_last)
            self._total += self.step(batch).detach()
        self._step += k
        if self._step == self.args.steps:
            self.epoch_losses.append(self._total.item() / self._step)
            self._step = 0
        return self.meter.close(opened)


class HandLoop(ChunkedLoop):
    """What one would write without a framework."""

    name = HAND

    def __init__(self, work: Workload, args, device: torch.device, meter: Meter):
        self.module = prepared(work, args).to(
            device
        )  # the plain module, which FLOPs are counted on
        optimizer = make_optimizer(work.optimizer, self.module, device)
        model = torch.compile(self.module) if args.compile else self.module
        super().__init__(
            work, args, device, meter, model, optimizer, make_loader(work.dataset, args, device)
        )

    def step(self, batch: dict) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.args, self.device):
            loss = self.work.loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        return loss


# --- 2. phalanx ---------------------------------------------------------------------------------


def phalanx_config(work: Workload, args, device: torch.device, output_root: str) -> dict[str, Any]:
    return {
        "name": f"gpu-{args.workload}",
        "model": {"class": work.model_class, **work.model_kwargs, **work.plain},
        "optimizer": {"class": work.optimizer[0], **work.optimizer[1]},
        "dataset": {
            "class": "bench.common.SharedStreams",
            "key": DATA_KEY,
            "batch_size": args.batch_size,
            "num_workers": args.workers,
        },
        "parallel": {"accelerator": device.type},
        "precision": args.precision,
        "compile": args.compile,
        "channels_last": args.channels_last,
        "seed": 0,
        "per_sample_random": not args.torch_dropout,
        "main_loop": {"epochs": args.warmup + args.rounds},
        "output_root": output_root,
    }


def make_driver(chunk: int, meter: Meter, on_chunk: Callable[[int], None]):
    """The last hook of the phalanx run: it closes phalanx's window every `chunk` steps, calls
    `on_chunk(epoch)` (the other loops' chunks), then opens the next. It keeps the epoch's loss as
    ComputeStats puts it in epoch_data, and the time of the epoch-end hooks, which it leaves outside
    the windows."""
    from phalanx.hooks import Hook

    class Driver(Hook):
        gathers = False

        def __init__(self):
            self.opened = (0.0, 0)
            self.windows: list[Window] = []
            self.epoch_losses: list[float] = []
            self.epoch_end_s: list[float] = []

        def before_training(self) -> None:
            self.opened = meter.open()

        def after_batch(self, stream: str, batch: dict) -> None:
            trainer = self.trainer
            if trainer.training and trainer.step_in_epoch % chunk == 0:
                self.windows.append(meter.close(self.opened))
                on_chunk(trainer.epoch + 1)
                self.opened = meter.open()

        def after_epoch(self, epoch: int, epoch_data: dict) -> None:
            self.epoch_losses.append(float(epoch_data.get("train", {}).get("loss", float("nan"))))

        def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
            self.epoch_end_s.append(profile.get("after_epoch", 0.0))
            self.opened = meter.open()

    return Driver()


# --- 3. Lightning -------------------------------------------------------------------------------


class LightningLoop:
    """Lightning's Trainer.fit in barebones mode (no logger, progress bar, checkpointing, model
    summary or sanity check), run as a coroutine: a callback hands control back after each chunk."""

    name = "Lightning"

    def __init__(self, work: Workload, args, device: torch.device, meter: Meter):
        import lightning.pytorch as pl

        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        steps, epochs, chunk = args.steps, args.warmup + args.rounds, args.chunk
        outer, threads = self, torch.get_num_threads()

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                model = prepared(work, args)
                self.model = torch.compile(model) if args.compile else model
                self.acc = {"total": None, "batches": 0}  # a dict: no nn.Module __setattr__

            def training_step(self, batch, batch_idx):
                loss = work.loss(self.model, to_device(batch, self.device, args.channels_last))
                acc = self.acc
                if acc["total"] is None:
                    acc["total"] = torch.zeros((), device=loss.device)
                acc["total"] += loss.detach()  # the same logging work as the hand loop
                acc["batches"] += 1
                return loss

            def configure_optimizers(self):  # called once the model is on the device
                return make_optimizer(work.optimizer, self.model, device)

        class Timer(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if (batch_idx + 1) % chunk == 0:
                    outer.windows.append(meter.close(outer.opened))
                    if (
                        trainer.current_epoch < epochs - 1 or batch_idx + 1 < steps
                    ):  # not the very last
                        self.pause()
                        outer.opened = meter.open()

            def on_train_epoch_end(self, trainer, module):
                acc = module.acc
                outer.epoch_losses.append(acc["total"].item() / acc["batches"])
                acc["total"], acc["batches"] = None, 0

        self.module, timer = Module(), Timer()
        precision = "bf16-mixed" if args.precision == "bf16" else "32-true"
        self.trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            precision=precision,
            max_epochs=epochs,
            barebones=True,
            callbacks=[timer],
            deterministic=False,
        )
        self.loader = make_loader(work.dataset, args, device)
        self.windows: list[Window] = []
        self.epoch_losses: list[float] = []
        self.opened = (0.0, 0)

        def body(pause):
            timer.pause = pause
            torch.set_num_threads(threads)
            self.opened = meter.open()  # the first (warm-up) window also holds fit's set-up
            self.trainer.fit(self.module, train_dataloaders=self.loader)

        self.coroutine = Coroutine(body, "lightning")

    def chunk(self, k: int) -> Window:
        self.coroutine.resume()
        return self.windows[-1]

    def close(self) -> None:
        if not self.coroutine.finished:
            raise RuntimeError("Lightning's fit did not end with its last chunk")
        self.coroutine.join()


# --- 4. Accelerate ------------------------------------------------------------------------------


class AccelerateLoop(ChunkedLoop):
    """The hand loop through Accelerate: prepare() (which adds autocast, and torch.compile through
    its dynamo backend), the prepared DataLoader's device placement, and accelerator.backward."""

    name = "Accelerate"

    def __init__(self, work: Workload, args, device: torch.device, meter: Meter):
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration

        cuda = device.type == "cuda"
        # non_blocking: copies from pinned memory that do not wait for the device, as the other
        # loops'
        self.accelerator = Accelerator(
            cpu=not cuda,
            mixed_precision="bf16" if args.precision == "bf16" else "no",
            dynamo_backend="inductor" if args.compile else "no",
            dataloader_config=DataLoaderConfiguration(non_blocking=cuda),
        )
        module = prepared(work, args).to(
            self.accelerator.device
        )  # before the optimizer: fused needs it there
        optimizer = make_optimizer(work.optimizer, module, device)
        prepared_parts = self.accelerator.prepare(
            module, optimizer, make_loader(work.dataset, args, device)
        )
        super().__init__(work, args, device, meter, *prepared_parts)

    def step(self, batch: dict) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.work.loss(self.model, batch)
        self.accelerator.backward(loss)
        self.optimizer.step()
        return loss


# --- the benchmark ------------------------------------------------------------------------------


def flops_per_sample(work: Workload, module: nn.Module, args) -> float | None:
    """FLOPs of one sample's forward and backward, counted as phalanx's LogThroughput counts them:
    phalanx.metrics.training_flops on a meta copy of the model (linear in the batch: a few samples
    do)."""
    from phalanx import metrics

    n = min(args.batch_size, 4)
    batch = default_collate([work.dataset[i] for i in range(n)])
    flops = metrics.training_flops(module, work.loss, batch)
    return flops / n if flops else None


def optional(name: str, factory, work, args, device, meter, skipped: dict[str, str]):
    try:
        return factory(work, args, device, meter)
    except ImportError as e:
        skipped[name] = f"not importable: {e}"
        return None


def interleave(work: Workload, args, device: torch.device) -> dict[str, Any]:
    """Every loop's windows: phalanx's run drives, the others run a chunk after each of its."""
    meter, skipped = Meter(device), {}
    hand = HandLoop(work, args, device, meter)
    flops = flops_per_sample(work, hand.module, args)
    loops = [
        loop
        for loop in (
            optional("Lightning", LightningLoop, work, args, device, meter, skipped),
            optional("Accelerate", AccelerateLoop, work, args, device, meter, skipped),
        )
        if loop
    ]
    loops.append(hand)
    windows: dict[str, list[Window]] = {loop.name: [] for loop in loops}
    total, per_epoch = args.warmup + args.rounds, args.steps // args.chunk

    def chunk_of_others(epoch: int) -> None:
        for loop in list(loops):
            try:
                windows[loop.name].append(loop.chunk(args.chunk))
            except Exception as e:  # noqa: BLE001 - another framework's failure must not cost phalanx's figures
                if loop is hand:
                    raise
                skipped[loop.name] = f"failed in epoch {epoch}: {type(e).__name__}: {e}"
                print(
                    f"  {loop.name} failed and leaves the benchmark: {skipped[loop.name]}",
                    flush=True,
                )
                loops.remove(loop)
                windows.pop(loop.name)
        if len(driver.windows) % per_epoch == 0:
            shown = [("phalanx", driver.windows), *windows.items()]
            print(
                f"  epoch {epoch}/{total}{' (warm-up)' if epoch <= args.warmup else ''}: "
                + ", ".join(
                    f"{n} {1e3 * sum(w.seconds for w in ws[-per_epoch:]) / args.steps:.3f}"
                    for n, ws in shown
                )
                + " ms/step",
                flush=True,
            )

    driver = make_driver(args.chunk, meter, chunk_of_others)
    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-bench-") as tmp:
        raw = phalanx_config(work, args, device, str(Path(tmp) / "runs"))
        trainer, _, raw = phalanx_trainer(raw, Path(tmp), [driver], [ROOT])
        hooks = [type(h).__name__ for h in trainer.hooks]
        print(f"phalanx hooks: {', '.join(hooks)} (Driver: the benchmark's)", flush=True)
        started = time.perf_counter()
        try:
            code = trainer.run()
        finally:
            from phalanx import logs

            logs.setup(None)  # close log.txt before the folder goes
        wall_s = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"the phalanx run ended with exit code {code}")
    for loop in loops:
        if hasattr(loop, "close"):
            loop.close()
    counted = next(
        (h.flops_per_sample for h in trainer.hooks if type(h).__name__ == "LogThroughput"), None
    )
    n = args.warmup * per_epoch
    return {
        "windows": {
            "phalanx": driver.windows[n:],
            **{name: ws[n:] for name, ws in windows.items()},
        },
        "first_window_s": {
            "phalanx": driver.windows[0].seconds,
            **{name: ws[0].seconds for name, ws in windows.items()},
        },
        "losses": {
            "phalanx": driver.epoch_losses,
            **{loop.name: loop.epoch_losses for loop in loops},
        },
        "epoch_end_s": driver.epoch_end_s[args.warmup :],
        "skipped": skipped,
        "hooks": hooks,
        "config": raw,
        "flops": flops,
        "flops_logthroughput": counted,
        "wall_s": wall_s,
        "profile": {k: round(v, 3) for k, v in trainer.profile.items()},
    }


def loop_figures(
    mine: list[Window], base: list[Window], args, work: Workload, flops, peak, cuda
) -> dict:
    samples = args.chunk * args.batch_size
    rates = [samples / w.seconds for w in mine]
    out = {
        "ms_per_step": summary([1e3 * w.seconds / args.chunk for w in mine]),
        "samples_per_s": summary(rates),
        "throughput_ratio_vs_hand": summary(
            [b.seconds / w.seconds for w, b in zip(mine, base, strict=True)]
        ),
        "ratio_of_totals": sum(b.seconds for b in base) / sum(w.seconds for w in mine),
        "per_chunk_ms_per_step": [round(1e3 * w.seconds / args.chunk, 4) for w in mine],
    }
    if work.tokens_per_sample:
        out["tokens_per_s"] = summary([r * work.tokens_per_sample for r in rates])
    out["mfu"] = summary([flops * r / peak for r in rates]) if flops and peak else None
    if cuda:
        out["peak_memory_gib"] = max(w.peak for w in mine) / 2**30
        out["step_peak_over_resident_gib"] = max(w.peak - w.resident for w in mine) / 2**30
    return out


def target(results: dict[str, Any], args) -> dict[str, Any]:
    """The issue's checks for this workload, on phalanx's figures (none for launch-bound)."""
    mine = results.get("phalanx") or {}
    values = {
        "phalanx_throughput_ratio": (
            TARGET_RATIO,
            (mine.get("throughput_ratio_vs_hand") or {}).get("median"),
        ),
        "phalanx_mfu": (TARGET_MFU, (mine.get("mfu") or {}).get("median")),
    }
    checks = {
        name: {
            "min": table[args.workload],
            "value": value,
            "met": None if value is None else value >= table[args.workload],
        }
        for name, (table, value) in values.items()
        if args.workload in table
    }
    met = (
        None
        if not checks or any(c["met"] is None for c in checks.values())
        else all(c["met"] for c in checks.values())
    )
    valid = not args.smoke and args.device == "cuda"
    return {
        "checks": checks,
        "met": met,
        "valid": valid,
        "note": "measured at the workload's sizes on a GPU"
        if valid
        else "not a measurement of the target: smoke sizes or no GPU; the figures only show the "
        "script works",
    }


def device_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": "cpu"}
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(device),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
    }


def run(args) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    warnings.filterwarnings(
        "ignore"
    )  # Lightning's advice on workers, Accelerate's on precision and the like
    report: dict[str, Any] = {
        "benchmark": "gpu",
        "workload": args.workload,
        "smoke": args.smoke,
        "command": " ".join(["python", *sys.argv]),
        "settings": settings(args),
        "machine": machine(),
        "device": device_facts(device),
        "phalanx_source": measured_source(),
        "method": " ".join(__doc__.split("\n\n", 2)[2].split()),
    }
    try:
        work = BUILDERS[args.workload](args)
    except ModuleNotFoundError as e:  # torchvision, where it is not installed
        if (e.name or "").split(".")[0] in ("phalanx", "bench", "examples"):
            raise  # this repository's own: a bug, not a missing package
        return {
            **report,
            "skipped": {
                "all loops": f"{args.workload} needs a package that is not importable: {e}"
            },
            "results": {},
            "target": target({}, args),
        }
    report["settings"].update(
        model={"class": work.model_class, **work.model_kwargs}, notes=work.notes, unit=work.unit
    )
    if (
        args.compile
    ):  # four copies of one model compiled in one process: more entries than dynamo's default 8
        from torch._dynamo import config as dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, name):
                setattr(dynamo, name, max(getattr(dynamo, name), 64))
    REGISTRY[DATA_KEY] = work.dataset
    return {**report, **measure(work, args, device)}


def measure(work: Workload, args, device: torch.device) -> dict[str, Any]:
    """The interleaved run, as the JSON's figures."""
    from phalanx import metrics

    found = interleave(work, args, device)
    flops, peak, windows = (
        found["flops"],
        args.peak_flops or metrics.peak_flops(device),
        found["windows"],
    )
    results = {
        name: loop_figures(ws, windows[HAND], args, work, flops, peak, device.type == "cuda")
        for name, ws in sorted(windows.items(), key=lambda kv: kv[0] != HAND)
    }
    for name, entry in results.items():
        losses = found["losses"][name]
        entry["final_epoch_loss"] = losses[-1] if losses else None
        entry["first_window_s"] = found["first_window_s"][
            name
        ]  # a warm-up window: compilation and set-up
    out = {
        "flops_per_sample": flops,
        "flops_per_sample_phalanx_logthroughput": found["flops_logthroughput"],
        "peak_flops": peak,
        "peak_flops_from": "--peak-flops"
        if args.peak_flops
        else "phalanx.metrics.PEAK_FLOPS"
        if peak
        else None,
        "phalanx_hooks": found["hooks"],
        "phalanx_config": found["config"],
        "phalanx_epoch_end_s": summary(found["epoch_end_s"]) if found["epoch_end_s"] else None,
        # phalanx's own split of its time (seconds, warm-up included; the CPU's view: without a
        # synchronisation, a step's GPU work shows up wherever the CPU next waits for it)
        "phalanx_profile_s": found["profile"],
        "skipped": found["skipped"],
        "results": results,
        "target": target(results, args),
        "wall_s": found["wall_s"],
    }
    if (
        args.compile
    ):  # graphs, graph breaks, recompilations: that every loop ran compiled code, and what
        from torch._dynamo.utils import counters

        out["dynamo_counters"] = {kind: dict(values) for kind, values in counters.items()}
    return out


def settings(args) -> dict[str, Any]:
    keys = (
        "workload",
        "smoke",
        "device",
        "batch_size",
        "steps",
        "chunk",
        "rounds",
        "warmup",
        "workers",
        "precision",
        "compile",
        "channels_last",
        "cudnn_benchmark",
        "threads",
        "torch_dropout",
    )
    out = {k: getattr(args, k) for k in keys}
    if args.workload == "gpt2-small":
        out["seq_len"] = args.seq_len
    if args.workload == "resnet50":
        out["image_size"] = args.image_size
    out["samples_per_epoch"] = args.steps * args.batch_size
    return out


def print_table(report: dict[str, Any]) -> None:
    s, results = report["settings"], report["results"]
    for note in s.get("notes", []):
        print(f"note: {note}")
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")
    if not results:
        return
    device = report["device"].get("name", "CPU")
    print(
        f"\n{s['workload']} on {device}: {s['rounds']} epochs of {s['steps']} steps (after "
        f"{s['warmup']} warm-up), chunks of {s['chunk']}, batch {s['batch_size']}, "
        f"{s['precision']}, {'compiled' if s['compile'] else 'eager'}, {s['workers']} DataLoader "
        "workers" + (", phalanx with torch's dropout" if s.get("torch_dropout") else "")
    )
    gpt, cuda = "seq_len" in s, report["device"]["type"] == "cuda"
    header = (
        f"{'loop':<12}{'ms/step':>10}{s['unit'] + '/s':>12}"
        + (f"{'tokens/s':>12}{'MFU':>8}" if gpt else "")
        + f"{'vs hand':>9}{'IQR':>14}"
        + (f"{'peak GiB':>10}" if cuda else "")
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        ratio = r["throughput_ratio_vs_hand"]
        row = f"{name:<12}{r['ms_per_step']['median']:>10.3f}{r['samples_per_s']['median']:>12,.1f}"
        if gpt:
            mfu = f"{100 * r['mfu']['median']:.1f}%" if r["mfu"] else "-"
            row += f"{r['tokens_per_s']['median']:>12,.0f}{mfu:>8}"
        row += f"{ratio['median']:>8.3f}x{ratio['q1']:>7.3f}-{ratio['q3']:.3f}"
        if cuda:
            row += f"{r['peak_memory_gib']:>10.2f}"
        print(row)
    print(
        "ms/step, samples/s: medians over chunks; vs hand: median over rounds of the hand loop's "
        "chunk time over the loop's (above 1: faster)"
        + (
            "; peak GiB: the process's allocations while the loop ran, every "
            "loop's weights and optimizer state included"
            if cuda
            else ""
        )
    )


def print_target(report: dict[str, Any]) -> None:
    t = report["target"]
    labels = {
        "phalanx_throughput_ratio": "phalanx throughput >= {}x the hand loop's",
        "phalanx_mfu": "phalanx MFU >= {}",
    }
    for name, c in t["checks"].items():
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        state = "unknown" if c["met"] is None else "met" if c["met"] else "NOT met"
        print(f"target: {labels[name].format(c['min'])}: {state} ({value})")
    if not t["checks"]:
        print(f"target: none for {report['workload']}")
    if not t["valid"]:
        print(f"({t['note']})")
    if report.get("phalanx_profile_s"):
        print(
            "phalanx's own time split, s: "
            + ", ".join(f"{k} {v:.2f}" for k, v in report["phalanx_profile_s"].items())
        )


def default_workers(args) -> int:
    """phalanx's num_workers: auto on one GPU (up to 4, a core left for the main process), none on
    the CPU; none for launch-bound, whose batches cost less to build than to pass between processes.
    Fewer where /dev/shm cannot hold the batches that every loop's workers keep ready."""
    if args.device != "cuda" or args.workload == "launch-bound":
        return 0
    workers = max(0, min(4, (os.cpu_count() or 1) - 1))
    if args.workload == "resnet50" and workers:
        batch_bytes = args.batch_size * 3 * args.image_size**2 * 4
        with contextlib.suppress(OSError):
            free = shutil.disk_usage("/dev/shm").free
            while (
                workers and 4 * workers * 2 * batch_bytes > free / 2
            ):  # 4 loops, prefetch_factor 2
                workers -= 1
    return workers


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=list(BUILDERS), default="gpt2-small")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, fp32, no compile, a few steps, on the CPU unless --device says otherwise",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda, or cpu with --smoke",
    )
    parser.add_argument("--batch-size", type=int, help="global batch (default per workload)")
    parser.add_argument(
        "--seq-len", type=int, help="gpt2-small's sequence length (default 1024; smoke 32)"
    )
    parser.add_argument(
        "--image-size", type=int, help="resnet50's image side (default 224; smoke 32)"
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per epoch")
    parser.add_argument(
        "--chunk",
        type=int,
        help="steps each loop runs before the next takes over (divides --steps)",
    )
    parser.add_argument("--rounds", type=int, help="measured epochs (of every loop)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="uncounted epochs first: they hold the compilations"
    )
    parser.add_argument(
        "--workers", type=int, help="DataLoader workers of every loop (default: as phalanx's auto)"
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        help="default bf16 (fp32 for launch-bound and --smoke)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile every loop's model (default on, off for launch-bound and --smoke)",
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="channels-last weights and images (default on for resnet50)",
    )
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="torch.backends.cudnn.benchmark for every loop (phalanx leaves torch's default, off)",
    )
    parser.add_argument(
        "--peak-flops",
        type=float,
        help="the device's peak FLOP/s for MFU (default: phalanx's table)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument(
        "--torch-dropout",
        action="store_true",
        help="phalanx with per_sample_random: false (torch's own dropout, as the other loops), "
        "to tell the per-sample masks' cost from the rest",
    )
    parser.add_argument(
        "--out",
        help="the JSON (default bench/results/gpu-<workload>.json; -smoke.json with --smoke)",
    )
    args = parser.parse_args(argv)
    fill_defaults(args, parser)
    return args


def fill_defaults(args, parser: argparse.ArgumentParser) -> None:
    if args.device == "auto":
        args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "no CUDA GPU is visible; run --smoke for a check on the CPU, or --device cpu for the "
            "full sizes on the CPU (slow)"
        )
    for key, value in SIZES[args.workload][args.smoke].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seq_len = args.seq_len or (32 if args.smoke else 1024)
    args.image_size = args.image_size or (32 if args.smoke else 224)
    fast = FAST[args.workload] and not args.smoke
    args.precision = args.precision or ("bf16" if fast else "fp32")
    args.compile = fast if args.compile is None else args.compile
    args.channels_last = (
        args.workload == "resnet50" if args.channels_last is None else args.channels_last
    )
    args.workers = default_workers(args) if args.workers is None else args.workers
    args.out = args.out or str(
        ROOT / "bench" / "results" / f"gpu-{args.workload}{'-smoke' if args.smoke else ''}.json"
    )
    for key in (
        "batch_size",
        "steps",
        "chunk",
        "rounds",
        "warmup",
        "seq_len",
        "image_size",
        "threads",
    ):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1; got {getattr(args, key)}")
    if args.steps % args.chunk:
        parser.error(f"--chunk must divide --steps ({args.steps}); got {args.chunk}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = run(args)
    print_table(report)
    print_target(report)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
