"""What a checkpoint costs the training step, written in the training thread or in the background
(`checkpoints.async: true`): the same run three ways in this process, taking turns, each timed per
step by a hook.

    .venv/bin/python bench/async_checkpoints.py                # 30 MB of weights, ~1 min
    .venv/bin/python bench/async_checkpoints.py --hidden 4000000 --rounds 5

The model is tests/toy.py's regression MLP (3 -> hidden -> 1, float64), so that a step's compute
is small next to a checkpoint of its weights and SGD's momentum: the worst case for a save. Runs:
no checkpoints; a checkpoint every `--every` steps written in the training thread; the same written
in the background. Figures: the median over rounds of each run's mean step time (the steps that
save and the others together), and the ratio to the run without checkpoints.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import toy  # noqa: E402

from bench.common import machine, measured_source, write_report  # noqa: E402
from phalanx import config  # noqa: E402
from phalanx.hooks import Hook  # noqa: E402
from phalanx.trainer import Trainer  # noqa: E402


class StepClock(Hook):
    gathers = False

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = None

    def after_batch(self, stream: str, batch: dict) -> None:
        if self.trainer.training:
            now = time.perf_counter()
            if self._last is not None:
                self.times.append(now - self._last)
            self._last = now


def one_run(args, saves: str | None) -> float:
    hooks = [{"SaveEvery": {"steps": args.every}}] if saves else []
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": args.hidden},
        optimizer={"class": "SGD", "lr": 0.01, "momentum": 0.9},
        dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 8 * args.steps},
        main_loop={"epochs": 1, "extra_streams": []},
        hooks=hooks,
        checkpoints={"async": saves == "async", "keep_last": 2},
    )
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="phalanx-async-bench-") as tmp:
        trainer = Trainer(
            config.validate(raw), Path(tmp), [ROOT / "tests"], hooks=[*trainer_hooks(raw), clock]
        )
        assert trainer.run() == 0
    return statistics.fmean(clock.times)


def trainer_hooks(raw: dict) -> list[Hook]:
    from phalanx.hooks import build_hooks

    return build_hooks(config.validate(raw), [ROOT / "tests"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hidden", type=int, default=750_000, help="hidden width (float64 weights: 40 bytes each)"
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--every", type=int, default=5, help="a checkpoint every this many steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_checkpoints.json"))
    args = parser.parse_args(argv)
    runs = {
        "no checkpoints": None,
        "saved in the training thread": "sync",
        "saved in the background": "async",
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name, saves in runs.items():
            times[name].append(one_run(args, saves))
        print(
            f"  round {round_ + 1}/{args.rounds}: "
            + ", ".join(f"{n} {1e3 * t[-1]:.1f}" for n, t in times.items())
            + " ms/step",
            flush=True,
        )
    base = statistics.median(times["no checkpoints"])
    results = {
        name: {
            "ms_per_step": 1e3 * statistics.median(t),
            "ratio": statistics.median(t) / base,
            "per_round_ms_per_step": [round(1e3 * x, 3) for x in t],
        }
        for name, t in times.items()
    }
    print(f"\n{'run':<32}{'ms/step':>10}{'ratio':>9}")
    for name, r in results.items():
        print(f"{name:<32}{r['ms_per_step']:>10.2f}{r['ratio']:>8.3f}x")
    write_report(
        {
            "benchmark": "async_checkpoints",
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": machine(),
            "phalanx_source": measured_source(),
            "settings": vars(args) | {"checkpoint_mb": 2 * 8 * (5 * args.hidden + 1) / 1e6},
            "results": results,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
