"""The `mesh` strategy's step against the loop one writes by hand on the same device mesh: four CPU
processes (gloo), data shard 2 x tensor 2, the benchmarks' MLP with its first Linear colwise and
its second rowwise, float32, AdamW.

    .venv/bin/python bench/mesh_overhead.py                  # ~2 min; hidden 512, 30 rounds
    .venv/bin/python bench/mesh_overhead.py --clip 1.0       # both loops clip the gradient norm
    .venv/bin/python bench/mesh_overhead.py --profile phalanx  # cProfile of its step (no JSON)

Each process runs three loops on one global batch (fetched once: the step alone, no data loader,
no hooks), in chunks of `--steps` optimizer steps that take turns for `--rounds` rounds (the
order reversed every other round); a chunk's wall time is the slowest process's, its CPU time all
four processes' together. The loops:

1. *hand*: what a user writes: `init_device_mesh`, `parallelize_module` (ColwiseParallel,
   RowwiseParallel) on the tensor dimension, `fully_shard` of each Linear and of the model on the
   shard dimension (bench.common.tensor_and_shard), AdamW; per step `zero_grad`, forward on this
   shard's half of the global batch, `F.cross_entropy` (mean), `backward`, `step`. phalanx clips
   nothing unless `optimizer.max_grad_norm` is set, so neither loop clips by default; with
   `--clip`, the hand loop clips as torch lets one on two device meshes: a norm per mesh
   (`get_total_norm`, `full_tensor`), their norm, `clip_grads_with_norm_` per mesh.
2. *hand + agreement*: the same, plus what phalanx's step adds that a user's does not: the
   all-reduce over the four processes of the step's loss and stop flag (float64, started after
   the forward; with `--agrees now` waited for after backward, with `--agrees late`, the
   default and what phalanx's step does, at the next step's end; the flag read on the host).
3. *phalanx mesh*: `Trainer.train_step` of a Trainer built from a config (`parallel.strategy:
   mesh`, `parallel.mesh: {shard: 2, tensor: 2, tensor_plan: ...}`, `parallel.fsdp.shard:
   [Linear]`, the same units), on the same batch.

The ratio is the median over rounds of phalanx's chunk over the hand loop's chunk of the same
round.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    MLP,
    REGISTRY,
    against_hand,
    first_result,
    free_port,
    join_group,
    machine,
    make_items,
    measured_source,
    mlp_model,
    print_profile,
    print_results,
    step_on_first_batch,
    summary,
    tensor_and_shard,
    write_report,
)

FEATURES, CLASSES, LR = 32, 10, 1e-3
SHARD, TENSOR = 2, 2
PROCESSES = SHARD * TENSOR
PLAN = {"net.0": "colwise", "net.2": "rowwise"}
HAND, AGREES, PHALANX = "hand TP + FSDP2", "hand + agreement", "phalanx mesh"
TARGET = 1.05


def clip_by_mesh(model: torch.nn.Module, max_norm: float) -> None:
    """Gradient clipping over parameters on two device meshes (a tensor plan leaves the unsplit
    layers on the shard mesh alone), as one writes it: `clip_grad_norm_` takes one mesh."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh, []).append(p)
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in groups.values()
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def hand_step(args: argparse.Namespace, items: Any, agrees: bool) -> Callable[[], None]:
    """One step of the hand loop on this shard's half of the global batch."""
    torch.manual_seed(0)
    module = MLP(FEATURES, args.hidden, CLASSES)
    model, shard = tensor_and_shard(module, SHARD, TENSOR, PLAN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per = args.batch // SHARD
    x, y = items.x[shard * per : (shard + 1) * per], items.y[shard * per : (shard + 1) * per]
    no_stop = torch.zeros(1, dtype=torch.float64)
    in_flight: list[tuple[torch.Tensor, Any]] = []  # the agreements not waited for

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if agrees:
            values = torch.cat((loss.detach().to(torch.float64).reshape(1), no_stop))
            in_flight.append((values, dist.all_reduce(values, async_op=True)))
        loss.backward()
        # now: this step's agreement; late: the step before's
        while len(in_flight) > (args.agrees == "late"):
            values, work = in_flight.pop(0)
            work.wait()
            bool(values[-1] > 0)
        if args.clip:
            clip_by_mesh(model, args.clip)
        optimizer.step()

    return step


def phalanx_step(args: argparse.Namespace, items: Any) -> Callable[[], Any]:
    """phalanx's step: a Trainer of the mesh strategy, `train_step` on the fetched batch."""
    REGISTRY["mesh"] = items
    raw = {
        "name": "mesh-bench",
        "model": mlp_model(args.hidden, FEATURES, CLASSES),
        "optimizer": {
            "class": "AdamW",
            "lr": LR,
            **({"max_grad_norm": args.clip} if args.clip else {}),
        },
        "dataset": {"class": "bench.common.SharedStreams", "key": "mesh", "batch_size": args.batch},
        "parallel": {
            "accelerator": "cpu",
            "devices": PROCESSES,
            "strategy": "mesh",
            "mesh": {"shard": SHARD, "tensor": TENSOR, "tensor_plan": PLAN},
            "fsdp": {"shard": ["Linear"]},
        },
        "hooks": [],
    }
    return step_on_first_batch(raw, ROOT)


def timed(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """`steps` steps from a barrier: (the slowest process's wall seconds, every process's CPU
    seconds together), per step."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    spent = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu])
    slowest, together = spent.clone(), spent.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(together)
    return float(slowest[0]) / steps, float(together[1]) / steps


def worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_group(rank, PROCESSES, port)
    warnings.filterwarnings("ignore")
    items = make_items(args.batch, FEATURES, CLASSES)
    loops = {
        HAND: hand_step(args, items, agrees=False),
        AGREES: hand_step(args, items, agrees=True),
        PHALANX: phalanx_step(args, items),
    }
    if args.profile:
        return profile(rank, args, loops[PHALANX if args.profile == "phalanx" else HAND], queue)
    for step in loops.values():
        timed(step, args.warmup)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}
    for i in range(args.rounds):
        # the order reversed every other round: neither loop always runs right after the other
        for name in list(loops)[:: -1 if i % 2 else 1]:
            times[name].append(timed(loops[name], args.steps))
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def profile(rank: int, args: argparse.Namespace, step: Callable[[], Any], queue: Any) -> None:
    import cProfile

    timed(step, args.warmup)
    profiler = cProfile.Profile()
    steps = args.rounds * args.steps
    profiler.enable()
    timed(step, steps)
    profiler.disable()
    if rank == 0:
        loop = PHALANX if args.profile == "phalanx" else HAND
        print_profile(profiler, steps, f"{loop} steps on rank 0", args.profile_top)
        queue.put(None)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, times: dict[str, list[tuple[float, float]]]) -> dict:
    results = {
        name: {
            kind: {
                **against_hand([t[i] for t in ts], [t[i] for t in times[HAND]]),
                "per_round_ms_per_step": [round(1e3 * t[i], 4) for t in ts],
            }
            for i, kind in enumerate(("wall", "cpu"))
        }
        for name, ts in times.items()
    }
    # phalanx's step less the agreement: against the hand loop that agrees too
    results[PHALANX]["wall"]["ratio_vs_agreement"] = summary(
        [p[0] / a[0] for p, a in zip(times[PHALANX], times[AGREES], strict=True)]
    )
    ratio = results[PHALANX]["wall"]["ratio_vs_hand"]["median"]
    return {
        "benchmark": "mesh_overhead",
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "settings": {**vars(args), "processes": PROCESSES, "shard": SHARD, "tensor": TENSOR},
        "plan": PLAN,
        "machine": machine(),
        "phalanx_source": measured_source(),
        "target": {"phalanx_ratio_max": TARGET, "phalanx_ratio": ratio, "met": ratio <= TARGET},
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=128, help="the global batch")
    parser.add_argument("--steps", type=int, default=20, help="steps per chunk")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="uncounted steps of each loop")
    parser.add_argument("--clip", type=float, default=None, help="both loops clip to this norm")
    parser.add_argument(
        "--agrees",
        choices=("now", "late"),
        default="late",
        help="when the hand + agreement loop waits for its agreement: at the step's end (now), or "
        "at the next step's end (late, as phalanx's step)",
    )
    parser.add_argument(
        "--profile",
        choices=("phalanx", "hand"),
        default=None,
        help="instead: cProfile that loop's steps on rank 0 (no JSON)",
    )
    parser.add_argument("--profile-top", type=int, default=25, help="rows of the profile")
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "mesh_overhead_step.json")
    )
    args = parser.parse_args()
    if args.batch % SHARD or min(args.steps, args.rounds, args.warmup) < 1:
        parser.error(f"--batch must divide by {SHARD}; --steps, --rounds, --warmup at least 1")
    ctx = mp.get_context("spawn")
    port = free_port()
    times = first_result(ctx, worker, [(r, port, args) for r in range(PROCESSES)])
    if args.profile:
        return
    out = report(args, times)
    print(
        f"{PROCESSES} processes (gloo), shard {SHARD} x tensor {TENSOR}, MLP hidden {args.hidden}, "
        f"global batch {args.batch}, clip {args.clip}; {args.rounds} rounds of {args.steps} steps"
    )
    print_results(out["results"], 20)
    against = out["results"][PHALANX]["wall"]["ratio_vs_agreement"]
    print(
        f"{PHALANX} against {AGREES}: {against['median']:.3f}x "
        f"(IQR {against['q1']:.3f}-{against['q3']:.3f})"
    )
    t = out["target"]
    print(
        f"target: {PHALANX} <= {TARGET:.2f}x {HAND} (wall-clock): "
        f"{'met' if t['met'] else 'NOT met'} ({t['phalanx_ratio']:.3f}x)"
    )
    write_report(out, args.out)


if __name__ == "__main__":
    main()
