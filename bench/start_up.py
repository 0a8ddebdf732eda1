"""What a run on several processes costs before and around its training: `phalanx train` of the
digits example for one epoch, timed as a whole process (the launcher, its workers, their imports,
the training and the end), this source against another checkout's, in alternation.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/start_up.py --baseline /tmp/base/src            # 2 and 4 processes

Each pair runs this source's command, then the baseline's (the same interpreter and packages,
the baseline's `src` first on PYTHONPATH), so that a drift of the machine's speed falls on both.
Reported per process count: each side's wall and CPU seconds (the processes it waited for, the
workers among them), and the ratios this/baseline of each pair, as median and spread.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, measured_source, source_state, summary, write_report  # noqa: E402

CONFIG = ROOT / "examples" / "digits" / "config.yaml"


def timed(src: Path, devices: int, out: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one `phalanx train`, with `src` first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, "-m", "phalanx.cli", "train", str(CONFIG), "main_loop.epochs=1"]
    command += [f"parallel.devices={devices}", "parallel.accelerator=cpu", f"output_root={out}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    ended = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if ended.returncode:
        raise SystemExit(f"{src}: phalanx train ended with {ended.returncode}:\n{ended.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's src folder")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "start_up.json"))
    args = parser.parse_args()
    baseline = Path(args.baseline).resolve()
    if not (baseline / "phalanx" / "cli.py").is_file():
        raise SystemExit(f"--baseline {baseline} holds no phalanx/cli.py: give a checkout's src")
    report: dict = {
        "benchmark": "start_up",
        "machine": machine(),
        "source": measured_source(),
        "baseline": source_state(baseline.parent),
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="phalanx-start-up-") as tmp:
        for devices in args.devices:
            timed(ROOT / "src", devices, Path(tmp))  # the first run of each fills the file cache
            timed(baseline, devices, Path(tmp))
            pairs = [
                (timed(ROOT / "src", devices, Path(tmp)), timed(baseline, devices, Path(tmp)))
                for _ in range(args.pairs)
            ]
            this = [p[0] for p in pairs]
            base = [p[1] for p in pairs]
            figures = {
                "wall_s": summary([w for w, _ in this]),
                "baseline_wall_s": summary([w for w, _ in base]),
                "cpu_s": summary([c for _, c in this]),
                "baseline_cpu_s": summary([c for _, c in base]),
                "wall_ratio": summary([a[0] / b[0] for a, b in pairs]),
                "cpu_ratio": summary([a[1] / b[1] for a, b in pairs]),
            }
            report["results"][str(devices)] = figures
            print(
                f"{devices} processes: wall {statistics.median(w for w, _ in this):.1f} s against "
                f"{statistics.median(w for w, _ in base):.1f} s, "
                f"{figures['wall_ratio']['median']:.3f}x "
                f"({figures['wall_ratio']['min']:.3f}-{figures['wall_ratio']['max']:.3f}); "
                f"CPU {figures['cpu_ratio']['median']:.3f}x",
                flush=True,
            )
    write_report(report, args.out)


if __name__ == "__main__":
    main()
