"""`phalanx slurm` and `phalanx k8s`: the job files they write, parsed, and the Slurm script run with
stand-ins for srun and scontrol, so that its train / requeue / resume logic is exercised."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import toy
import yaml

from phalanx import cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cfg_path(tmp_path) -> Path:
    return toy.write_config(tmp_path, toy.regression_config(name="lm"))


def directives(script: str) -> dict[str, str]:
    """`#SBATCH --key=value` lines as {key: value}; a flag (`--requeue`) as {key: ""}."""
    lines = [
        line[len("#SBATCH --") :] for line in script.splitlines() if line.startswith("#SBATCH --")
    ]
    return dict((line.split("=", 1) + [""])[:2] for line in lines)


def test_the_slurm_script_asks_for_the_nodes_one_task_per_gpu_a_warning_signal_and_requeue(
    cfg_path, tmp_path, capsys
):
    out = tmp_path / "job.sbatch"
    assert (
        cli.main(
            [
                "slurm",
                str(cfg_path),
                "optimizer.lr=0.01",
                "--nodes",
                "3",
                "--gpus-per-node",
                "4",
                "--time",
                "1-00:00:00",
                "--partition",
                "gpu",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    script = out.read_text()
    assert directives(script) == {
        "job-name": "lm",
        "nodes": "3",
        "ntasks-per-node": "4",
        "gpus-per-node": "4",
        "time": "1-00:00:00",
        "partition": "gpu",
        "signal": "USR1@120",
        "requeue": "",
        "open-mode": "append",
        "output": "slurm-%j.out",
    }
    assert "parallel.devices=4 optimizer.lr=0.01)" in script
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run_job(script: Path, bin_dir: Path, exit_code: int) -> subprocess.CompletedProcess:
    _fake(
        bin_dir,
        "srun",
        f'echo "srun $* MASTER=$MASTER_ADDR:$MASTER_PORT" >> "{bin_dir}/calls"; exit {exit_code}\n',
    )
    _fake(
        bin_dir,
        "scontrol",
        f'if [ "$1" = show ]; then printf "gpu07\\ngpu08\\n"; '
        f'else echo "scontrol $*" >> "{bin_dir}/calls"; fi\n',
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1234567",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    return subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )


def test_the_slurm_script_trains_then_requeues_on_preemption_then_resumes_its_run(
    cfg_path, tmp_path
):
    script = tmp_path / "job.sbatch"
    assert (
        cli.main(
            [
                "slurm",
                str(cfg_path),
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--output",
                str(script),
            ]
        )
        == 0
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    root = tmp_path / "runs" / "slurm-1234567"

    first = _run_job(script, bin_dir, exit_code=138)  # the tasks saved on SIGUSR1 and exited 138
    assert first.returncode == 138, first.stderr
    calls = (bin_dir / "calls").read_text().splitlines()
    assert calls[0] == (
        f"srun --kill-on-bad-exit=1 {sys.executable} -m phalanx.cli train {cfg_path} "
        f"output_root={root} parallel.accelerator=cuda parallel.devices=2 "
        f"MASTER=gpu07:{20000 + 1234567 % 20000}"
    )
    assert calls[1] == "scontrol requeue 1234567"

    (root / "lm-20260101-000000").mkdir(parents=True)  # the run that the first attempt made
    (root / "lm-20260101-000000" / "config.yaml").write_text("name: lm\n")
    (bin_dir / "calls").unlink()
    second = _run_job(script, bin_dir, exit_code=0)
    assert second.returncode == 0, second.stderr
    assert (bin_dir / "calls").read_text().splitlines() == [
        f"srun --kill-on-bad-exit=1 {sys.executable} -m phalanx.cli resume {root / 'lm-20260101-000000'} "
        f"MASTER=gpu07:{20000 + 1234567 % 20000}"
    ]  # resumed, and not requeued again


def test_the_pytorchjob_runs_torchrun_in_a_gang_of_pods_sharing_the_run_volume(cfg_path, capsys):
    assert (
        cli.main(
            [
                "k8s",
                str(cfg_path),
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--image",
                "reg/me/train:1",
                "--volume-claim",
                "runs",
            ]
        )
        == 0
    )
    job = yaml.safe_load(capsys.readouterr().out)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "lm",
    )
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 4
    }
    replicas = spec["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] == "reg/me/train:1"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert container["volumeMounts"] == [{"name": "runs", "mountPath": "/runs"}]
        assert pod["volumes"] == [{"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}}]
        command = container["command"]
        assert (
            command[:2] == ["/bin/sh", "-c"]
            and subprocess.run(["sh", "-n", "-c", command[2]]).returncode == 0
        )
        assert f'exec torchrun -m phalanx.cli train {cfg_path} "output_root=$ROOT"' in command[2]
        assert (
            'exec torchrun -m phalanx.cli resume "$RUN"' in command[2]
            and "ROOT=/runs/lm" in command[2]
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["slurm", "--nodes", "0", "--gpus-per-node", "8"],
            "--nodes and --gpus-per-node must be at least 1",
        ),
        (
            ["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "soon"],
            "--time 'soon' is not a Slurm time limit",
        ),
        (
            ["k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", ""],
            "--image names the container image",
        ),
    ],
)
def test_job_settings_that_make_no_job_are_one_line_errors(cfg_path, args, message, capsys):
    assert cli.main([args[0], str(cfg_path), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
