"""Job files for clusters: a Slurm batch script and a Kubeflow PyTorchJob manifest that run a config
on several machines, written from the command line (`phalanx slurm`, `phalanx k8s`).

The Slurm script starts one `phalanx` per device with `srun` (phalanx reads Slurm's variables: see
`environment.py`), from the folder sbatch was run in: the config, `output_root` and the Python are
written as given, so relative paths are that folder's, not the paths of the machine that wrote the
script. Its run directory is `<output_root>/slurm-<job id>/<name>-<time>`, so that a job that Slurm
requeues (after preemption, or a node's failure) finds its run again and resumes it. Preemption:
`--signal=USR1@<seconds>` sends the tasks SIGUSR1 before the time limit; they finish the same step,
save and exit 138, and the script requeues the job.

The PyTorchJob runs `torchrun` in each pod (the operator gives it the node count, this pod's rank
and the master's address through PET_* variables); the operator schedules the pods as a gang where
the cluster's scheduler supports it (`schedulingPolicy.minAvailable`). Its run directory is
`/runs/<name>/<name>-<time>` on the volume every pod mounts (`--volume-claim`, required: on each
pod's own disk nothing could resume): a failed pod fails the job (`backoffLimit: 0`; pods that
restart one by one would not meet again), and the job applied again resumes the run from its last
checkpoint. Every name and value written into a script is quoted, into a manifest dumped as YAML.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from phalanx.config import Config
from phalanx.errors import ConfigError, PhalanxError, did_you_mean

PREEMPTED = 128 + 10  # SIGUSR1's exit code
# where a PyTorchJob's pods mount the volume that holds the run directories
RUNS_MOUNT = "/runs"
# beyond these a count is a typo, not a cluster
MAX_NODES, MAX_GPUS = 10_000, 64


def slurm_script(
    cfg: Config,
    config_path: str,
    nodes: int,
    gpus_per_node: int,
    time: str | None = None,
    partition: str | None = None,
    warning_s: int = 120,
    overrides: Sequence[str] = (),
    cpus_per_task: int | None = None,
    python: str | None = None,
) -> str:
    """An sbatch script for `config_path` on `nodes` machines of `gpus_per_node` GPUs each. Paths
    are the job's: relative ones are taken from the folder sbatch is run in, as given here."""
    check_job(cfg, nodes, gpus_per_node)
    limit = check_time(time) if time is not None else None
    # sbatch takes 0 to 65535 seconds for a signal's time
    if not 0 <= warning_s <= 65535:
        raise PhalanxError(f"--warning-s must be 0 to 65,535 seconds, got {warning_s}")
    if limit is not None and warning_s >= limit:
        raise PhalanxError(
            f"--warning-s {warning_s} is not shorter than the job's time limit, --time {time} "
            f"({limit} s): the job would be told to save before it starts; give a --warning-s "
            "well under the limit (the default, 120, for a limit of an hour or more)"
        )
    cpus = cpus_per_task if cpus_per_task is not None else cpus_for(cfg)
    if not 1 <= cpus <= 1024:
        raise PhalanxError(f"--cpus-per-task must be between 1 and 1024, got {cpus}")
    root = shlex.quote(cfg.output_root)
    config = shlex.quote(config_path)
    extra = "".join(" " + shlex.quote(o) for o in overrides)
    phalanx = f"{shlex.quote(python or _python())} -m phalanx.cli"
    directives = [
        f"--job-name={slurm_name(cfg.name or 'phalanx')}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={gpus_per_node}",
        f"--gpus-per-node={gpus_per_node}",
        f"--cpus-per-task={cpus}",
        *([f"--time={time}"] if time else []),
        *([f"--partition={_option_value(partition, '--partition')}"] if partition else []),
        f"--signal=USR1@{warning_s}",
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%j.out",
    ]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "# Written by `phalanx slurm`. One phalanx per GPU; a requeued job resumes its run.",
        "# Before the time limit, and on preemption, the tasks get SIGUSR1: they finish the same",
        f"# step, save and exit {PREEMPTED}, and the job is requeued. Relative paths are from the",
        "# folder that sbatch was run in.",
        "set -uo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-.}"',
        f"ROOT={root}/slurm-$SLURM_JOB_ID",
        "RUN=$(find \"$ROOT\" -mindepth 2 -maxdepth 2 -name config.yaml -printf '%h\\n' "
        "2>/dev/null | head -n 1)",
        'if [ -n "$RUN" ]; then',
        f'    COMMAND=(resume "$RUN"{extra})',
        "else",
        f'    COMMAND=(train {config} "output_root=$ROOT" parallel.accelerator=cuda '
        f"parallel.devices={gpus_per_node}{extra})",
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
    overrides: Sequence[str] = (),
    cpus: int | None = None,
    memory: str | None = None,
) -> str:
    """A Kubeflow PyTorchJob manifest (YAML) for `config_path` in `image`, on `nodes` pods of
    `gpus_per_node` GPUs each. The config path is the one inside the image (or the volume)."""
    check_job(cfg, nodes, gpus_per_node)
    if not image:
        raise PhalanxError(
            "--image names the container image that holds phalanx, torch and your code"
        )
    if not _IMAGE.fullmatch(image):
        raise PhalanxError(
            f"--image {image!r} is not a container image reference: give "
            "[REGISTRY[:PORT]/]PATH[:TAG][@sha256:DIGEST], the path in lowercase, such as "
            "registry.example.com/team/train:1"
        )
    if not volume_claim:
        raise PhalanxError(
            "--volume-claim is needed: without a volume that every pod mounts, each pod writes "
            "the run to its own disk, so a job applied again cannot resume it and fsdp on several "
            "pods cannot commit a checkpoint; name a PersistentVolumeClaim (ReadWriteMany)"
        )
    if len(volume_claim) > 253 or not _OBJECT_NAME.fullmatch(volume_claim):
        raise PhalanxError(
            f"--volume-claim {volume_claim!r} is not a PersistentVolumeClaim's name: lowercase "
            "letters, digits, '-' and '.', starting and ending with a letter or digit, at most "
            "253 characters"
        )
    cpus = cpus if cpus is not None else cpus_for(cfg) * gpus_per_node
    memory = memory or f"{16 * gpus_per_node}Gi"
    if not 1 <= cpus <= 4096:
        raise PhalanxError(f"--cpus must be between 1 and 4096, got {cpus}")
    if not re.fullmatch(r"[1-9][0-9]*(Ki|Mi|Gi|Ti)?", memory):
        raise PhalanxError(f"--memory {memory!r} is not a Kubernetes quantity such as 64Gi")
    name = k8s_name(cfg.name or "phalanx")
    root = f"{RUNS_MOUNT}/{name}"
    extra = " ".join(shlex.quote(o) for o in overrides)
    run = f'torchrun -m phalanx.cli resume "$RUN" {extra}'.rstrip()
    script = "; ".join(
        [
            f"ROOT={shlex.quote(root)}",
            'RUN=$(find "$ROOT" -mindepth 2 -maxdepth 2 -name config.yaml 2>/dev/null | head -n 1 '
            "| xargs -r dirname)",
            f'if [ -n "$RUN" ]; then exec {run}; fi',
            f'exec torchrun -m phalanx.cli train {shlex.quote(config_path)} "output_root=$ROOT" '
            f"parallel.accelerator=cuda parallel.devices={gpus_per_node} {extra}".rstrip(),
        ]
    )
    container = {
        "name": "pytorch",
        "image": image,
        "command": ["/bin/sh", "-c", script],
        "resources": {
            "requests": {"cpu": str(cpus), "memory": memory},
            "limits": {"nvidia.com/gpu": gpus_per_node},
        },
        # the run directory, on one file system that every pod shares; and DataLoader workers
        # hand batches over in shared memory, which a container's default 64 MB /dev/shm starves
        "volumeMounts": [
            {"name": "runs", "mountPath": RUNS_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod = {
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    specs = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": {"spec": pod}}}
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
        "# Written by `phalanx k8s`: a PyTorchJob (Kubeflow training operator). Every pod runs\n"
        "# torchrun, which reads the node count, this pod's rank and the master from the\n"
        "# operator's PET_* variables. The run directory is under "
        f"{root} on the volume {volume_claim}:\n# applied again, the job resumes it.\n"
    )
    return header + yaml.safe_dump(manifest, sort_keys=False, width=1000)


def check_job(cfg: Config, nodes: int, gpus_per_node: int) -> None:
    """A job that starts one process per GPU on each machine: counts within reason, and a strategy
    that runs one process per device."""
    from phalanx.strategies.registry import families

    known = families()

    if not 1 <= nodes <= MAX_NODES or not 1 <= gpus_per_node <= MAX_GPUS:
        raise PhalanxError(
            f"--nodes must be 1 to {MAX_NODES:,} and --gpus-per-node 1 to {MAX_GPUS}, got {nodes} "
            f"and {gpus_per_node}"
        )
    name = cfg.parallel.strategy
    per_device = [n for n, family in known.items() if family.process_per_device]
    if name == "auto" or name in per_device:
        return
    if name in known:
        raise ConfigError(
            f"parallel.strategy={name} runs in one process, but a cluster job starts one process "
            f"per GPU on every machine, each of which would run the whole of it; use "
            f"parallel.strategy={' or '.join(per_device)} (or auto)"
        )
    raise ConfigError(
        f"parallel.strategy {name!r} is not available{did_you_mean(name, known)}; a cluster job "
        f"takes {', '.join(['auto', *per_device])}"
    )


# a container image reference, as registries and Kubernetes read one: an optional registry host
# (a dot, a port or localhost tells it from the path), a lowercase path, an optional tag and digest
_IMAGE = re.compile(
    r"(?:(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)
# a Kubernetes object's name (a DNS subdomain)
_OBJECT_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?")
_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def check_time(time: str) -> int:
    """A Slurm time limit: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds, minutes and seconds below 60. Its seconds."""
    found = _SLURM_TIME.fullmatch(time)
    if found and len(time) <= 16:
        days, first, second, third = found.groups()
        if days is None:
            later = [second, third] if third is not None else [second]  # h:m:s, or m:s
            # m, m:s, h:m:s
            units = (60, 1, 0) if third is None else (3600, 60, 1)
        else:
            later = [second, third]  # d-h, d-h:m, d-h:m:s
            if int(first) >= 24:
                later = ["60"]
            units = (3600, 60, 1)
        if all(part is None or int(part) < 60 for part in later):
            seconds = 86400 * int(days or 0)
            for part, unit in zip((first, second, third), units, strict=True):
                seconds += int(part or 0) * unit
            return seconds
    raise PhalanxError(
        f"--time {time!r} is not a Slurm time limit: minutes (90), HH:MM:SS (04:00:00) or "
        "D-HH:MM:SS (2-00:00:00), minutes and seconds below 60"
    )


def cpus_for(cfg: Config) -> int:
    """CPUs for each GPU's process: its DataLoader workers (num_workers, or up to 4 on a GPU where
    it is auto) and the process itself."""
    workers = cfg.dataset.num_workers
    return (4 if workers == "auto" else workers) + 1


def slurm_name(name: str) -> str:
    """A Slurm job name: the run's name in letters, digits, `.`, `_` and `-`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:64] or "phalanx"


def k8s_name(name: str) -> str:
    """A Kubernetes object name (DNS-1123: lower-case letters, digits and `-`, at most 63)."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower())[:63].strip("-") or "phalanx"


def _option_value(value: str, option: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._,:@+-]+", value):
        raise PhalanxError(f"{option} {value!r} is not a Slurm name: letters, digits and ._,:@+-")
    return value


def _python() -> str:
    """The Python that runs phalanx on the nodes: this command's own, as a path relative to the
    folder where sbatch will run where it lies inside it (a project's .venv), else `python` from the
    PATH that sbatch passes on (activate the environment before sbatch)."""
    here = Path.cwd().resolve()
    executable = Path(sys.executable)
    if executable.absolute().is_relative_to(here):
        return os.path.relpath(executable.absolute(), here)
    return "python"
