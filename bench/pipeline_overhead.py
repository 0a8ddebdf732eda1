"""The `pipeline` strategy's step against a hand-written `torch.distributed.pipelining` loop on the
same split and schedule: two CPU processes (gloo), the benchmarks' MLP split at `net.2`.

    .venv/bin/python bench/pipeline_overhead.py                       # 1f1b, 4 micro-batches
    .venv/bin/python bench/pipeline_overhead.py --schedule gpipe --microbatches 8
    .venv/bin/python bench/pipeline_overhead.py --agreement-cost      # the hand loops alone

Each process runs both loops on a fixed batch, in chunks of `--steps` optimizer steps that
alternate (hand, phalanx, hand, ...) for `--rounds` rounds; a chunk's time is the slower process's.
The hand loop is what a user writes: the model's two halves as stages with their shapes given, the
schedule with a loss of the micro-batch's sum over the batch size (`scale_grads=False`, so the
gradient is the batch mean's, as phalanx's), then the optimizer; with `--hand-agrees`, also the
all-reduce by which every process learns the step's loss and stop flag, as phalanx's step does.
phalanx's step is `Trainer.train_step` on the same batch, fetched once: its padding, the contract's
weights, the loss and stop agreement over the processes, as a loop that reads no step's loss runs it
(`read=False`): the agreements of `--agree-every` steps go as one message, as `fit` sends them
between the steps whose loss a hook reads (`--agree-every 1`: a message every step). The ratio is
the median of the rounds' phalanx/hand ratios (150 rounds by default, about 40 s: with 30, runs on
a 2-core machine spread over 0.96-1.24 between their quartiles).

`--agreement-cost` times no phalanx: the hand loop as users write it against the same loop agreeing
behind the step (late), at its end (now), and behind every `--every` steps on all of theirs at once
(every), in the same alternation, and prints each one's ratio to the first: what the processes'
transport charges any loop that agrees on its loss every step, and what is left of it when the
agreements are fewer. It writes no JSON.

`--opcodes STEPS` times nothing either: each process counts the Python opcodes that STEPS steps of
each loop execute on its main thread, and the script prints each stage's totals a step and the
functions whose counts differ the most between the loops (the same figures on every run).
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    MLP,
    first_result,
    free_port,
    join_group,
    machine,
    make_items,
    measured_source,
    mlp_model,
    step_on_first_batch,
    write_report,
)

FEATURES, CLASSES = 32, 10
# issue 34's: phalanx's step against the hand loop as users write it (no agreement)
TARGET = 1.10


def _hand(rank: int, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> Any:
    """The hand loop's step: the model's halves as stages, the schedule, the optimizer."""
    from torch.distributed import pipelining

    torch.manual_seed(0)
    model = MLP(FEATURES, args.hidden, CLASSES)
    part = model.net[:2] if rank == 0 else model.net[2:]
    rows = args.batch // args.microbatches
    hidden = torch.empty(rows, args.hidden, requires_grad=True)
    stage = pipelining.PipelineStage(
        part,
        rank,
        2,
        torch.device("cpu"),
        input_args=x[:rows] if rank == 0 else hidden,
        output_args=hidden if rank == 0 else torch.empty(rows, CLASSES, requires_grad=True),
    )
    kind = pipelining.Schedule1F1B if args.schedule == "1f1b" else pipelining.ScheduleGPipe
    batch = args.batch
    schedule = kind(
        stage,
        args.microbatches,
        loss_fn=lambda out, target: F.cross_entropy(out, target, reduction="sum") / batch,
        scale_grads=False,
    )
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)
    behind: list[Any] = []  # the step before's agreement, in flight
    every = args.every if args.hand_agrees == "every" else 1
    period: list[torch.Tensor] = []  # the values of the steps since the last agreement

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        if args.hand_agrees == "now":  # every process learns the step's loss and stop flag
            dist.all_reduce(torch.zeros(4, dtype=torch.float64))
        optimizer.step()
        if args.hand_agrees in ("late", "every"):  # behind the step, read by the next agreeing
            period.append(torch.zeros(4, dtype=torch.float64))
            if len(period) < every:  # ... or every `--every` steps, their values in one
                return
            work = dist.all_reduce(torch.stack(period), async_op=True)
            period.clear()
            if behind:
                behind.pop().wait()
            behind.append(work)

    return step


def _phalanx(args: argparse.Namespace, items: Any) -> Any:
    """phalanx's step: a Trainer of the pipeline strategy, `train_step` on the fetched batch."""
    from bench import common

    common.REGISTRY["pipeline"] = items
    raw = {
        "name": "pipeline-bench",
        "model": mlp_model(args.hidden, FEATURES, CLASSES),
        "optimizer": {"class": "SGD", "lr": 0.01},
        "dataset": {
            "class": "bench.common.SharedStreams",
            "key": "pipeline",
            "batch_size": args.batch,
        },
        "parallel": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "pipeline",
            "pipeline": {
                "split": ["net.2"],
                "microbatches": args.microbatches,
                "schedule": args.schedule,
                "agree_every": args.agree_every,
            },
        },
        "hooks": [],
    }
    return step_on_first_batch(raw, ROOT, read=False)


def _worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_group(rank, 2, port)
    items = make_items(args.batch, FEATURES, CLASSES)
    x, y = items.x, items.y
    if args.agreement_cost:
        modes = {
            "hand, no agreement": None,
            "hand, late agreement": "late",
            "hand, now agreement": "now",
            f"hand, late, every {args.every} steps": "every",
        }
        loops = {
            name: _hand(rank, argparse.Namespace(**{**vars(args), "hand_agrees": mode}), x, y)
            for name, mode in modes.items()
        }
    else:
        loops = {"hand": _hand(rank, args, x, y), "phalanx": _phalanx(args, items)}
    for step in loops.values():  # warm-up: the schedules' first step sets their buffers up
        for _ in range(3):
            step()
    if args.opcodes:
        counted = _opcodes(loops, args.opcodes)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, counted)
        if rank == 0:
            queue.put(gathered)
        dist.barrier()
        dist.destroy_process_group()
        return
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, step in loops.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed) / args.steps)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def _opcodes(loops: dict[str, Any], steps: int) -> dict[str, dict[str, float]]:
    """Each loop's Python opcodes a step on this process's main thread, by function (file: name;
    phalanx's files by their path in the package)."""
    from bench.instructions import opcode_census

    counted: dict[str, dict[str, float]] = {}
    for name, step in loops.items():
        dist.barrier()
        by_function: dict[str, float] = {}
        for (file, _, function), n in opcode_census(step, steps).items():
            where = file.rsplit("/phalanx/", 1)[-1] if "/phalanx/" in file else Path(file).name
            key = f"{where}: {function}"
            by_function[key] = by_function.get(key, 0.0) + n / steps
        counted[name] = by_function
    return counted


def print_opcodes(stages: list[dict[str, dict[str, float]]], top: int) -> None:
    """Each stage's opcodes a step in both loops, and the functions that differ the most."""
    for k, counted in enumerate(stages):
        hand, mine = counted["hand"], counted["phalanx"]
        print(
            f"stage {k}: hand loop {sum(hand.values()):,.0f} Python opcodes a step, phalanx "
            f"{sum(mine.values()):,.0f} ({sum(mine.values()) - sum(hand.values()):+,.0f})"
        )
        keys = sorted(set(hand) | set(mine), key=lambda f: -abs(mine.get(f, 0) - hand.get(f, 0)))
        for key in keys[:top]:
            a, b = hand.get(key, 0.0), mine.get(key, 0.0)
            print(f"  {b - a:+8.0f}  {a:8.0f}  {b:8.0f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--hand-agrees",
        choices=("now", "late", "every"),
        help="the hand loop also all-reduces the step's loss and stop flag: at the step's end "
        "(now), behind the step, waited for at the next one's end (late, as phalanx's step), or "
        "behind every `--every` steps, all of theirs at once (every)",
    )
    parser.add_argument(
        "--every", type=int, default=8, help="steps a hand loop agreeing `every` agrees on at once"
    )
    parser.add_argument(
        "--agree-every",
        type=int,
        default=8,
        help="phalanx's parallel.pipeline.agree_every: steps whose agreements go in one message",
    )
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument(
        "--agreement-cost",
        action="store_true",
        help="instead: the hand loop against itself agreeing late, now and every `--every` steps "
        "(no phalanx, no JSON)",
    )
    parser.add_argument(
        "--output", default=str(ROOT / "bench" / "results" / "pipeline_overhead.json")
    )
    parser.add_argument(
        "--opcodes",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: count each loop's Python opcodes over STEPS steps on each stage, and print "
        "the functions that differ the most (repeatable to the opcode; no timing, no JSON)",
    )
    parser.add_argument("--top", type=int, default=20, help="functions listed with --opcodes")
    args = parser.parse_args()
    if args.agreement_cost and args.hand_agrees:
        parser.error(
            "--agreement-cost times the hand loop in every way it agrees; drop --hand-agrees"
        )
    ctx = mp.get_context("spawn")
    port = free_port()
    times = first_result(ctx, _worker, [(r, port, args) for r in range(2)])
    if args.opcodes:
        print_opcodes(times, args.top)
        return
    if args.agreement_cost:
        print_agreement_cost(times, args)
        return
    ratios = [p / h for p, h in zip(times["phalanx"], times["hand"], strict=True)]
    ratio = statistics.median(ratios)
    hand, mine = statistics.median(times["hand"]), statistics.median(times["phalanx"])
    q = statistics.quantiles(ratios, n=4)
    agrees = f"; the hand loop agrees on the loss ({args.hand_agrees})" if args.hand_agrees else ""
    print(
        f"2 processes (gloo), MLP hidden {args.hidden} split at net.2, batch {args.batch}, "
        f"{args.microbatches} micro-batches, {args.schedule}; {args.rounds} rounds of "
        f"{args.steps} steps; phalanx agrees every {args.agree_every} steps{agrees}\n"
        f"hand pipelining loop  {1e3 * hand:.3f} ms/step\n"
        f"phalanx pipeline      {1e3 * mine:.3f} ms/step   ratio {ratio:.3f}x "
        f"(IQR {q[0]:.3f}-{q[2]:.3f})\n"
        f"target: <= {TARGET:.2f}x the hand loop as users write it: "
        + (
            ("met" if ratio <= TARGET else "NOT met")
            if args.hand_agrees is None
            else "not this run (its hand loop agrees)"
        )
    )
    report: dict[str, Any] = {
        "args": vars(args),
        "machine": machine(),
        "phalanx_source": measured_source(),
        "times": times,
        "ratios": ratios,
    }
    if args.hand_agrees is None:  # the target's pairing
        report["target"] = {
            "phalanx_ratio_max": TARGET,
            "phalanx_ratio": ratio,
            "met": ratio <= TARGET,
        }
    write_report(report, args.output)


def print_agreement_cost(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    names = list(times)
    base = times[names[0]]
    print(
        f"2 processes (gloo), MLP hidden {args.hidden} split at net.2, batch {args.batch}, "
        f"{args.microbatches} micro-batches, {args.schedule}; {args.rounds} rounds of "
        f"{args.steps} steps; the hand loop against itself"
    )
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(times[name], base, strict=True))
        print(f"{name:<32}{1e3 * statistics.median(times[name]):.3f} ms/step   ratio {ratio:.3f}x")


if __name__ == "__main__":
    main()
