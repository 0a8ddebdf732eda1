"""What dropout keyed by sample costs: the forward and backward of a GPT block with dropout
(examples/gpt/model.py's Block) whose masks phalanx draws by sample (`phalanx.random`, what
`per_sample_random: true` gives every nn.Dropout), against the same block drawing from torch's
generator (`per_sample_random: false`), interleaved in one process.

    .venv/bin/python bench/keyed_dropout.py        # the CPU, and a GPU where one is visible
    .venv/bin/python bench/keyed_dropout.py --device cuda --batch 16 --seq 1024 --width 768
    .venv/bin/python bench/keyed_dropout.py --device cuda --batch 32 --seq 1024 --width 768 \
        --blocks 12 --compile    # GPT-2-small's 24 block dropouts, each model compiled

Prints each device's median seconds per forward and backward and the ratio keyed / torch's.
`--blocks N` stacks N blocks, 2N dropout sites, each with its own element keys (a GPU keeps a
hundredth of its memory of them); `--compile` compiles both stacks with torch.compile, where the
keyed masks are computed in the graph.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine, write_report  # noqa: E402
from examples.gpt.model import Block  # noqa: E402
from phalanx import random  # noqa: E402


def _step(model: torch.nn.Module, x: torch.Tensor, draws: random.Draws | None) -> None:
    with random.drawing(draws):
        model(x).sum().backward()


def measure(
    device: str,
    batch: int,
    seq: int,
    width: int,
    rounds: int,
    steps: int,
    blocks: int = 1,
    compile: bool = False,
) -> dict:
    torch.manual_seed(0)
    heads = max(1, width // 64)
    plain = torch.nn.Sequential(*(Block(width, heads, 0.1, bias=False) for _ in range(blocks)))
    plain = plain.to(device)
    keyed_model = copy.deepcopy(plain)
    random.key_modules(keyed_model)
    models = {"torch": plain, "keyed": keyed_model}
    if compile:
        random.for_compiling()
        models = {name: torch.compile(model) for name, model in models.items()}
    x = torch.randn(batch, seq, width, device=device, requires_grad=True)
    keyed = random.Draws(0, 0, list(range(batch)))
    times: dict[str, list[float]] = {"torch": [], "keyed": []}
    for _ in range(2):  # warm-up (and the compilations)
        _step(models["keyed"], x, keyed)
        _step(models["torch"], x, None)
    for _ in range(rounds):
        for name, draws in (("torch", None), ("keyed", keyed)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                _step(models[name], x, draws)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    torch_s, keyed_s = (statistics.median(times[k]) for k in ("torch", "keyed"))
    return {
        "device": device,
        "shape": [batch, seq, width],
        "blocks": blocks,
        "compiled": compile,
        "torch_s": torch_s,
        "keyed_s": keyed_s,
        "ratio": keyed_s / torch_s,
        "rounds": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=1, help="blocks stacked (2 dropouts each)")
    parser.add_argument("--compile", action="store_true", help="both stacks through torch.compile")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "keyed_dropout.json"))
    args = parser.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    rows = []
    for device in devices:
        row = measure(
            device,
            args.batch,
            args.seq,
            args.width,
            args.rounds,
            args.steps,
            args.blocks,
            args.compile,
        )
        rows.append(row)
        stack = f"{args.blocks} blocks" if args.blocks > 1 else "block"
        compiled = ", compiled" if args.compile else ""
        print(
            f"{device}: {stack} {row['shape']}{compiled} forward+backward, torch's dropout "
            f"{1e3 * row['torch_s']:.2f} ms, keyed by sample {1e3 * row['keyed_s']:.2f} ms: "
            f"{row['ratio']:.3f}x",
            flush=True,
        )
    write_report({"benchmark": "keyed_dropout", "machine": machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
