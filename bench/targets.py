"""The speed targets `make bench` checks, in one table: each benchmark's ratio of phalanx to the
loop it is paired with (a hand-written loop timed in the same process, or the same processes, in
turns; for the ddp step also counted in instructions), its target, and whether it was met, as the
results files hold them, with the machine each was measured on and the commit (+ where src/ held
changes beyond it: a file left from an older run says so). The rows of benchmarks that `make
bench` does not run (they take minutes each) are marked with *, and the table's foot gives their
commands.

    .venv/bin/python bench/targets.py                  # the files make bench writes
    .venv/bin/python bench/targets.py --results DIR    # another folder of results

A missing or unreadable file is a row that says so; the exit status is 0 either way (a benchmark is
read, not enforced: no test asserts a speed).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (results file, what the ratio pairs phalanx with, the command that writes it where make bench
# does not)
BENCHMARKS = [
    ("overhead.json", "one process: hand loop (zero_grad, forward, CE, backward, AdamW step)", ""),
    (
        "overhead_public.json",
        "one process, phalanx.fit and every default hook: the same hand loop",
        "",
    ),
    ("ddp_overhead.json", "ddp, 2 gloo processes: hand DDP loop", ""),
    (
        "ddp_instructions.json",
        "ddp step, 2 gloo processes, in instructions (callgrind): hand DDP step",
        ".venv/bin/python bench/instructions.py --world-size 2 "
        "--variants hand-ddp-step,phalanx-ddp-step",
    ),
    (
        "fsdp_overhead.json",
        "fsdp, 2 gloo processes: hand FSDP2 loop",
        ".venv/bin/python bench/ddp_overhead.py --strategy fsdp",
    ),
    (
        "mesh_overhead.json",
        "mesh shard 2 x tensor 2, 4 processes: hand TP + FSDP2 loop",
        ".venv/bin/python bench/ddp_overhead.py --strategy mesh --rounds 20",
    ),
    ("mesh_overhead_step.json", "the mesh step alone: the same hand loop", ""),
    (
        "pipeline_overhead.json",
        "pipeline, 2 gloo processes: hand pipelining loop, no agreement",
        "",
    ),
]


def row(path: Path, paired: str) -> tuple[str, ...]:
    """The table's row for one results file."""
    try:
        report = json.loads(path.read_text())
        target = report["target"]
        ratio, limit = float(target["phalanx_ratio"]), float(target["phalanx_ratio_max"])
        source = report.get("source") or report.get("phalanx_source") or {}
        commit = str(source.get("commit") or "?")[:7]
        if source.get("src_modified"):  # measured on changes not committed yet: + marks them
            commit += "+"
        where = machine(report.get("machine"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"unreadable ({e!r})"
        return path.name, paired, "-", "-", reason, "-", "-"
    met = "met" if ratio <= limit else "NOT met"
    return path.name, paired, f"{ratio:.3f}x", f"<= {limit:.2f}x", met, where, commit


def machine(described: object) -> str:
    """The processor a results file was measured on, short, and its CPU count ("?": unsaid)."""
    if not isinstance(described, dict) or not described.get("processor"):
        return "?"
    name = re.sub(r"\((R|TM)\)|\b(Processor|CPU)\b", "", str(described["processor"]))
    cpus = described.get("cpu_count")
    return " ".join(name.split()) + (f", {cpus} CPUs" if cpus else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    rows = [("results", "phalanx paired with", "ratio", "target", "", "machine", "commit")]
    rows += [
        row(args.results / name, paired + (" *" if command else ""))
        for name, paired, command in BENCHMARKS
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(
        "\nspeed targets (ratios, phalanx over the loop it is paired with: wall-clock, or "
        "instructions where the row says so):"
    )
    for r in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip())
    print("* not run by make bench; measured by:")
    for name, _, command in BENCHMARKS:
        if command:
            print(f"  {name}: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
