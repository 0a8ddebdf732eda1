"""What an epoch's sample order costs before its first batch: the time and the peak memory of a
process that builds the order and takes the first global batch's indices, at 10^6, 10^8 and 10^10
samples. `feistel`: the order phalanx uses (`phalanx.data.Order`, computed per position); `list`:
the order of runs that began before it (`torch.randperm(n).tolist()`, every index held, measured
where it fits: 10^10 would take about 360 GB).

    .venv/bin/python bench/orders.py                  # about a minute; --sizes 1e6 1e8 1e10

Each case runs in a fresh process; its peak memory is the process's maximum resident set size
minus that of the same process before it built the order (torch and phalanx imported).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, measured_source, write_report  # noqa: E402

CASE = """
import json, resource, sys, time
import torch
from phalanx import data
kind, n, batch = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
order = data.epoch_order(0, 1, n, data.FEISTEL if kind == "feistel" else data.RANDPERM)
first = data.Plan(order, batch).step(0)[0].shard
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": seconds, "peak_mb": peak / 1024, "first": first[:3]}))
"""


def case(kind: str, n: float, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CASE, kind, str(n), str(batch)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e8, 1e10])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument(
        "--list-limit", type=float, default=1e8, help="largest size the list order is measured at"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "orders.json"))
    args = parser.parse_args()
    results = []
    for n in args.sizes:
        row = {"samples": n, "feistel": case("feistel", n, args.batch)}
        if n <= args.list_limit:
            row["list"] = case("list", n, args.batch)
        results.append(row)
        parts = [
            f"{kind} {r['seconds'] * 1e3:9.1f} ms {r['peak_mb']:9.1f} MB"
            for kind, r in row.items()
            if kind != "samples"
        ]
        print(f"n = {n:8.0e}: " + " | ".join(parts), flush=True)
    write_report(
        {
            "machine": machine(),
            "source": measured_source(),
            "batch": args.batch,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
