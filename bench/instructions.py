"""Instructions per step, counted by callgrind: figures that repeat to the instruction on a machine
whose wall-clock timings cannot resolve differences under a few percent.

    .venv/bin/python bench/instructions.py                      # the ddp pairs, about 5 min
    .venv/bin/python bench/instructions.py --variants hand-step,phalanx-step --steps 50
    .venv/bin/python bench/instructions.py --native --steps 3   # without valgrind: no counts
    .venv/bin/python bench/instructions.py --opcodes 40 --variants hand-epoch,phalanx-epoch
    .venv/bin/python bench/instructions.py --world-size 2 --variants hand-ddp-step,phalanx-ddp-step

Each variant is a function that runs one optimizer step on a fixed batch (`*-step`) or one epoch of
`--epoch-steps` steps with its data loading and hooks (`*-epoch`), on the tiny MLP of
bench/common.py:

    hand-step, phalanx-step          one process, no DDP: the hand loop against `single`
    hand-ddp-step, phalanx-ddp-step  DDP over gloo at world size 1: the hand loop against `ddp`
    hand-epoch, phalanx-epoch, hand-ddp-epoch, phalanx-ddp-epoch   the same, whole epochs

The script runs itself under `valgrind --tool=callgrind --instr-atstart=no`, so torch's import runs
uninstrumented. A small C extension (bench/cgmark.c, built on first use with the system's C compiler
and valgrind's headers) starts instrumentation, zeroes the counters, calls a variant exactly
`--steps` times (`--epochs` times for the epoch variants) and dumps the counters under its name. The
figures are the main thread's instructions per step; gloo's threads are counted apart and left out.
Instructions are not time: the same count can take longer where it misses caches more, and at world
size 2 phalanx's extra instructions cost about twice their share of the step (BENCHMARKS.md).

`--world-size 2` counts the ddp steps (`hand-ddp-step`, `phalanx-ddp-step`) in a group of two: rank
0 runs under callgrind as above, and rank 1 runs the same variants natively beside it (gloo's waits
block, so rank 0's count does not depend on how long it waits). Each rank computes its own fixed
batch of 64 samples, as at world size 1; the all-reduces are real. Where it counts both, it writes
their ratio against the ddp step's target in instructions, at most the hand step's (`--output`,
bench/results/ddp_instructions.json, a row of bench/targets.py): unlike the wall-clock ratio, its
runs agree within about a thousand instructions of 3.7 million a step, so a step that grows shows
itself however loud the machine is.

`--cache` adds callgrind's cache simulation (32 KB first-level caches, a 512 KB last level, a
core's own L2 here) and prints each variant's last-level misses a step beside its instructions:
memory that a step touches beyond what the caches hold, which instruction counts do not see
(where the allocator puts each object decides which lines collide: they move a little between runs).

Callgrind counts the interpreter, not the Python functions it runs. `--opcodes N` runs without
valgrind and counts instead the Python bytecode instructions each variant executes on the main
thread (a trace of every opcode, in seconds), per step and by function: each variant's total,
phalanx's over its hand loop's, and the N phalanx functions that execute the most. These counts
repeat exactly too, and name the Python that a step adds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import collections  # noqa: E402
import hashlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FEATURES, HIDDEN, CLASSES, BATCH, LR = 32, 128, 10, 64, 1e-3
DATA_KEY = "instructions"
PAIRS = [
    ("hand-step", "phalanx-step"),
    ("hand-ddp-step", "phalanx-ddp-step"),
    ("hand-epoch", "phalanx-epoch"),
    ("hand-ddp-epoch", "phalanx-ddp-epoch"),
]
VARIANTS = [name for pair in PAIRS for name in pair]
DEFAULT = "hand-ddp-step,phalanx-ddp-step,hand-ddp-epoch,phalanx-ddp-epoch"
# the ddp step's target in instructions, beside its wall-clock one (bench/ddp_overhead.py): at
# world size 2, no more a step on rank 0's main thread than the hand DDP step's (bench/targets.py)
TARGET = 1.0
TARGET_FILE = ROOT / "bench" / "results" / "ddp_instructions.json"


# --- the variants (in the worker) -----------------------------------------------------------------


def make_variant(name: str, tmp: Path, epoch_steps: int) -> Callable[[], None]:
    """A function running one step (or one epoch) of variant `name`."""
    from bench.common import REGISTRY, make_items

    REGISTRY.setdefault(DATA_KEY, make_items(epoch_steps * BATCH, FEATURES, CLASSES))
    ddp = "-ddp-" in name
    if name.startswith("hand"):
        return _hand(ddp, name.endswith("epoch"))
    trainer = _phalanx(ddp, tmp / name)
    return _phalanx_step(trainer) if name.endswith("step") else _phalanx_epoch(trainer)


def _hand(ddp: bool, epoch: bool) -> Callable[[], None]:
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from bench.common import MLP, REGISTRY, hand_steps

    torch.manual_seed(0)
    module = MLP(FEATURES, HIDDEN, CLASSES)
    model = DistributedDataParallel(module) if ddp else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    dataset, total = REGISTRY[DATA_KEY], torch.zeros(())
    if epoch:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
        return lambda: hand_steps(model, optimizer, iter(loader), len(loader), total)
    batch = next(iter(DataLoader(dataset, batch_size=BATCH)))
    return lambda: hand_steps(model, optimizer, iter((batch,)), 1, total)


# the trainers begun, ended before their run directories go (their writers' threads write there)
_STARTED: list = []


def _phalanx(ddp: bool, tmp: Path):
    from bench.common import mlp_model, phalanx_trainer
    from phalanx.strategies.ddp import DDP

    raw = {
        "name": "instructions",
        "model": mlp_model(HIDDEN, FEATURES, CLASSES),
        "optimizer": {"class": "AdamW", "lr": LR},
        "dataset": {"class": "bench.common.SharedStreams", "key": DATA_KEY, "batch_size": BATCH},
        "parallel": {"accelerator": "cpu"},
        "seed": 0,
        "main_loop": {"epochs": 1 << 20},
        "output_root": str(tmp / "runs"),
    }
    tmp.mkdir(parents=True, exist_ok=True)
    trainer, _, _ = phalanx_trainer(raw, tmp, [], [ROOT], strategy=DDP("cpu") if ddp else None)
    trainer.begin_training()
    _STARTED.append(trainer)
    return trainer


def _phalanx_step(trainer) -> Callable[[], None]:
    """Trainer.train_step on a fixed batch: what one optimizer step costs, data and hooks aside."""
    from phalanx import batching, data

    stream = data.get_stream(trainer.dataset, "train")
    plan = data.Plan(range(len(stream)), BATCH)
    fetched = [
        (micro, batching.collate([stream[i] for i in micro.shard])) for micro in plan.step(0)
    ]
    return lambda: trainer.train_step(fetched)


def _phalanx_epoch(trainer) -> Callable[[], None]:
    """One epoch of the trainer's own step loop, from its plan and loader to its after_batch hooks;
    the epoch end (evaluation, after_epoch hooks, checkpoint) left out."""
    return lambda: trainer.train_epoch(end=False)


def worker(args) -> int:
    """Inside valgrind (or natively): build the variants, warm each up, count each."""
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.update(
        RANK=str(args.rank),
        LOCAL_RANK=str(args.rank),
        WORLD_SIZE=str(args.world_size),
        LOCAL_WORLD_SIZE=str(args.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
    )
    dist.init_process_group("gloo")
    run = _runner(args.native, args.opcodes, args.epoch_steps)
    try:
        with tempfile.TemporaryDirectory(prefix="phalanx-instructions-") as tmp:
            names = args.variants.split(",")
            variants = [make_variant(name, Path(tmp), args.epoch_steps) for name in names]
            for name, variant in zip(names, variants, strict=True):
                for _ in range(
                    -(-args.warmup // args.epoch_steps) if is_epoch(name) else args.warmup
                ):
                    variant()
            for name, variant in zip(names, variants, strict=True):
                run(variant, args.epochs if is_epoch(name) else args.steps, name)
            while _STARTED:
                _STARTED.pop().end_training()
    finally:
        from phalanx import logs

        logs.setup(None)
        dist.destroy_process_group()
    return 0


def _runner(
    native: bool, opcodes: int | None = None, epoch_steps: int = 1
) -> Callable[[Callable, int, str], None]:
    if opcodes is not None:
        return _opcode_runner(opcodes, epoch_steps)
    if native:

        def run(f: Callable, n: int, name: str) -> None:
            import torch.distributed as dist

            for _ in range(n):
                f()
            place = f"rank {dist.get_rank()} of {dist.get_world_size()}"
            print(f"{name}: {n} calls, not counted (--native, {place})", flush=True)

        return run
    sys.path.insert(0, os.environ["PHALANX_CGMARK_DIR"])
    import cgmark

    return cgmark.run


def opcode_census(f: Callable[[], None], n: int) -> collections.Counter:
    """The Python opcodes that `n` calls of `f` execute in this thread, by function (file, first
    line, name)."""
    census: collections.Counter = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            code = frame.f_code
            census[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(n):
            f()
    finally:
        sys.settrace(None)
    return census


def _opcode_runner(top: int, epoch_steps: int) -> Callable[[Callable, int, str], None]:
    """Each variant's census: its opcodes a step, phalanx's over the hand loop's, and the `top`
    phalanx functions that run the most."""
    totals: dict[str, float] = {}

    def run(f: Callable, n: int, name: str) -> None:
        census = opcode_census(f, n)
        steps = n * epoch_steps if is_epoch(name) else n
        totals[name] = sum(census.values()) / steps
        print(f"{name}: {totals[name]:,.0f} Python opcodes a step", flush=True)
        for hand, phalanx in PAIRS:
            if phalanx == name and hand in totals:
                print(f"{name} - {hand}: {totals[name] - totals[hand]:+,.0f} a step", flush=True)
        if name.startswith("phalanx"):
            own = [(k, c) for k, c in census.most_common() if _PHALANX in k[0]][:top]
            for (file, line, function), count in own:
                where = f"{file.rsplit(_PHALANX, 1)[1]}:{line} {function}"
                print(f"  {count / steps:10,.1f}  {where}", flush=True)

    return run


_PHALANX = f"{os.sep}phalanx{os.sep}"


# --- the parent -----------------------------------------------------------------------------------


def build_extension() -> Path:
    """bench/cgmark.c compiled for this Python, in a cache folder keyed by its source and Python."""
    source = ROOT / "bench" / "cgmark.c"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256(source.read_bytes() + suffix.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"phalanx-cgmark-{key}"
    target = folder / f"cgmark{suffix}"
    if target.exists():
        return folder
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise SystemExit(
            "bench/instructions.py: no C compiler (cc or gcc) to build bench/cgmark.c; install gcc"
        )
    folder.mkdir(parents=True, exist_ok=True)
    built = subprocess.run(
        [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            str(source),
            "-o",
            str(target),
        ],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        hint = (
            " (valgrind's headers are missing: install valgrind)"
            if "callgrind.h" in built.stderr
            else ""
        )
        raise SystemExit(
            f"bench/instructions.py: building bench/cgmark.c failed{hint}:\n{built.stderr}"
        )
    return folder


def is_epoch(variant: str) -> bool:
    return variant.endswith("-epoch")


def counts(folder: Path) -> dict[str, int]:
    """Main-thread instructions, by variant, from callgrind's dumps (thread 01 of each)."""
    return {name: found["Ir"] for name, found in events(folder).items()}


def events(folder: Path) -> dict[str, dict[str, int]]:
    """Each variant's main-thread events (instructions `Ir`; with the cache simulation its misses
    too), from callgrind's dumps (thread 01 of each)."""
    found = {}
    for dump in sorted(folder.glob("out.*-01")):
        text = dump.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.MULTILINE)
        names = re.search(r"^events: (.+)$", text, re.MULTILINE)
        total = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.MULTILINE)
        if name and total:
            kinds = names.group(1).split() if names else ["Ir"]
            found[name.group(1).strip()] = dict(
                zip(kinds, map(int, total.group(1).split()), strict=True)
            )
    return found


# what `--cache` simulates: 32 KB first-level caches and a 512 KB last level, a core's own L2 on
# the 2-core machines here (their L3 is shared with other tenants)
CACHES = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=524288,8,64"]
MISSES = ("ILmr", "DLmr", "DLmw")  # the last level's: instruction reads, data reads, data writes


def report(found: dict[str, dict[str, int]], args) -> None:
    def per_step(name: str, kinds: tuple[str, ...]) -> float:
        steps = args.epochs * args.epoch_steps if is_epoch(name) else args.steps
        return sum(found[name].get(kind, 0) for kind in kinds) / steps

    columns: list[tuple[str, tuple[str, ...]]] = [("instructions/step", ("Ir",))]
    if args.cache:
        columns.append(("LL misses/step", MISSES))
    head = "".join(f"{title:>18}" for title, _ in columns)
    print(f"\n{'variant':<20}{head}")
    for name in found:
        print(f"{name:<20}" + "".join(f"{per_step(name, k):>18,.0f}" for _, k in columns))
    print(f"\n{'phalanx over hand':<40}" + "".join(f"{t:>18}{'ratio':>8}" for t, _ in columns))
    for hand, phalanx in PAIRS:
        if hand in found and phalanx in found:
            row = f"{phalanx + ' - ' + hand:<40}"
            for _, kinds in columns:
                mine, theirs = per_step(phalanx, kinds), per_step(hand, kinds)
                row += f"{mine - theirs:>+18,.0f}{mine / theirs:>8.3f}"
            print(row)


def write_target(found: dict[str, dict[str, int]], args, path: Path) -> dict[str, Any] | None:
    """The ddp steps' counts at world size 2 against `TARGET`, written to `path` as
    bench/targets.py reads a benchmark's; None, and nothing written, for any other count."""
    steps = ("hand-ddp-step", "phalanx-ddp-step")
    if args.world_size != 2 or not set(steps) <= set(found):
        return None
    from bench.common import machine, measured_source, write_report

    hand, mine = (found[name]["Ir"] / args.steps for name in steps)
    report: dict[str, Any] = {
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("port", "rank", "worker")
        },
        "machine": machine(),
        "phalanx_source": measured_source(),
        "instructions_per_step": {steps[0]: hand, steps[1]: mine},
        "target": {
            "phalanx_ratio": mine / hand,
            "phalanx_ratio_max": TARGET,
            "met": mine / hand <= TARGET,
        },
    }
    write_report(report, path)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", default=DEFAULT, help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="steps counted for each *-step variant"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs counted for each *-epoch variant"
    )
    parser.add_argument(
        "--epoch-steps", type=int, default=20, help="steps in an epoch of the *-epoch variants"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="uncounted steps of each variant first (whole epochs for the *-epoch variants)",
    )
    parser.add_argument(
        "--native", action="store_true", help="run the variants without valgrind; count nothing"
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="also simulate the caches (32 KB L1s, a 512 KB last level): its misses a step; slower",
    )
    parser.add_argument(
        "--opcodes",
        type=int,
        metavar="N",
        help="without valgrind: Python opcodes a step, and the N phalanx functions running most",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: count the ddp steps in a group of two (rank 1 runs natively beside)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=TARGET_FILE,
        help="where the ddp steps' counts at world size 2 go, against their target (JSON)",
    )
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if min(args.steps, args.epochs, args.epoch_steps) < 1 or args.warmup < 0:
        parser.error("--steps, --epochs and --epoch-steps must be at least 1, --warmup at least 0")
    if args.opcodes is not None and args.opcodes < 0:
        parser.error("--opcodes takes the number of phalanx functions to list, 0 or more")
    if args.cache and (args.native or args.opcodes is not None):
        parser.error("--cache is callgrind's; drop --native and --opcodes, which run without it")
    if args.world_size == 2:
        steps = {"hand-ddp-step", "phalanx-ddp-step"}
        if not set(args.variants.split(",")) <= steps or args.opcodes is not None:
            parser.error(
                "--world-size 2 counts the ddp steps alone: give --variants "
                "hand-ddp-step,phalanx-ddp-step (one or both), without --opcodes"
            )
    from bench.common import free_port

    args.port = args.port or free_port()
    if args.worker:
        return worker(args)
    if args.native or args.opcodes is not None:
        rank1 = second_rank(args) if args.world_size == 2 else None
        code = 1
        try:
            code = worker(args)
        finally:
            code = finished(rank1, code)
        return code
    return measure(args)


def second_rank(args) -> subprocess.Popen:
    """Rank 1 of a `--world-size 2` count: the same variants, run natively in a process of its own
    (its output kept apart, shown if it fails)."""
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--worker",
            "--native",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--variants",
            args.variants,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--port",
            str(args.port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(rank1: subprocess.Popen | None, code: int) -> int:
    """`code`, once rank 1 (where there is one) has ended (at once where rank 0 failed: it would
    wait for rank 0's next collective); its output where it failed."""
    if rank1 is None:
        return code
    if code != 0:
        rank1.kill()
    try:
        out, _ = rank1.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        rank1.kill()
        out, _ = rank1.communicate()
    if rank1.returncode != 0 and code == 0:
        print(f"rank 1 failed (exit code {rank1.returncode}):\n{out[-3000:]}", file=sys.stderr)
        return 1
    return code


def measure(args) -> int:
    if shutil.which("valgrind") is None:
        raise SystemExit(
            "bench/instructions.py needs valgrind (Debian: apt install valgrind), or --native"
        )
    extension = build_extension()
    with tempfile.TemporaryDirectory(prefix="phalanx-callgrind-") as out:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            *(["--cache-sim=yes", *CACHES] if args.cache else []),
            f"--callgrind-out-file={out}/out",
            sys.executable,
            __file__,
            "--worker",
            "--variants",
            args.variants,
            "--steps",
            str(args.steps),
            "--epochs",
            str(args.epochs),
            "--epoch-steps",
            str(args.epoch_steps),
            "--warmup",
            str(args.warmup),
            "--world-size",
            str(args.world_size),
            "--port",
            str(args.port),
        ]
        print(
            "running under callgrind (minutes: torch's import alone takes about two) ...",
            flush=True,
        )
        rank1 = second_rank(args) if args.world_size == 2 else None
        done = subprocess.run(
            command,
            env={**os.environ, "PHALANX_CGMARK_DIR": str(extension)},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
            return finished(rank1, 1)
        if finished(rank1, 0) != 0:
            return 1
        found = events(Path(out))
    missing = [v for v in args.variants.split(",") if v not in found]
    if missing:
        print(f"no counts for {missing}: callgrind wrote no dump for them", file=sys.stderr)
        return 1
    report(found, args)
    write_target(found, args, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
