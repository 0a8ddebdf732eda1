"""How right is `phalanx plan`? For each workload, the plan's predicted step time of each setup
that runs on this machine against the step time `phalanx bench` measures for it, in one run.

    .venv/bin/python bench/plan_accuracy.py            # about 5 minutes on 2 CPU cores

Workloads: the digits example (a CNN), a small MLP on the same data, a wide MLP on generated
data, the two-tower example and the tiny GPT. Setups: one device; ddp, fsdp and the pipeline
(`split: auto`, 4 micro-batches, 1f1b) on 2 processes. A measured step is the global batch over
the bench's samples/s; the error is |predicted - measured| / measured. The targets (issue: the
planner) are a mean absolute error of at most 15%, no wrong call of faster-or-slower than one
device where the true difference exceeds 15%, and the plan in under 30 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.common import machine, write_report  # noqa: E402

WORKLOADS = {
    "digits CNN": (ROOT / "examples/digits/config.yaml", ["main_loop.extra_streams=[]"]),
    "digits MLP": (
        ROOT / "examples/digits/config.yaml",
        ["model={class: toy.DigitsMLP, hidden: 32}", "main_loop.extra_streams=[]"],
    ),
    "wide MLP": (
        ROOT / "examples/digits/config.yaml",
        [
            "model={class: toy.Deep, features: 64, hidden: 512, layers: 3}",
            "dataset={class: toy.Regression, batch_size: 1024, n_train: 4096, features: 64}",
            "main_loop.extra_streams=[]",
        ],
    ),
    "two-tower": (ROOT / "examples/two_tower/config.yaml", ["main_loop.extra_streams=[]"]),
    "tiny GPT": (ROOT / "examples/gpt/tiny.yaml", ["main_loop.extra_streams=[]"]),
}
SETUPS = {  # the plan's label: the overrides that make `phalanx bench` train it
    "single": ["parallel.strategy=single"],
    "ddp x2": ["parallel.strategy=ddp"],
    "fsdp x2": ["parallel.strategy=fsdp"],
    "pipeline 2 stages, 4 mb, 1f1b": [
        "parallel.strategy=pipeline",
        "parallel.pipeline={split: auto, microbatches: 4, schedule: 1f1b}",
    ],
}


def _measured(config: Path, overrides: list[str], setup: str, steps: int, out: Path) -> float:
    """Samples/s as `phalanx bench` measures them: one device as the first of counts 1 and 2,
    so that it runs with the threads each of 2 processes gets, as the plan prices it."""
    from phalanx import commands

    if setup == "single":
        auto = [*overrides, "parallel.strategy=auto"]  # single on 1, ddp on 2
        rows = commands.bench(str(config), [1, 2], steps, auto, str(out), plan=False)
        return rows[0]["samples_per_s"]
    rows = commands.bench(
        str(config), [2], steps, [*overrides, *SETUPS[setup]], str(out), plan=False
    )
    return rows[0]["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", nargs="*", help="workload names")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "plan_accuracy.json"))
    args = parser.parse_args()
    from phalanx import config, planner

    rows = []
    for name, (path, overrides) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            plan = planner.plan(str(path), overrides, 2, output=str(Path(tmp) / "plan.json"))
            batch = config.load(str(path), overrides)[0].dataset.batch_size
            predicted = {p["setup"]: p for p in plan["predictions"]}
            for setup in SETUPS:
                if setup not in predicted:
                    continue
                rate = _measured(path, overrides, setup, args.steps, Path(tmp) / setup)
                rows.append(
                    {
                        "workload": name,
                        "setup": setup,
                        "predicted_ms": predicted[setup]["step_ms"],
                        "measured_ms": 1e3 * batch / rate,
                        "plan_s": plan["seconds"],
                    }
                )
    for name in {r["workload"] for r in rows}:  # speedups against the same workload's one device
        one = [r for r in rows if r["workload"] == name and r["setup"] == "single"]
        for r in rows:
            if r["workload"] == name and one:
                r["predicted_speedup"] = one[0]["predicted_ms"] / r["predicted_ms"]
                r["measured_speedup"] = one[0]["measured_ms"] / r["measured_ms"]
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
    wrong = [
        r
        for r in rows
        if abs(r["measured_speedup"] - 1) > 0.15
        and (r["measured_speedup"] > 1) != (r["predicted_speedup"] > 1)
    ]
    print(f"{'workload':12} {'setup':32} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
    for r, e in zip(rows, errors, strict=True):
        print(
            f"{r['workload']:12} {r['setup']:32} {r['predicted_ms']:12.1f} "
            f"{r['measured_ms']:12.1f} {100 * e:6.0f}%"
        )
    print(
        f"mean absolute error {100 * statistics.mean(errors):.0f}% (target <= 15%); wrong calls "
        f"of faster or slower: {len(wrong)} (target 0); slowest plan "
        f"{max(r['plan_s'] for r in rows):.1f} s (target < 30 s)"
    )
    write_report({"machine": machine(), "rows": rows, "errors": errors}, args.output)


if __name__ == "__main__":
    main()
