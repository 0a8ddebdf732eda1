"""What dropout keyed by sample costs: the forward and backward of a GPT block with dropout
(examples/gpt/model.py's Block) whose masks phalanx draws by sample (`phalanx.random`, what
`per_sample_random: true` gives every nn.Dropout), against the same block drawing from torch's
generator (`per_sample_random: false`), interleaved in one process.

    .venv/bin/python bench/keyed_dropout.py        # the CPU, and a GPU where one is visible
    .venv/bin/python bench/keyed_dropout.py --device cuda --batch 16 --seq 1024 --width 768

Prints each device's median seconds per forward and backward and the ratio keyed / torch's.
"""

from __future__ import annotations

import argparse
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


def _step(block: torch.nn.Module, x: torch.Tensor, draws: random.Draws | None) -> None:
    with random.drawing(draws):
        block(x).sum().backward()


def measure(device: str, batch: int, seq: int, width: int, rounds: int, steps: int) -> dict:
    torch.manual_seed(0)
    block = Block(width, max(1, width // 64), 0.1, bias=False).to(device)
    random.key_modules(block)
    x = torch.randn(batch, seq, width, device=device, requires_grad=True)
    keyed = random.Draws(0, 0, list(range(batch)))
    times: dict[str, list[float]] = {"torch": [], "keyed": []}
    for _ in range(2):  # warm-up
        _step(block, x, keyed)
        _step(block, x, None)
    for _ in range(rounds):
        for name, draws in (("torch", None), ("keyed", keyed)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                _step(block, x, draws)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    torch_s, keyed_s = (statistics.median(times[k]) for k in ("torch", "keyed"))
    return {
        "device": device,
        "shape": [batch, seq, width],
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
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "keyed_dropout.json"))
    args = parser.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    rows = []
    for device in devices:
        row = measure(device, args.batch, args.seq, args.width, args.rounds, args.steps)
        rows.append(row)
        print(
            f"{device}: block {row['shape']} forward+backward, torch's dropout "
            f"{1e3 * row['torch_s']:.2f} ms, keyed by sample {1e3 * row['keyed_s']:.2f} ms: "
            f"{row['ratio']:.3f}x",
            flush=True,
        )
    write_report({"benchmark": "keyed_dropout", "machine": machine(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
