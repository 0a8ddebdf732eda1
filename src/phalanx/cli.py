"""The `phalanx` command: subcommands only, each calling one function of `phalanx.commands`.

Errors that are the user's to fix print as one line and exit 2; an error that the user's own code
raised (a model's forward, a dataset's item) prints with that code's frames alone and exits 1;
`--debug` shows the whole traceback.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from phalanx import __version__

if TYPE_CHECKING:
    from phalanx.nodes import Nodes

EXIT_USAGE = 2
EXIT_FAILED = 1

SUBCOMMANDS = {
    "train": (
        "train a model from a YAML config",
        """\
        examples:
          phalanx train examples/digits/config.yaml
          phalanx train examples/digits/config.yaml main_loop.epochs=5 dataset.batch_size=128
          phalanx train config.yaml hooks.3.StopAfter.epochs=5 optimizer.lr=3e-4

        on two machines (the same command on each; node 0 serves the rendezvous on the address):
          phalanx train config.yaml --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400
          phalanx train config.yaml --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400""",
    ),
    "resume": (
        "continue a run from its latest valid checkpoint",
        """\
        examples:
          phalanx resume runs/digits-20260101-120000
          phalanx resume runs/digits-20260101-120000 main_loop.epochs=30""",
    ),
    "eval": (
        "evaluate a checkpoint of a run on a stream",
        """\
        examples:
          phalanx eval runs/digits-20260101-120000
          phalanx eval runs/digits-20260101-120000 --stream valid --checkpoint latest""",
    ),
    "predict": (
        "write a checkpoint's per-sample outputs on a stream as CSV or safetensors arrays",
        """\
        example:
          phalanx predict runs/digits-20260101-120000 --stream test --output predictions.csv""",
    ),
    "export": (
        "write a checkpoint's whole model as one safetensors file that plain PyTorch loads",
        """\
        examples:
          phalanx export runs/digits-20260101-120000 --output model.safetensors
          phalanx export runs/gpt-20260101-120000 --checkpoint latest --output gpt.safetensors
          phalanx export runs/keras-20260101-120000 --output model.keras

        then, with no phalanx:
          model.load_state_dict(safetensors.torch.load_file("model.safetensors"))""",
    ),
    "bench": (
        "train a config for a few steps at each device count and show how it scales",
        """\
        examples:
          phalanx bench examples/digits/config.yaml --devices 1,2 --steps 50
          phalanx bench config.yaml --devices 1,2,4 --steps 200 --output runs/scaling""",
    ),
    "plan": (
        "predict, before the job, which strategy and device count trains a config fastest",
        """\
        examples:
          phalanx plan examples/digits/config.yaml
          phalanx plan examples/two_tower/config.yaml --devices 2 --output plan.json
          phalanx plan config.yaml --nnodes 4 --link infiniband-hdr""",
    ),
    "slurm": (
        "write a Slurm batch script that trains a config on several machines, requeued on "
        "preemption",
        """\
        examples:
          phalanx slurm config.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 \\
              --output train.sbatch
          sbatch train.sbatch""",
    ),
    "k8s": (
        "write a Kubeflow PyTorchJob manifest that trains a config on several machines",
        """\
        examples:
          phalanx k8s config.yaml --nodes 4 --gpus-per-node 8 --image registry/me/train:1 \\
              --volume-claim runs --output job.yaml
          kubectl apply -f job.yaml""",
    ),
    "ls": (
        "list the runs under a folder",
        """\
        example:
          phalanx ls runs""",
    ),
    "doctor": (
        "before a long job: try the config's devices, backend and an all-reduce among its "
        "processes",
        """\
        examples:
          phalanx doctor config.yaml
          phalanx doctor config.yaml parallel.devices=8
          phalanx doctor config.yaml --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400
              (on each machine)""",
    ),
    "info": (
        "show versions, devices and distributed backends",
        """\
        example:
          phalanx info""",
    ),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="phalanx",
        description="Train any PyTorch model on one device or many, from a YAML config.",
    )
    top.add_argument("--version", action="version", version=f"phalanx {__version__}")
    top.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # Given after the subcommand too; SUPPRESS keeps a `--debug` given before it from being reset.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the full traceback of an error",
    )
    subs = top.add_subparsers(dest="command", metavar="COMMAND")
    subs.required = True
    made = {}
    for name, (summary, examples) in SUBCOMMANDS.items():
        made[name] = subs.add_parser(
            name,
            parents=[common],
            help=summary,
            description=summary,
            epilog=textwrap.dedent(examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        made[name].set_defaults(subparser=made[name])
    # a default: without one argparse lists the overrides among the arguments a call lacks
    overrides: dict[str, Any] = dict(
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys, e.g. optimizer.lr=1e-3",
    )
    made["train"].add_argument("config", help="the YAML config file")
    made["train"].add_argument("overrides", **overrides)
    made["resume"].add_argument("run_dir", help="the run directory to continue")
    made["resume"].add_argument("overrides", **overrides)
    made["doctor"].add_argument("config", help="the YAML config file")
    made["doctor"].add_argument("overrides", **overrides)
    for name in ("train", "resume", "doctor"):
        made[name].add_argument(
            "--nnodes",
            default="1",
            help="machines in the job (default 1), or MIN:MAX for an elastic job that goes on "
            "with as few as MIN; each runs parallel.devices processes",
        )
        made[name].add_argument(
            "--node-rank", type=int, help="this machine's place among them: 0 .. nnodes-1"
        )
        made[name].add_argument(
            "--rdzv",
            metavar="HOST:PORT",
            help="where node 0 serves the rendezvous: an address of node 0 that every node reaches",
        )
    for name in ("eval", "predict"):
        made[name].add_argument("run_dir", help="a run directory")
        made[name].add_argument(
            "--stream", default="test", help="the stream to run (default: test)"
        )
        made[name].add_argument(
            "--checkpoint",
            default="auto",
            help="best, latest or a step number (default: the best, else the latest)",
        )
    made["predict"].add_argument(
        "--output",
        required=True,
        help="the file to write: CSV, or arrays where it ends in .safetensors",
    )
    made["export"].add_argument("run_dir", help="a run directory")
    made["export"].add_argument(
        "--checkpoint",
        default="auto",
        help="best, latest or a step number (default: the best, else the latest)",
    )
    made["export"].add_argument(
        "--output",
        required=True,
        help="the safetensors file to write; for a Keras model, a .keras or .weights.h5 file",
    )
    made["export"].add_argument(
        "--model",
        metavar="CLASS",
        help="for a Keras file: build the Keras model by running this class or function (the "
        "run's model.class), called with the config's model arguments; without it the model is "
        "rebuilt from the description training saved, running none of the run's code",
    )
    made["bench"].add_argument("config", help="the YAML config file")
    made["bench"].add_argument("overrides", **overrides)
    made["bench"].add_argument(
        "--devices", default="1,2", help="device counts, comma-separated (default: 1,2)"
    )
    made["bench"].add_argument(
        "--steps", type=int, default=50, help="training steps at each count (default: 50)"
    )
    made["bench"].add_argument(
        "--output", help="folder for runs, bench.json and scaling.png (default: runs/bench-<time>)"
    )
    made["bench"].add_argument(
        "--no-plan",
        action="store_true",
        help="leave out the planner's predictions beside the measurements (they take a few "
        "seconds to measure)",
    )
    made["plan"].add_argument("config", help="the YAML config file")
    made["plan"].add_argument("overrides", **overrides)
    made["plan"].add_argument(
        "--devices",
        type=int,
        help="the most devices a setup may use on this machine (default: all its GPUs, or one "
        "CPU process per core)",
    )
    made["plan"].add_argument(
        "--nnodes", type=int, default=1, help="machines like this one (default 1)"
    )
    made["plan"].add_argument(
        "--link",
        default="ethernet-10g",
        help="the link between machines, which one machine cannot measure (default "
        "ethernet-10g; also ethernet-25g, ethernet-100g, infiniband-hdr)",
    )
    made["plan"].add_argument(
        "--output", default="plan.json", help="the JSON file to write (default: plan.json)"
    )
    for name in ("slurm", "k8s"):
        made[name].add_argument(
            "config", help="the YAML config file (for k8s: its path inside the image or volume)"
        )
        made[name].add_argument("overrides", **overrides)
        made[name].add_argument("--nodes", type=int, required=True, help="machines (pods)")
        made[name].add_argument(
            "--gpus-per-node", type=int, required=True, help="GPUs on each, one process each"
        )
        made[name].add_argument("--output", help="the file to write (default: print it)")
    made["slurm"].add_argument("--time", help="the job's time limit, such as 24:00:00")
    made["slurm"].add_argument("--partition", help="the Slurm partition")
    made["slurm"].add_argument(
        "--warning-s",
        type=int,
        default=120,
        help="seconds before the time limit that the job is told to save (default 120)",
    )
    made["k8s"].add_argument(
        "--image", required=True, help="the container image with phalanx, torch and your code"
    )
    made["k8s"].add_argument(
        "--volume-claim",
        help="the PersistentVolumeClaim (ReadWriteMany) that every pod mounts for the run "
        "directories (required)",
    )
    made["k8s"].add_argument(
        "--cpus", type=int, help="CPUs each pod requests (default: num_workers + 1 per GPU)"
    )
    made["k8s"].add_argument("--memory", help="memory each pod requests (default: 16Gi per GPU)")
    made["slurm"].add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs for each GPU's process (default: dataset.num_workers + 1, 5 where it is auto)",
    )
    made["slurm"].add_argument(
        "--python",
        help="the Python that runs phalanx on the nodes, from the folder sbatch runs in (default: "
        "this one's, relative, where it lies inside the current folder; else python from the PATH)",
    )
    made["ls"].add_argument(
        "root", nargs="?", default="runs", help="the folder holding runs (default: runs)"
    )
    return top


def run(args: argparse.Namespace) -> int:
    # heavy imports (torch) only once the arguments are valid
    from phalanx import commands

    if args.command == "train":
        return commands.train(args.config, args.overrides, _nodes(args))
    if args.command == "resume":
        return commands.resume(args.run_dir, args.overrides, _nodes(args))
    if args.command == "eval":
        commands.evaluate(args.run_dir, args.stream, args.checkpoint)
    elif args.command == "predict":
        commands.predict(args.run_dir, args.stream, args.output, args.checkpoint)
    elif args.command == "export":
        commands.export(args.run_dir, args.output, args.checkpoint, args.model)
    elif args.command == "bench":
        commands.bench(
            args.config,
            _counts(args.devices),
            args.steps,
            args.overrides,
            args.output,
            not args.no_plan,
        )
    elif args.command in ("slurm", "k8s"):
        commands.cluster_job(args)
    elif args.command == "ls":
        commands.list_runs(args.root)
    elif args.command == "plan":
        from phalanx import logs, planner

        logs.setup(None)  # what it measures, said as it goes
        planner.plan(args.config, args.overrides, args.devices, args.nnodes, args.link, args.output)
    elif args.command == "doctor":
        commands.doctor(args.config, args.overrides, _nodes(args))
    elif args.command == "info":
        commands.info()
    return 0


def _nodes(args: argparse.Namespace) -> Nodes | None:
    """The job's machines from --nnodes, --node-rank and --rdzv; None for one machine."""
    from phalanx.errors import PhalanxError
    from phalanx.nodes import Nodes

    low, _, high = str(args.nnodes).partition(":")
    if (
        not low.isdigit()
        or (high and not high.isdigit())
        or int(low) < 1
        or (high and int(high) < int(low))
    ):
        raise PhalanxError(
            f"--nnodes {args.nnodes!r} is not a machine count (such as 2) or MIN:MAX with "
            "1 <= MIN <= MAX (such as 1:4)"
        )
    least, count = int(low), int(high or low)
    args.nnodes = count
    if count == 1:
        if args.node_rank not in (None, 0) or args.rdzv:
            raise PhalanxError(
                "--node-rank and --rdzv are for a job on several machines; give --nnodes too"
            )
        return None
    if args.node_rank is None or args.rdzv is None:
        raise PhalanxError(
            f"--nnodes {args.nnodes} needs --node-rank (this machine's, 0 .. {args.nnodes - 1}) "
            "and --rdzv HOST:PORT (node 0's address), the same --rdzv on every machine"
        )
    if not 0 <= args.node_rank < args.nnodes:
        raise PhalanxError(f"--node-rank {args.node_rank} is not among 0 .. {args.nnodes - 1}")
    host, _, port = args.rdzv.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PhalanxError(f"--rdzv {args.rdzv!r} is not HOST:PORT, such as 10.0.0.1:29400")
    return Nodes(
        count, args.node_rank, host.strip("[]"), int(port), least if least < count else None
    )


def _counts(text: str) -> list[int]:
    from phalanx.errors import PhalanxError

    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PhalanxError(
            f"--devices {text!r} is not a list of counts; write e.g. --devices 1,2,4"
        ) from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with each subcommand's flags and KEY=VALUE overrides in any order."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser().parse_known_args(argv)
    if rest:
        # argparse fills a subcommand's positionals up to its first flag and leaves the words after
        # it over; the subcommand's own parser reads its words again, intermixed. The subcommand is
        # the first word that is not an option (the top level's options take no values).
        at = next(i for i, word in enumerate(argv) if not word.startswith("-"))
        vars(args).update(vars(args.subparser.parse_intermixed_args(argv[at + 1 :])))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from phalanx import signals
    from phalanx.errors import PhalanxError

    # Until training starts, SIGINT and SIGTERM raise signals.Interrupted: `train` removes the run
    # directory it created, and the command exits with 128 + the signal's number.
    previous = signals.install_startup_handlers()
    try:
        return run(args)
    except PhalanxError as e:
        if args.debug:
            raise
        from phalanx.launch import RankFailure

        print(f"phalanx: error: {e}", file=sys.stderr)
        return EXIT_FAILED if isinstance(e, RankFailure) else EXIT_USAGE
    except Exception as e:  # the user's code raised, or a fault of phalanx's own
        from phalanx.errors import in_your_code

        said = None if args.debug else in_your_code(e)
        if said is None:
            raise
        print(said, file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        print("phalanx: interrupted", file=sys.stderr)
        return e.exit_code if isinstance(e, signals.Interrupted) else 130
    finally:
        signals.restore(previous)


def entry() -> None:
    """The console script: `main`, then the exit. A process that trained in a group of several
    ends with `os._exit` once its exit handlers ran and its output is flushed: gloo's threads may
    still be releasing the last collective's tensors, and the interpreter's finalization under them
    aborts a run that succeeded."""
    code = main()
    distributed = sys.modules.get("phalanx.strategies.distributed")
    if distributed is not None and distributed.left_a_group:
        import atexit
        import os

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
