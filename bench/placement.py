"""Splitting a model by layers: when it loses to one device, and when pipelining makes it pay.

    .venv/bin/python bench/placement.py                  # the two-tower example, batch 256
    .venv/bin/python bench/placement.py --batch 512 --rounds 8

Times one optimizer step of the two-tower example (examples/two_tower) set up five ways, on the
machine at hand, each process one CPU core (one thread): a CPU process stands for a device.

- one device: `strategy: single`, one process.
- naive placement: the model cut in two (`split: [layers.2]`) over two processes, one micro-batch
  (gpipe):
  what placing the layers on two devices does (the second waits for the first, then the first for
  the second, and the activations cross between them).
- exaggerated placement: the model cut in four, the stages alternating between the two processes
  (`split: [layers.1, layers.2, layers.3]`, `stages_per_process: 2`), one micro-batch: every
  layer's output crosses to the other device, as in the placement study phalanx started from.
- pipeline, 4 and 8 micro-batches: the two-stage cut with the batch's micro-batches flowing
  through (1f1b), so that both processes work at once.
- hand-written, 8 micro-batches: the same cut and schedule as a plain `torch.distributed.pipelining`
  loop, as a reference: what torch's schedule and the transport cost on this machine.

Each setup's time is its median over `--rounds` rounds of `--steps` steps, on a fixed batch, through
`Trainer.train_step`; a step of several processes lasts as long as its slowest. The figures are
ratios to one device. The pipeline's ideal is the bubble bound of its own stage times,
`(m + p - 1)` micro-batch slots of the slowest stage, plus that stage's optimizer step. The stage
times are the stages' blocks run as a chain (forward and backward, at the micro-batch's size, no
communication) in both processes at once, as the stages run in a pipeline's steady state: two
busy cores share the caches and the memory, and are slower than one alone, which the report also
gives ("stages alone").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
# glibc's allocator serves large blocks from fresh mmaps (zeroed pages, a fault each) until a large
# block is freed, which raises its threshold for the rest of the process: the same compute is 20-40%
# slower before than after, by what ran earlier. Pinned, for the processes this benchmark starts,
# so that no setup gains from the one before it.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 20))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    first_result,
    free_port,
    join_group,
    machine,
    step_on_first_batch,
    write_report,
)

TWO_STAGES = ["layers.2"]
FOUR_STAGES = ["layers.1", "layers.2", "layers.3"]
# name -> the parallel section's pipeline settings (None: one device)
SETUPS: dict[str, dict[str, Any] | None] = {
    "one device": None,
    "naive placement": {"split": TWO_STAGES, "microbatches": 1, "schedule": "gpipe"},
    "exaggerated placement": {
        "split": FOUR_STAGES,
        "microbatches": 1,
        "schedule": "interleaved",
        "stages_per_process": 2,
    },
    "pipeline, 4 micro-batches": {"split": TWO_STAGES, "microbatches": 4, "schedule": "1f1b"},
    "pipeline, 8 micro-batches": {"split": TWO_STAGES, "microbatches": 8, "schedule": "1f1b"},
}


HAND = "hand-written, 8 micro-batches"


def _trainer_step(args: argparse.Namespace, pipeline: dict[str, Any] | None) -> Any:
    """One setup's step: a Trainer of the example's config, `train_step` on the first batch."""
    parallel: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "strategy": "single"}
    if pipeline is not None:
        parallel = {"accelerator": "cpu", "devices": 2, "strategy": "pipeline"}
        parallel["pipeline"] = pipeline
    raw = {
        "name": "placement-bench",
        "model": {"class": "examples.two_tower.model.TwoTower"},
        "optimizer": {"class": "AdamW", "lr": 1e-3},
        "dataset": {"class": "examples.two_tower.data.Reviews", "batch_size": args.batch},
        "parallel": parallel,
        "hooks": [],
    }
    return step_on_first_batch(raw, ROOT)


def _hand_step(rank: int, args: argparse.Namespace) -> Any:
    """The reference: the model's two halves as stages of a hand-written 1F1B loop on
    `torch.distributed.pipelining` (8 micro-batches, the loss over the batch size with the
    schedule's scaling off), then the optimizer: the floor of the pipeline on this machine."""
    from torch.distributed import pipelining

    from examples.two_tower.data import Reviews
    from examples.two_tower.model import TwoTower

    torch.manual_seed(0)
    model = TwoTower()
    stream = Reviews().streams()["train"]
    items = [stream[i] for i in range(args.batch)]
    x = torch.stack([torch.stack([it["user_review"], it["item_review"]]) for it in items])
    y = torch.stack([it["rating"] for it in items])
    cut, rows = int(TWO_STAGES[0].rsplit(".", 1)[1]), args.batch // 8
    part = model.layers[:cut] if rank == 0 else model.layers[cut:]
    hidden = torch.empty_like(model.layers[:cut](x[:rows])).requires_grad_()
    stage = pipelining.PipelineStage(
        part,
        rank,
        2,
        torch.device("cpu"),
        input_args=x[:rows] if rank == 0 else hidden,
        output_args=hidden if rank == 0 else torch.empty(rows, requires_grad=True),
    )
    batch = args.batch
    schedule = pipelining.Schedule1F1B(
        stage,
        8,
        loss_fn=lambda out, target: (out - target).square().sum() / batch,
        scale_grads=False,
    )
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()

    return step


def _timed(step: Any, steps: int, together: bool) -> float:
    """Seconds a step takes over `steps` steps; `together`: the slowest process's."""
    if together:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - start])
    if together:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / steps


def _stage_times(args: argparse.Namespace) -> dict[str, Any]:
    """Each pipelined setup's stages alone, as chains of the model's blocks: forward and backward
    of one micro-batch (a whole gradient at the stage's output, as the next stage sends back), and
    the optimizer step over the stage's parameters; ms, by setup."""
    from examples.two_tower.data import Reviews
    from examples.two_tower.model import TwoTower

    torch.manual_seed(0)
    model = TwoTower()
    stream = Reviews().streams()["train"]
    tokens = torch.stack(
        [
            torch.stack([stream[i]["user_review"], stream[i]["item_review"]])
            for i in range(args.batch)
        ]
    )  # (batch, 2, words), as the model's forward stacks them
    times: dict[str, Any] = {}
    for name, setup in SETUPS.items():
        if setup is None or setup["microbatches"] == 1:
            continue
        x = tokens[: args.batch // setup["microbatches"]]
        work, optimizer = [], []
        for stage in _stages(setup["split"], len(model.layers)):
            part = model.layers[stage.start : stage.stop]
            x = x.detach().requires_grad_(x.is_floating_point())
            grad = torch.randn_like(part(x))
            samples = []
            for i in range(args.rounds + 2):
                start = time.perf_counter()
                for _ in range(args.steps):
                    y = part(x)
                    y.backward(grad)
                if i >= 2:  # the first two warm up
                    samples.append((time.perf_counter() - start) / args.steps)
            work.append(1e3 * statistics.median(samples))
            step = torch.optim.AdamW(part.parameters(), lr=1e-3)
            step.step()
            start = time.perf_counter()
            for _ in range(args.steps):
                step.step()
            optimizer.append(1e3 * (time.perf_counter() - start) / args.steps)
            x = y
        times[name] = {"forward_backward": work, "optimizer": optimizer}
    return times


def _stages(split: list[str], blocks: int) -> list[range]:
    cuts = [0, *(int(name.rsplit(".", 1)[1]) for name in split), blocks]
    return [range(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False)]


def _one_device(args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    step = _trainer_step(args, None)
    for _ in range(3):
        step()
    times = [_timed(step, args.steps, together=False) for _ in range(args.rounds)]
    queue.put({"one device": times, "stages alone": _stage_times(args)})


def _pair(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_group(rank, 2, port)
    steps = {name: _trainer_step(args, s) for name, s in SETUPS.items() if s is not None}
    steps[HAND] = _hand_step(rank, args)
    for step in steps.values():  # warm-up: the schedules' first step sets their buffers up
        for _ in range(3):
            step()
    times: dict[str, Any] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(_timed(step, args.steps, together=True))
    dist.barrier()
    times["stages side by side"] = _stage_times(args)  # both processes at once
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def bubble_bound(stages: dict[str, list[float]], m: int) -> float:
    """The ideal step (ms) of `m` micro-batches through stages of these times, one a process:
    `m + p - 1` slots of the slowest stage, and its optimizer step."""
    work, optimizer = stages["forward_backward"], stages["optimizer"]
    slowest = max(range(len(work)), key=lambda s: work[s])
    return (m + len(work) - 1) * work[slowest] + optimizer[slowest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "placement.json"))
    args = parser.parse_args()
    if args.batch % 8:
        parser.error("--batch must be a multiple of 8 (the pipeline's 8 micro-batches)")
    ctx = mp.get_context("spawn")
    alone = first_result(ctx, _one_device, [(args,)])
    port = free_port()
    times = {**alone, **first_result(ctx, _pair, [(r, port, args) for r in range(2)])}
    stages = {key: times.pop(f"stages {key}") for key in ("alone", "side by side")}
    base = statistics.median(times["one device"])
    print(
        f"two-tower example, batch {args.batch}, each process one CPU core; median of "
        f"{args.rounds} rounds of {args.steps} steps\n"
        f"{'setup':<28}{'ms/step':>10}{'vs one device':>16}{'vs bubble bound':>18}"
    )
    rows = {}
    for name, setup in [*SETUPS.items(), (HAND, SETUPS["pipeline, 8 micro-batches"])]:
        median = statistics.median(times[name])
        row = {"ms": 1e3 * median, "ratio": median / base}
        bound = ""
        if setup is not None and setup["microbatches"] > 1:
            of = "pipeline, 8 micro-batches" if name == HAND else name
            ideal = bubble_bound(stages["side by side"][of], setup["microbatches"])
            row["bound_ms"], row["to_bound"] = ideal, 1e3 * median / ideal
            bound = f"{row['to_bound']:.2f}x of {ideal:.1f} ms"
        rows[name] = row
        print(f"{name:<28}{row['ms']:>10.1f}{row['ratio']:>15.2f}x{bound:>18}")
    naive, eight = rows["naive placement"], rows["pipeline, 8 micro-batches"]
    print(
        f"targets: naive placement slower than one device: "
        f"{'met' if naive['ratio'] > 1 else 'NOT met'}; pipeline with 8 micro-batches within "
        f"1.15x of its bubble bound: {'met' if eight['to_bound'] <= 1.15 else 'NOT met'}"
    )
    write_report(
        {"args": vars(args), "machine": machine(), "times": times, "stages": stages, "rows": rows},
        args.output,
    )


if __name__ == "__main__":
    main()
