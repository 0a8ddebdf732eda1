"""What each CLI subcommand does; `cli.py` only parses arguments and calls one of these."""

from __future__ import annotations

import json
import logging
import os
import platform
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from phalanx import (
    __version__,
    api,
    config,
    environment,
    evaluation,
    keras_models,
    launch,
    logs,
    metrics,
    rundir,
    runlock,
    strategies,
)
from phalanx import nodes as machines
from phalanx.checkpoint import Checkpoints
from phalanx.errors import PhalanxError
from phalanx.files import check_output, read_json, write_atomic, write_text_atomic
from phalanx.model import build_model
from phalanx.nodes import Nodes

log = logging.getLogger("phalanx")


def train(config_path: str, overrides: list[str], nodes: Nodes | None = None) -> int:
    """`phalanx train`: a new run from a config file (see `phalanx.fit`); returns the exit code."""
    return api.fit(config_path, overrides=overrides, nodes=nodes).code


def resume(run_path: str, overrides: list[str], nodes: Nodes | None = None) -> int:
    """`phalanx resume`: continue a run (see `phalanx.resume`); returns the exit code."""
    return api.resume(run_path, overrides=overrides, nodes=nodes).code


def evaluate(run_path: str, stream: str, which: str) -> dict[str, Any]:
    """`phalanx eval`: a checkpoint's metrics on a stream, printed and saved as JSON (printed
    first: a run directory that cannot be written loses no result)."""
    result = evaluation.evaluate(run_path, stream, which, save=False)
    evaluation.print_metrics(Path(run_path), result)
    evaluation.save_result(Path(run_path), result)
    return result


def predict(run_path: str, stream: str, output: str, which: str) -> int:
    """`predictions` written as CSV, or whole as arrays where `output` is a .safetensors file;
    returns the sample count."""
    check_output(output, "predictions.csv", evaluation.PREDICTION_FILES, Path(run_path))
    arrays, collect = evaluation.predictions(run_path, stream, which)
    return evaluation.write_predictions(arrays, collect, stream, output)


def export(run_path: str, output: str, which: str, model: str | None = None) -> int:
    """A checkpoint's whole model, whole or sharded on any process count, as one safetensors file;
    returns the number of tensors. The model's code is not needed: the checkpoint holds every
    name. A Keras model may go to Keras's own files instead (see `_export_keras`)."""
    check_output(
        output, "model.safetensors", (".safetensors", *keras_models.KERAS_FILES), Path(run_path)
    )
    if output.endswith(keras_models.KERAS_FILES):
        return _export_keras(run_path, Path(output), which, model)
    if model is not None:
        raise PhalanxError(
            f"--model builds a Keras model for a .keras or .weights.h5 output; {output!r} is "
            "written from the checkpoint alone: leave --model out"
        )
    logs.setup(None)
    run_dir = rundir.open_run(run_path)
    checkpoints = Checkpoints(run_dir / "checkpoints")
    step = checkpoints.select(which, weights_only=True)
    count = checkpoints.export(step, Path(output))
    logs.out.print(f"wrote {count} tensors of {run_dir.name} at step {step} to {output}")
    return count


def _export_keras(run_path: str, output: Path, which: str, model: str | None) -> int:
    """A Keras model's checkpoint as Keras saves it: the whole model (`.keras`) or its weights
    (`.weights.h5`), which Keras loads. The model is rebuilt from the description training saved of
    it, running none of the run's code; only with `model` (a dotted path, given by the user) is it
    built by that class or function, called with the run config's model arguments."""
    logs.setup(None)
    run_dir = rundir.open_run(run_path, announce=model is not None)
    cfg = config.validate(rundir.load_config_text(run_dir))
    if model is None:
        module = keras_models.rebuilt(run_dir, cfg.model.class_)
    else:
        built = build_model(
            cfg.model.model_copy(update={"class_": model}), rundir.search_dirs(run_dir)
        )
        if not isinstance(built, keras_models.KerasModule):
            raise PhalanxError(
                f"--model {model} built a {type(built).__name__}, not a Keras model; name what "
                "builds the run's Keras model, or write a .safetensors file"
            )
        module = built
    # the checkpoint's weights, loaded into the module's parameters, which Keras reads
    api.load(run_dir, which if not which.isdigit() else int(which), model=module)
    keras_model = module.keras_model
    keras_models.save(keras_model, output)
    logs.out.print(f"wrote {len(keras_model.weights)} Keras weights of {run_path} to {output}")
    return len(keras_model.weights)


def cluster_job(args: Any) -> str:
    """`phalanx slurm` or `phalanx k8s`: the job file for the config, written to --output or
    printed."""
    from phalanx import clusters

    cfg, _ = config.load(args.config, args.overrides)
    if args.command == "slurm":
        text = clusters.slurm_script(
            cfg,
            args.config,
            args.nodes,
            args.gpus_per_node,
            args.time,
            args.partition,
            args.warning_s,
            args.overrides,
            args.cpus_per_task,
            args.python,
        )
    else:
        text = clusters.pytorchjob(
            cfg,
            args.config,
            args.nodes,
            args.gpus_per_node,
            args.image,
            args.volume_claim,
            args.overrides,
            args.cpus,
            args.memory,
        )
    if args.output:
        check_output(args.output, "job" + (".sbatch" if args.command == "slurm" else ".yaml"))
        write_text_atomic(Path(args.output), text)
        logs.out.print(f"wrote {args.output}")
    else:
        print(text, end="")
    return text


def list_runs(root: str) -> list[dict[str, Any]]:
    """A table of the runs under `root`: status, progress, checkpoints."""
    rows = [_run_row(run_dir, Path(root)) for run_dir in rundir.list_runs(Path(root))]
    table = Table(title=f"runs in {root}")
    for column in ("run", "status", "epoch", "step", "latest", "best", "updated"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    folder = Path(root)
    missing = (
        ""
        if folder.is_dir()
        else " (it is a file)"
        if folder.exists()
        else " (there is no such folder)"
    )
    logs.out.print(table if rows else f"no runs in {root}{missing}")
    return rows


# the trace's events that end a run: any other last event, with the lock left unheld, is a run whose
# process was killed
_ENDS = ("finished", "failed", "interrupted")


def _run_row(run_dir: Path, root: Path) -> dict[str, Any]:
    """A run's row of `list_runs`: what its files hold that has the shape phalanx writes; a run
    whose folders cannot be read is shown as damaged, not a crash of the listing."""
    row: dict[str, Any] = dict.fromkeys(("epoch", "step", "latest", "best", "updated"), "")
    row = {"run": str(run_dir.relative_to(root)), "status": "new", **row}
    try:
        events = rundir.read_trace(run_dir)
        steps = Checkpoints(run_dir / "checkpoints").steps()
        best = _best(run_dir / "checkpoints" / "best.json")
    except OSError as e:
        return {**row, "status": f"damaged ({e.strerror or e})"}
    last: dict[str, Any] = next((e for e in reversed(events) if e["event"] != "checkpoint"), {})
    status = last.get("event", "new")
    lock = runlock.state(run_dir)
    if lock == "held":
        status = "training"
    elif lock == "left" and status not in _ENDS:
        status = "killed"  # its process ended without recording how
    return {
        **row,
        "status": status,
        "epoch": last.get("epoch") if type(last.get("epoch")) is int else "",
        "step": last.get("step") if type(last.get("step")) is int else "",
        "latest": steps[-1] if steps else "",
        "best": best,
        "updated": _when(last.get("time")),
    }


def _when(stamp: Any) -> str:
    """A trace event's time as the table shows it; a damaged one as nothing."""
    if type(stamp) not in (int, float):
        return ""
    try:
        return datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return ""


def _best(path: Path) -> str:
    """best.json as `variable=value @ step`; a damaged one is shown as such, not a crash of the
    listing."""
    if not path.is_file():
        return ""
    try:
        best = read_json(path)
        variable, value, step = best["variable"], float(best["value"]), best["step"]
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "best.json unreadable"
    if not isinstance(variable, str) or type(step) is not int:
        return "best.json unreadable"
    return f"{variable[:60]}={value:.4g} @ {step}"


def info() -> dict[str, Any]:
    """Versions, devices and distributed backends of this machine."""
    import pydantic
    import safetensors

    dist = torch.distributed
    facts: dict[str, Any] = {
        "phalanx": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pydantic": pydantic.__version__,
        "safetensors": safetensors.__version__,
        "platform": platform.platform(),
        "cpu cores": os.cpu_count(),
        "cuda": torch.version.cuda or "not built",
        "cuda devices": torch.cuda.device_count(),
        "backends": ", ".join(
            b
            for b, ok in (
                ("gloo", dist.is_gloo_available()),
                ("nccl", dist.is_nccl_available()),
                ("mpi", dist.is_mpi_available()),
            )
            if ok
        )
        or "none",
    }
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        facts[f"cuda:{i}"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    table = Table(title="phalanx info", show_header=False)
    for key, value in facts.items():
        table.add_row(key, str(value))
    logs.out.print(table)
    return facts


def doctor(config_path: str, overrides: list[str], nodes: Nodes | None = None) -> list[dict]:
    """Before a long job: the config's devices and backend, tried by the processes the job would
    start: each one's device computes, and an all-reduce among them returns the right sum in time.
    Returns each process's report; a process that fails is one error naming it."""
    import tempfile

    info()
    cfg, _ = config.load(config_path, overrides)
    accelerator, devices = strategies.resolve_device(cfg)
    backend = (
        cfg.parallel.backend
        if cfg.parallel.backend != "auto"
        else ("nccl" if accelerator == "cuda" else "gloo")
    )
    with tempfile.TemporaryDirectory(prefix="phalanx-doctor-") as tmp:
        folder = Path(tmp)
        # other nodes check they see it
        (folder / rundir.CONFIG).write_text(config.dump(rundir.resolved(cfg)))
        if nodes is not None or devices > 1:
            store = machines.join(nodes) if nodes is not None else None
            launch.launch(
                folder, devices, doctor_worker, accelerator, backend, nodes=nodes, store=store
            )
        else:
            doctor_worker(folder, accelerator, backend)
        reports = [
            json.loads(p.read_text())
            for p in sorted(folder.glob("doctor-*.json"), key=lambda p: int(p.stem[7:]))
        ]
    table = Table(title=f"phalanx doctor: {len(reports)} process(es) on {accelerator}, {backend}")
    for column in ("rank", "device", "computes", "all-reduce", "all-reduce ms"):
        table.add_column(column)
    for r in reports:
        table.add_row(
            str(r["rank"]),
            r["device"],
            "ok",
            "ok" if r["sum_ok"] else "WRONG SUM",
            f"{r['all_reduce_ms']:.2f}" if r["all_reduce_ms"] is not None else "-",
        )
    logs.out.print(table)
    wrong = [r["rank"] for r in reports if not r["sum_ok"]]
    if wrong:
        raise PhalanxError(
            f"the all-reduce gave a wrong sum on rank(s) {wrong}: the processes do not reach each "
            "other as they should; check the network interface (GLOO_SOCKET_IFNAME, "
            "NCCL_SOCKET_IFNAME)"
        )
    logs.out.print(f"all {len(reports)} process(es) ready")
    return reports


def doctor_worker(folder: Path, accelerator: str, backend: str) -> int:
    """One process's checks (a launched worker, or the only process): see `doctor`."""
    import time

    place = environment.here()
    if place.in_group:
        from phalanx.strategies.distributed import ProcessGroup

        group = ProcessGroup(accelerator, timeout_s=60, backend=backend)
        device, rank, world = group.device, group.rank, group.world_size
    else:
        group, device, rank, world = None, torch.device(accelerator), 0, 1
    x = torch.randn(256, 256, device=device)
    if not torch.isfinite(x @ x).all():
        raise PhalanxError(f"rank {rank}: a matrix product on {device} gave non-finite values")
    elapsed, sum_ok = None, True
    if group is not None:
        values = torch.full((1024,), float(rank + 1), device=device)
        torch.distributed.all_reduce(values.clone())  # the first one sets the connections up
        started = time.perf_counter()
        for _ in range(10):
            out = values.clone()
            torch.distributed.all_reduce(out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - started) / 10 * 1e3
        sum_ok = bool((out == world * (world + 1) / 2).all())
    report = {"rank": rank, "device": str(device), "sum_ok": sum_ok, "all_reduce_ms": elapsed}
    (folder / f"doctor-{rank}.json").write_text(json.dumps(report))
    if group is not None:
        group.shutdown()
    return 0


def bench(
    config_path: str,
    devices: list[int],
    steps: int,
    overrides: list[str],
    output: str | None,
    plan: bool = True,
) -> list[dict]:
    """Train a config for `steps` steps at each device count; print and save the scaling table,
    beside what `phalanx plan` predicted for each count (where `plan`)."""
    if not devices or min(devices) < 1 or steps < 2:
        raise PhalanxError(
            f"--devices needs counts >= 1 and --steps at least 2 (got {devices}, {steps})"
        )
    out_dir = Path(output or f"runs/bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    predicted = _predict_speeds(config_path, overrides, devices) if plan else {}
    # each count runs as `phalanx train` runs it: on the CPU, one process with its own threads and
    # several sharing the cores (`parallel.cpu_threads`), which each row says
    accelerator = [] if torch.cuda.is_available() else ["parallel.accelerator=cpu"]
    warmup = min(5, steps // 2)
    hooks = (
        f"hooks=[{{LogThroughput: {{every_n_steps: {steps}, warmup_steps: {warmup}}}}}, "
        f"{{StopAfter: {{steps: {steps}}}}}]"
    )
    made = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    try:
        rows = _bench_runs(
            config_path, devices, [*overrides, *accelerator, hooks], out_dir, predicted
        )
    except BaseException:
        # a run that failed before it trained is discarded: the folders made for it go too
        for folder in made:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    rows = metrics.scaling(rows)
    write_text_atomic(
        out_dir / "bench.json",
        json.dumps(
            {"config": str(config_path), "steps": steps, "rows": rows},
            indent=1,
        ),
    )
    _plot_scaling(rows, out_dir / "scaling.png")
    _print_scaling(rows, out_dir)
    return rows


def _bench_runs(
    config_path: str,
    devices: list[int],
    overrides: list[str],
    out_dir: Path,
    predicted: dict[int, float],
) -> list[dict]:
    """Train the config at each device count in `out_dir`; a row each, beside the prediction."""
    rows = []
    for n in devices:
        name = f"devices{n}"
        fixed = [
            f"parallel.devices={n}",
            f"output_root={out_dir}",
            f"name={name}",
            "main_loop.epochs=1000000",
            "main_loop.extra_streams=[]",
            "main_loop.skip_zeroth_epoch=true",
        ]
        code = train(config_path, [*overrides, *fixed])
        if code != 0:
            raise PhalanxError(
                f"the run on {n} device(s) ended with exit code {code}; see {out_dir}"
            )
        [run_dir] = sorted(out_dir.glob(f"{name}-*"))[-1:]
        summary = json.loads((run_dir / "throughput.json").read_text())
        measured = summary.get("samples_per_s", 0.0)
        guess = predicted.get(n)
        rows.append(
            {
                "devices": n,
                "samples_per_s": measured,
                "tokens_per_s": summary.get("tokens_per_s"),
                "cpu_threads": summary.get("cpu_threads"),
                "mfu": summary.get("mfu"),
                **_shares(summary),
                "predicted_samples_per_s": guess,
                "prediction_error": (guess - measured) / measured if guess and measured else None,
            }
        )
    return rows


def _predict_speeds(config_path: str, overrides: list[str], devices: list[int]) -> dict[int, float]:
    """What the planner predicts for the config's strategy at each device count (samples/s), or
    nothing where it cannot plan on this machine (it says why)."""
    from phalanx import planner

    try:
        report = planner.plan(config_path, overrides, max(devices), output=None, show=False)
    except PhalanxError as e:
        logs.out.print(f"no predictions beside the measurements: {e}")
        return {}
    named = config.load(config_path, overrides)[0].parallel.strategy
    out = {}
    for n in devices:
        strategy = "single" if n == 1 else ("ddp" if named == "auto" else named)
        fitting = [
            p
            for p in report["predictions"]
            if p["strategy"] == strategy and (p["devices"] == n or strategy == "single")
        ]
        # the best variant of it (the ranking's order)
        if fitting:
            out[n] = fitting[0]["samples_per_s"]
    return out


def _shares(summary: dict[str, Any]) -> dict[str, float]:
    """Each part's share of a run's time. The gradient reduction that overlaps backward is timed
    inside forward and backward; the part of it that computation did not hide is waiting, so it is
    moved to communication (DDP's sampled average per step, times the steps)."""
    profile = dict(summary["profile"])
    sampled = summary.get("backward_communication_s")
    if sampled:
        waited = max(sampled["per_step"] - sampled["hidden"], 0.0) * summary.get("steps", 0)
        waited = min(waited, profile.get("forward_backward", 0.0))
        profile["forward_backward"] = profile.get("forward_backward", 0.0) - waited
        profile["communication"] = profile.get("communication", 0.0) + waited
    total = sum(profile.values()) or 1.0
    return {f"{k}_share": v / total for k, v in profile.items()}


def _print_scaling(rows: list[dict], out_dir: Path) -> None:
    title = f"scaling ({out_dir}); efficiency = throughput(N) / (N x throughput(1))"
    threads = any(r.get("cpu_threads") for r in rows)
    if threads:
        title += "; CPU threads: each process's"
    table = Table(title=title)
    for column in (
        "devices",
        *(["threads"] if threads else []),
        "samples/s",
        "predicted",
        "error",
        "tokens/s",
        "speedup",
        "efficiency",
        "MFU",
        "data",
        "fwd+bwd",
        "comm",
        "optimizer",
        "hooks",
    ):
        table.add_column(column, justify="right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    for r in rows:
        table.add_row(
            str(r["devices"]),
            *([str(r.get("cpu_threads") or "-")] if threads else []),
            f"{r['samples_per_s']:,.0f}",
            "-" if not r.get("predicted_samples_per_s") else f"{r['predicted_samples_per_s']:,.0f}",
            "-" if r.get("prediction_error") is None else f"{100 * r['prediction_error']:+.0f}%",
            "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            pct(r["efficiency"]),
            pct(r["mfu"]),
            *(
                pct(r.get(f"{k}_share"))
                for k in ("data", "forward_backward", "communication", "optimizer", "hooks")
            ),
        )
    logs.out.print(table)


def _plot_scaling(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    devices = [r["devices"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(devices, [r["samples_per_s"] for r in rows], marker="o", label="measured")
    base = next((r["samples_per_s"] for r in rows if r["devices"] == 1), None)
    if base:
        ax.plot(
            devices,
            [base * n for n in devices],
            linestyle="--",
            color="gray",
            label="perfect scaling",
        )
    ax.set(xlabel="devices", ylabel="samples/s", title="throughput by device count", xticks=devices)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
