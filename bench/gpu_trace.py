"""What one launch-bound step asks of the GPU and of the host: bench/gpu.py's launch-bound MLP
trained by the hand loop and by phalanx, each watched over windows of steps: one timed, one under
torch.profiler (the CUDA runtime calls and operators per step: kernel launches, copies, explicit
synchronisations, event records and queries), one under torch's sync debug mode (the Python stack of
each read that waits for the device: `.item()`, `.tolist()`, a blocking copy; an explicit
`torch.cuda.synchronize()` or event wait is not reported there, only counted in the profiled
window), and for phalanx one under cProfile (the Python functions by own time).

phalanx's timed window is its second epoch's steps (the epoch's ends left out; LogThroughput's log
lines, every 50 steps, inside); the others are `--steps` steps each of its third. The hand loop's
windows follow one another in an epoch after its first step.

    python bench/gpu_trace.py                       # on a GPU, from the root of the source to trace
    python bench/gpu_trace.py --device cpu --smoke  # a check that the script runs (no CUDA counts)

It imports bench/gpu.py and bench/common.py from the directory it runs in, so an older source
(bench/gpu_session.sh's `.old/COMMIT`) is traced with its own benchmark code:
`(cd .old/C && PYTHONPATH=$PWD/src:$PWD python /path/to/bench/gpu_trace.py --label C)`. Figures
under a profiler are inflated; compare them between sources in one call, not with other runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import gpu  # noqa: E402
from bench.common import REGISTRY, phalanx_trainer  # noqa: E402

RUNTIME = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaEventRecord",
    "cudaEventRecordWithFlags",
    "cudaEventQuery",
    "cudaEventElapsedTime",
    "cudaStreamWaitEvent",
    "cudaStreamIsCapturing",
    "cudaPointerGetAttributes",
)
WINDOWS = ("timed", "profiled", "syncs", "python")


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(found: dict, steps: int, device: torch.device) -> Iterator[None]:
    wait(device)
    began = time.perf_counter()
    yield
    wait(device)
    found["us"] = 1e6 * (time.perf_counter() - began) / steps


@contextlib.contextmanager
def profiled(found: dict, steps: int, device: torch.device) -> Iterator[None]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait(device)
    with torch.profiler.profile(activities=activities) as prof:
        yield
        wait(device)
    on_device = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    found["ops"] = {
        e.key: (e.count / steps, e.self_cpu_time_total / steps)
        for e in prof.key_averages()
        if e.key not in set(on_device)
    }
    moves = sum(1 for name in on_device if name.startswith(("Memcpy", "Memset")))
    found["kernels"], found["moves"] = (len(on_device) - moves) / steps, moves / steps


@contextlib.contextmanager
def sync_stacks(found: dict, device: torch.device) -> Iterator[None]:
    """Each synchronising call, by its Python stack (this repository's frames), counted."""
    stacks: collections.Counter = collections.Counter()
    found["syncs"] = stacks
    if device.type != "cuda":
        yield
        return

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "phalanx" in f.filename or "bench" in f.filename
        ]
        stacks[str(message).splitlines()[0][:80] + "\n      " + "\n      ".join(frames[-6:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
            wait(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def python_profile(found: dict, steps: int) -> Iterator[None]:
    profile = cProfile.Profile()
    profile.enable()
    yield
    profile.disable()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:40]
    found["python"] = [
        f"{1e6 * own / steps:8.1f} us/step own {1e6 * cum / steps:8.1f} cum "
        f"{calls / steps:6.2f}/step {Path(file).name}:{line} {name}"
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


def window(kind: str, found: dict, steps: int, device: torch.device):
    if kind == "timed":
        return timed(found, steps, device)
    if kind == "profiled":
        return profiled(found, steps, device)
    if kind == "syncs":
        return sync_stacks(found, device)
    return python_profile(found, steps)


def show(name: str, found: dict, steps: int, top: int) -> None:
    print(
        f"\n=== {name}: {found['us']:.1f} us/step unprofiled; {found['kernels']:.1f} kernels and "
        f"{found['moves']:.1f} copies or sets on the device a step"
    )
    ops = found["ops"]
    for key in RUNTIME:
        if key in ops:
            n, us = ops[key]
            print(f"  {key:28s} {n:7.2f}/step  {us:8.1f} us/step self cpu")
    print("  operators, most called per step:")
    called = sorted(
        ((k, v) for k, v in ops.items() if not k.startswith("cu")), key=lambda kv: -kv[1][0]
    )
    for key, (n, us) in called[:top]:
        print(f"    {key[:60]:60s} {n:7.2f}/step {us:8.1f} us")
    print(f"  reads that waited for the device, over {steps} steps (sync debug mode):")
    for stack, n in found["syncs"].most_common(8):
        print(f"    x{n}: {stack}")
    if "python" in found:
        print("  Python functions under cProfile, by own time:")
        print("\n".join(f"    {row}" for row in found["python"]))


def schedule(steps_per_epoch: int, n: int) -> list[tuple[int, int, str]]:
    """phalanx's windows as (step it opens after, step it closes after, kind): the timed one over
    the second epoch's steps, the others `n` steps each in the third."""
    third = 2 * steps_per_epoch + 1
    return [
        (steps_per_epoch + 1, 2 * steps_per_epoch, "timed"),
        *((third + k * n, third + (k + 1) * n, kind) for k, kind in enumerate(WINDOWS[1:])),
    ]


def traced_hook(plan: list[tuple[int, int, str]], device: torch.device, found: dict):
    """A hook that opens and closes the windows of `plan` after the training steps it names."""
    from phalanx.hooks import Hook

    class Tracer(Hook):
        gathers = False

        def __init__(self):
            self.seen, self.open = 0, contextlib.ExitStack()

        def after_batch(self, stream: str, batch: dict) -> None:
            if not self.trainer.training:
                return
            self.seen += 1
            if any(self.seen == closes for _, closes, _ in plan):
                self.open.close()
            for opens, closes, kind in plan:
                if self.seen == opens:
                    self.open.enter_context(window(kind, found, closes - opens, device))

    return Tracer()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--smoke", action="store_true", help="bench/gpu.py's smoke sizes")
    parser.add_argument("--steps", type=int, default=40, help="steps in each window")
    parser.add_argument("--top", type=int, default=28, help="operators shown, most called first")
    parser.add_argument("--label", default=ROOT.name)
    opts = parser.parse_args()
    smoke = ["--smoke"] if opts.smoke else []
    args = gpu.parse(["--workload", "launch-bound", "--device", opts.device, *smoke])
    device = torch.device(opts.device)
    work = gpu.mlp_workload(args)
    REGISTRY[gpu.DATA_KEY] = work.dataset
    if opts.steps < 1 or args.steps < 5:
        parser.error("--steps must be at least 1, and an epoch at least 5 steps")
    # phalanx's three in its third epoch, and the hand loop's timed window at least n steps
    n = min(opts.steps, (args.steps - 1) // (len(WINDOWS) - 1))

    hand = gpu.HandLoop(work, args, device, gpu.Meter(device))
    hand.chunk(args.steps)  # an epoch of warm-up
    hand_found: dict = {}
    hand.chunk(1)  # the epoch's start (its loader's iterator) outside the windows
    timed_steps = args.steps - 1 - 2 * n
    with window("timed", hand_found, timed_steps, device):
        hand.chunk(timed_steps)
    for kind in WINDOWS[1:3]:  # the last ends the epoch, with its one read of the loss
        with window(kind, hand_found, n, device):
            hand.chunk(n)

    found: dict = {}
    tracer = traced_hook(schedule(args.steps, n), device, found)
    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-trace-") as tmp:
        raw = gpu.phalanx_config(work, args, device, str(Path(tmp) / "runs"))
        raw["main_loop"] = {"epochs": 3}
        trainer, _, raw = phalanx_trainer(raw, Path(tmp), [tracer], [ROOT])
        print(f"[{opts.label}] phalanx hooks: {', '.join(type(h).__name__ for h in trainer.hooks)}")
        try:
            code = trainer.run()
        finally:
            from phalanx import logs

            logs.setup(None)  # close log.txt before the folder goes
    if code != 0:
        raise SystemExit(f"the phalanx run ended with exit code {code}")
    show(f"[{opts.label}] hand loop", hand_found, n, opts.top)
    show(f"[{opts.label}] phalanx", found, n, opts.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
