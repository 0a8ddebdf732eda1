"""Job files for clusters: a Slurm batch script and a Kubeflow PyTorchJob manifest that run a config
on several machines, written from the command line (`phalanx slurm`, `phalanx k8s`).

The Slurm script starts one `phalanx` per device with `srun` (phalanx reads Slurm's variables: see
`environment.py`). Its run directory is `<output_root>/slurm-<job id>/<name>-<time>`, so that a job
that Slurm requeues (after preemption, or a node's failure) finds its run again and resumes it.
Preemption: `--signal=USR1@<seconds>` sends the tasks SIGUSR1 before the time limit; they finish
the same step, save and exit 138, and the script requeues the job.

The PyTorchJob runs `torchrun` in each pod (the operator gives it the node count, this pod's rank
and the master's address through PET_* variables); the operator schedules the pods as a gang where
the cluster's scheduler supports it (`schedulingPolicy.minAvailable`). Its run directory is
`/runs/<name>/<name>-<time>` on the volume every pod mounts (`--volume-claim`): a failed pod fails the job
(`backoffLimit: 0`; pods that restart one by one would not meet again), and the job applied again
resumes the run from its last checkpoint.
"""

from __future__ import annotations

import copy
import re
import shlex
import sys
from pathlib import Path

import yaml

from phalanx.config import Config
from phalanx.errors import PhalanxError

PREEMPTED = 128 + 10  # SIGUSR1's exit code
RUNS_MOUNT = "/runs"  # where a PyTorchJob's pods mount the volume that holds the run directories


def slurm_script(
    cfg: Config,
    config_path: str,
    nodes: int,
    gpus_per_node: int,
    time: str | None = None,
    partition: str | None = None,
    warning_s: int = 120,
    overrides: list[str] = (),
) -> str:
    """An sbatch script for `config_path` on `nodes` machines of `gpus_per_node` GPUs each."""
    _check_counts(nodes, gpus_per_node)
    if time is not None and not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", time):
        raise PhalanxError(
            f"--time {time!r} is not a Slurm time limit such as 04:00:00 or 2-00:00:00"
        )
    root = shlex.quote(str(Path(cfg.output_root).resolve()))
    config = shlex.quote(str(Path(config_path).resolve()))
    extra = "".join(" " + shlex.quote(o) for o in overrides)
    phalanx = f"{shlex.quote(sys.executable)} -m phalanx.cli"  # the Python this command ran in, on every node
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus_per_node}",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        *([f"#SBATCH --time={time}"] if time else []),
        *([f"#SBATCH --partition={partition}"] if partition else []),
        f"#SBATCH --signal=USR1@{warning_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=slurm-%j.out",
        "# Written by `phalanx slurm`. One phalanx per GPU; a requeued job resumes its run. Before the time",
        f"# limit, and on preemption, the tasks get SIGUSR1: they finish the same step, save and exit {PREEMPTED},",
        "# and the job is requeued.",
        "set -uo pipefail",
        f"ROOT={root}/slurm-$SLURM_JOB_ID",
        "RUN=$(find \"$ROOT\" -mindepth 2 -maxdepth 2 -name config.yaml -printf '%h\\n' 2>/dev/null | head -n 1)",
        'if [ -n "$RUN" ]; then',
        f'    COMMAND=(resume "$RUN"{extra})',
        "else",
        f'    COMMAND=(train {config} "output_root=$ROOT" parallel.accelerator=cuda parallel.devices={gpus_per_node}{extra})',
        "fi",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        f'srun --kill-on-bad-exit=1 {phalanx} "${{COMMAND[@]}}"',
        "CODE=$?",
        f'if [ "$CODE" -eq {PREEMPTED} ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$CODE"',
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def pytorchjob(
    cfg: Config,
    config_path: str,
    nodes: int,
    gpus_per_node: int,
    image: str,
    volume_claim: str | None = None,
    overrides: list[str] = (),
) -> str:
    """A Kubeflow PyTorchJob manifest (YAML) for `config_path` in `image`, on `nodes` pods of
    `gpus_per_node` GPUs each. The config path is the one inside the image (or the volume)."""
    _check_counts(nodes, gpus_per_node)
    if not image:
        raise PhalanxError(
            "--image names the container image that holds phalanx, torch and your code"
        )
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-") or "phalanx"
    root = f"{RUNS_MOUNT if volume_claim else cfg.output_root}/{name}"
    extra = " ".join(shlex.quote(o) for o in overrides)
    run = (
        'torchrun -m phalanx.cli resume "$RUN" ' + extra
        if extra
        else 'torchrun -m phalanx.cli resume "$RUN"'
    )
    script = "; ".join(
        [
            f"ROOT={shlex.quote(root)}",
            'RUN=$(find "$ROOT" -mindepth 2 -maxdepth 2 -name config.yaml 2>/dev/null | head -n 1 | xargs -r dirname)',
            f'if [ -n "$RUN" ]; then exec {run}; fi',
            f'exec torchrun -m phalanx.cli train {shlex.quote(config_path)} "output_root=$ROOT" '
            f"parallel.accelerator=cuda parallel.devices={gpus_per_node} {extra}".rstrip(),
        ]
    )
    container = {
        "name": "pytorch",
        "image": image,
        "command": ["/bin/sh", "-c", script],
        "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
    }
    pod = {"containers": [container]}
    if volume_claim:  # the run directory: one file system that every pod shares
        container["volumeMounts"] = [{"name": "runs", "mountPath": RUNS_MOUNT}]
        pod["volumes"] = [{"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}}]
    specs = {
        "Master": {
            "replicas": 1,
            "restartPolicy": "Never",
            "template": {"spec": copy.deepcopy(pod)},
        }
    }
    if nodes > 1:
        specs["Worker"] = {
            "replicas": nodes - 1,
            "restartPolicy": "Never",
            "template": {"spec": copy.deepcopy(pod)},
        }
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "nprocPerNode": str(gpus_per_node),
            "runPolicy": {
                "backoffLimit": 0,
                "cleanPodPolicy": "None",
                "schedulingPolicy": {"minAvailable": nodes},
            },
            "pytorchReplicaSpecs": specs,
        },
    }
    header = (
        "# Written by `phalanx k8s`: a PyTorchJob (Kubeflow training operator). Every pod runs torchrun,\n"
        "# which reads the node count, this pod's rank and the master from the operator's PET_* variables.\n"
        f"# The run directory is under {root}: applied again, the job resumes it.\n"
    )
    return header + yaml.safe_dump(manifest, sort_keys=False, width=1000)


def _check_counts(nodes: int, gpus_per_node: int) -> None:
    if nodes < 1 or gpus_per_node < 1:
        raise PhalanxError(
            f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}"
        )
