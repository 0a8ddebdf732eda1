"""Fitting a run to its devices' memory. Before it starts, `parallel.strategy: plan` and
`parallel.gradient_accumulation: auto` become what the planner measures and chooses
(`settle_planned`). While it trains, a process that runs out of device memory makes the run go on
from its last checkpoint with twice the micro-batches a step, kept in its config, until they are
single samples (`train_until_it_fits` in this process, `launch_until_it_fits` for launched
workers). The global batch and the gradients do not depend on the count, so the steps trained
again come out the same.
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import torch

from phalanx import config, launch, rundir, spawned
from phalanx.errors import ConfigError, PhalanxError
from phalanx.files import write_text_atomic
from phalanx.nodes import Nodes
from phalanx.objects import Objects
from phalanx.trainer import Trainer
from phalanx.worker import run_worker, train_in_run

log = logging.getLogger("phalanx")


def settle_planned(
    raw: dict, path: Path | None, overrides: list[str], nodes: Nodes | None, objects: Objects
) -> tuple[dict, dict | None]:
    """The raw config with `parallel.strategy: plan` and `parallel.gradient_accumulation: auto`
    replaced by the planner's choice, and the plan to record (None where neither is asked)."""
    plan: dict | None = None
    if raw.get("parallel", {}).get("strategy") == "plan":
        raw, plan = _plan(raw, path, overrides, nodes, objects)
    if raw.get("parallel", {}).get("gradient_accumulation") == "auto":
        raw, plan = _accumulation(raw, path, overrides, nodes, objects)
    return raw, plan


def _plan(
    raw: dict, path: Path | None, overrides: list[str], nodes: Nodes | None, objects: Objects
) -> tuple[dict, dict]:
    """`parallel.strategy: plan`: the raw config with the plan's choice in `parallel`, and the
    plan."""
    from phalanx import planner

    if path is None or objects or nodes is not None:
        raise ConfigError(
            "parallel.strategy=plan plans from a config file, for one machine, with the classes "
            "the config names; give a YAML file without model or dataset objects, or for several "
            "machines run `phalanx plan CONFIG --nnodes N` and name its choice"
        )
    devices = raw.get("parallel", {}).get("devices", "auto")
    settings, report = planner.choose(
        str(path), overrides, devices if isinstance(devices, int) else None
    )
    parallel = {k: v for k, v in raw.get("parallel", {}).items() if k not in ("pipeline",)}
    return {**raw, "parallel": {**parallel, **settings}}, report


def _accumulation(
    raw: dict, path: Path | None, overrides: list[str], nodes: Nodes | None, objects: Objects
) -> tuple[dict, dict]:
    """`parallel.gradient_accumulation: auto`: the raw config with the count that fits, and what
    to log."""
    from phalanx import planner

    if path is None or objects or nodes is not None:
        raise ConfigError(
            "parallel.gradient_accumulation=auto is measured from a config file, on one machine, "
            "with the classes the config names; give a YAML file without model or dataset "
            "objects, or give a number"
        )
    count, said = planner.accumulation_for(str(path), overrides)
    parallel = {**raw.get("parallel", {}), "gradient_accumulation": count}
    return {**raw, "parallel": parallel}, {"choice": said}


def record_plan(run_dir: Path, plan: dict | None) -> None:
    """The plan's choice in the run's log, and the plan beside it (where there is one)."""
    if plan is None:
        return
    log.info("%s", plan["choice"])
    if "predictions" in plan:
        write_text_atomic(run_dir / "plan.json", json.dumps(plan, indent=1))


def train_until_it_fits(run_dir: Path, count: int) -> tuple[Trainer, int]:
    """The run of this process again, from its last checkpoint, with `count` micro-batches a step;
    twice as many again while it runs out of device memory. The trainer and its exit code."""
    while True:
        # the failed attempt's tensors
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            more = [f"parallel.gradient_accumulation={count}"]
            return train_in_run(run_dir, False, more)
        except torch.OutOfMemoryError:
            doubled = double_micro_batches(run_dir, [], "the process")
            if doubled is None:
                raise
            count = doubled


def launch_until_it_fits(
    run_dir: Path,
    devices: int,
    resume: bool,
    overrides: list[str],
    restarts: int,
    rejoin: tuple[int, ...] = (),
) -> int:
    """Launch the run's workers; where one runs out of device memory, every worker has ended (the
    failing one ends the others at once: none is left waiting in a collective), so launch them
    again with twice the micro-batches a step, kept in the run's config, from the last checkpoint
    (the steps since are trained again, the same: the global batch and the gradients do not
    depend on the count); until the micro-batches are single samples."""
    while True:
        try:
            return launch.launch(
                run_dir, devices, run_worker, resume, overrides, restarts=restarts, rejoin=rejoin
            )
        except PhalanxError:
            more = _more_micro_batches(run_dir, overrides)
            if more is None:
                raise
            overrides = [*overrides, f"parallel.gradient_accumulation={more}"]


def _more_micro_batches(run_dir: Path, overrides: list[str]) -> int | None:
    """After a launch that failed: where a worker ran out of memory and a step can be cut in more
    micro-batches, twice as many, written into the run's config (and the run's log saying so)."""
    marker = run_dir / spawned.OOM_FILE
    if not marker.is_file():
        return None
    rank = marker.read_text().strip()
    marker.unlink(missing_ok=True)
    return double_micro_batches(run_dir, overrides, f"process {rank}")


def double_micro_batches(run_dir: Path, overrides: list[str], who: str) -> int | None:
    """Twice the run's micro-batches a step, written into its config and said in its log; None
    where they are single samples already."""
    saved = rundir.load_config_text(run_dir)
    cfg = config.validate(config.apply_overrides(saved, overrides))
    count, batch = cfg.parallel.accumulation, cfg.dataset.batch_size
    if count >= batch:
        log.error(
            "%s ran out of device memory with micro-batches of one sample: lower the model's "
            "size or use fsdp",
            who,
        )
        return None
    more = min(2 * count, batch)
    saved.setdefault("parallel", {})["gradient_accumulation"] = more
    write_text_atomic(run_dir / rundir.CONFIG, config.dump(saved))
    log.warning(
        "%s ran out of device memory with %d micro-batch%s a step; %sthe run goes on from its "
        "last checkpoint with %d (parallel.gradient_accumulation=%d, kept in its config)",
        who,
        count,
        "" if count == 1 else "es",
        "every process has stopped, and " if who.startswith("process") else "",
        more,
        more,
    )
    return more
