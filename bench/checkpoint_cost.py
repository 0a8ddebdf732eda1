"""What a synchronous checkpoint costs against writing the same files by hand, and how much host
memory `checkpoints.async: true` holds while its write is in flight.

    .venv/bin/python bench/checkpoint_cost.py                 # 100 M parameters, ~2 min
    .venv/bin/python bench/checkpoint_cost.py --layers 6 --rounds 3

The model: `--layers` Linear(2048, 2048) layers in float32 (24: 100.7 M parameters), after one
Adam step (its two moments: 2 x the weights). Taking turns in one process, each round:

- `hand`: what a hand-written loop does, `safetensors.torch.save_file` of the state dict,
  `torch.save` of the optimizer's state dict, an fsync of each;
- `phalanx`: `phalanx.checkpoint.Checkpoints.save`, the call the trainer makes at every save (the
  same two files, a trainer.json, a manifest with each file's size and SHA-256, fsyncs, an atomic
  rename);
- `async`: the time `Background.submit` holds the training thread (the copy to host memory), and
  the resident memory it adds until the write is committed.

Each timing starts after `os.sync()`, so that no write-back of the one before falls into it. The
hand-written folder is removed outside its timing; phalanx's save includes its pruning of the step
before (`keep_last: 1`).

Figures: the median over rounds, and the ratio to `hand` of the same round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import machine, measured_source, write_report  # noqa: E402
from phalanx.background import Background  # noqa: E402
from phalanx.checkpoint import Checkpoints  # noqa: E402


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def by_hand(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    folder.mkdir()
    weights, state = folder / "model.safetensors", folder / "optimizer.pt"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    with open(state, "wb") as f:
        torch.save(optimizer.state_dict(), f)
    for path in (weights, state):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="Linear(2048, 2048) layers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_cost.json"))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(args.layers)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.1f} M parameters, {args.rounds} rounds", flush=True)

    times: dict[str, list[float]] = {"hand": [], "phalanx": [], "async (blocks)": []}
    held: list[float] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-checkpoint-bench-") as tmp:
        root = Path(tmp)
        saves = Checkpoints(root / "checkpoints", keep_last=1)
        background = Background(Checkpoints(root / "async", keep_last=1), lambda step, best: None)
        for round_ in range(args.rounds):
            os.sync()  # every timing starts with nothing of the previous one left to write back
            start = time.perf_counter()
            by_hand(root / "hand", model, optimizer)
            times["hand"].append(time.perf_counter() - start)
            shutil.rmtree(root / "hand")  # outside the timing, as phalanx's pruning is

            os.sync()
            start = time.perf_counter()
            saves.save(round_ + 1, model, optimizer.state_dict(), {"step": round_ + 1})
            times["phalanx"].append(time.perf_counter() - start)

            os.sync()
            before = resident_bytes()
            start = time.perf_counter()
            background.submit(round_ + 1, model, optimizer.state_dict(), {"step": round_ + 1})
            times["async (blocks)"].append(time.perf_counter() - start)
            held.append((resident_bytes() - before) / 1e9)
            background.wait()
            print(
                f"  round {round_ + 1}/{args.rounds}: "
                + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items())
                + f", async holds {held[-1]:.2f} GB",
                flush=True,
            )
    hand = times["hand"]
    results = {
        name: {
            "seconds": statistics.median(t),
            "ratio_to_hand": statistics.median([a / b for a, b in zip(t, hand, strict=True)]),
            "per_round_s": [round(x, 3) for x in t],
        }
        for name, t in times.items()
    }
    results["async host memory"] = {"gb": statistics.median(held), "per_round_gb": held}
    print(f"\n{'':<18}{'seconds':>9}{'x hand':>9}")
    for name in times:
        r = results[name]
        print(f"{name:<18}{r['seconds']:>9.2f}{r['ratio_to_hand']:>8.3f}x")
    print(f"async holds {statistics.median(held):.2f} GB of host memory while it writes")
    write_report(
        {
            "benchmark": "checkpoint_cost",
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": machine(),
            "phalanx_source": measured_source(),
            "settings": vars(args) | {"parameters": parameters},
            "results": results,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
