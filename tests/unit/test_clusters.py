"""`phalanx slurm` and `phalanx k8s`: the job files they write, parsed, and the Slurm script run
with stand-ins for srun and scontrol, so that its train / requeue / resume logic is exercised."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import toy
import yaml

from phalanx import cli

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cfg_path(tmp_path, monkeypatch) -> Path:
    """A config in the folder the job is written and submitted from, its runs under runs/."""
    monkeypatch.chdir(tmp_path)
    return toy.write_config(tmp_path, toy.regression_config(name="lm", output_root="runs"))


def directives(script: str) -> dict[str, str]:
    """The `#SBATCH --key=value` lines that sbatch reads, as {key: value} (a flag as {key: ""}):
    sbatch stops at the first line that is neither a comment nor blank, so only those before it."""
    found = {}
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            found[key] = value
    return found


def _slurm(*args: str) -> str:
    out = Path("job.sbatch")
    assert cli.main(["slurm", "config.yaml", *args, "--output", str(out)]) == 0
    script = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    return script


def test_the_slurm_script_asks_for_the_nodes_one_task_per_gpu_a_warning_signal_and_requeue(
    cfg_path,
):
    script = _slurm(
        "optimizer.lr=0.01",
        "--nodes",
        "3",
        "--gpus-per-node",
        "4",
        "--time",
        "1-00:00:00",
        "--partition",
        "gpu",
    )
    assert directives(script) == {
        "job-name": "lm",
        "nodes": "3",
        "ntasks-per-node": "4",
        "gpus-per-node": "4",
        "cpus-per-task": "5",  # num_workers auto: up to 4 workers per GPU, and the process
        "time": "1-00:00:00",
        "partition": "gpu",
        "signal": "USR1@120",
        "requeue": "",
        "open-mode": "append",
        "output": "slurm-%j.out",
    }
    assert "parallel.devices=4 optimizer.lr=0.01)" in script
    # nothing of the machine that wrote it: the config, the runs and the Python as given, relative
    assert str(cfg_path.parent) not in script and "ROOT=runs/slurm-$SLURM_JOB_ID" in script
    assert "(train config.yaml " in script and 'cd "${SLURM_SUBMIT_DIR:-.}"' in script
    assert (
        directives(_slurm("--nodes", "1", "--gpus-per-node", "2", "dataset.num_workers=2"))[
            "cpus-per-task"
        ]
        == "3"
    )


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
        "SLURM_SUBMIT_DIR": str(script.parent),
    }
    return subprocess.run(  # from another folder: the script goes to the one it was submitted from
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )


def test_the_slurm_script_trains_then_requeues_on_preemption_then_resumes_its_run(
    cfg_path, tmp_path
):
    script = tmp_path / "job.sbatch"
    _slurm("--nodes", "2", "--gpus-per-node", "2", "--python", ".venv/bin/python")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    port = 20000 + 1234567 % 20000

    first = _run_job(script, bin_dir, exit_code=138)  # the tasks saved on SIGUSR1 and exited 138
    assert first.returncode == 138, first.stderr
    calls = (bin_dir / "calls").read_text().splitlines()
    assert calls[0] == (
        "srun --kill-on-bad-exit=1 .venv/bin/python -m phalanx.cli train config.yaml "
        "output_root=runs/slurm-1234567 parallel.accelerator=cuda parallel.devices=2 "
        f"MASTER=gpu07:{port}"
    )
    assert calls[1] == "scontrol requeue 1234567"

    run = tmp_path / "runs" / "slurm-1234567" / "lm-20260101-000000"  # the first attempt's run
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: lm\n")
    (bin_dir / "calls").unlink()
    second = _run_job(script, bin_dir, exit_code=0)
    assert second.returncode == 0, second.stderr
    assert (bin_dir / "calls").read_text().splitlines() == [
        "srun --kill-on-bad-exit=1 .venv/bin/python -m phalanx.cli resume "
        f"runs/slurm-1234567/lm-20260101-000000 MASTER=gpu07:{port}"
    ]  # resumed, and not requeued again


def test_the_slurm_script_runs_this_python_relative_to_the_folder_it_is_submitted_from(cfg_path):
    """The default Python is this command's, written relative where it lies inside the folder the
    script is written in (a project's .venv), else `python` from the PATH that sbatch passes on."""
    here = Path(sys.executable).absolute()
    inside = here.is_relative_to(Path.cwd().resolve())
    expected = os.path.relpath(here) if inside else "python"
    script = _slurm("--nodes", "1", "--gpus-per-node", "1")
    assert f"srun --kill-on-bad-exit=1 {expected} -m phalanx.cli " in script


@pytest.mark.parametrize(
    "name, job_name",
    [("lm $(touch pwned) 'x'", "lm-touch-pwned-x"), ('a"b;c`d`', "a-b-c-d")],
)
def test_a_run_name_cannot_write_a_line_or_a_command_into_the_script(cfg_path, name, job_name):
    script = _slurm("--nodes", "1", "--gpus-per-node", "1", f"name={name}")
    assert directives(script)["job-name"] == job_name
    assert len(directives(script)) == 9  # every directive read: none cut off by an injected line
    command = next(line for line in script.splitlines() if "COMMAND=(train" in line)
    assert shlex.split(command.split("(", 1)[1].rstrip(")"))[-1] == f"name={name}"
    assert not Path("pwned").exists()


def test_the_pytorchjob_runs_torchrun_in_a_gang_of_pods_sharing_the_run_volume(cfg_path, capsys):
    args = ["--nodes", "4", "--gpus-per-node", "8", "--image", "reg/me/train:1"]
    assert cli.main(["k8s", "config.yaml", *args, "--volume-claim", "runs"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "lm",
    )
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"] == {
        "backoffLimit": 0,
        "cleanPodPolicy": "None",
        "schedulingPolicy": {"minAvailable": 4},
    }
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never" and set(replica) == {
            "replicas",
            "restartPolicy",
            "template",
        }
        pod = replica["template"]["spec"]
        [container] = pod["containers"]
        assert set(container) == {"name", "image", "command", "resources", "volumeMounts"}
        assert container["name"] == "pytorch" and container["image"] == "reg/me/train:1"
        assert container["resources"] == {
            "requests": {"cpu": "40", "memory": "128Gi"},  # 5 CPUs and 16Gi per GPU
            "limits": {"nvidia.com/gpu": 8},
        }
        assert container["volumeMounts"] == [
            {"name": "runs", "mountPath": "/runs"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
        assert pod["volumes"] == [
            {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ]
        command = container["command"]
        assert (
            command[:2] == ["/bin/sh", "-c"]
            and subprocess.run(["sh", "-n", "-c", command[2]]).returncode == 0
        )
        assert 'exec torchrun -m phalanx.cli train config.yaml "output_root=$ROOT"' in command[2]
        assert (
            'exec torchrun -m phalanx.cli resume "$RUN"' in command[2]
            and "ROOT=/runs/lm" in command[2]
        )
    assert (
        cli.main(
            [
                "k8s",
                "config.yaml",
                *args,
                "--volume-claim",
                "v",
                "--cpus",
                "16",
                "--memory",
                "200Gi",
                "name=A_Very." + "Long" * 20,
            ]
        )
        == 0
    )
    job = yaml.safe_load(capsys.readouterr().out)
    name = job["metadata"]["name"]
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name)
    requests = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert requests["resources"]["requests"] == {"cpu": "16", "memory": "200Gi"}


@pytest.mark.parametrize(
    "time", ["90", "90:30", "04:00:00", "48:00:00", "2-00", "2-12:30", "2-12:30:15"]
)
def test_slurm_time_limits_in_every_form_slurm_takes(cfg_path, time):
    assert (
        directives(_slurm("--nodes", "1", "--gpus-per-node", "1", "--time", time))["time"] == time
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["slurm", "--nodes", "0", "--gpus-per-node", "8"],
            "--nodes must be 1 to 10,000 and --gpus-per-node 1 to 64, got 0 and 8",
        ),
        (
            ["slurm", "--nodes", "12345678901234567890", "--gpus-per-node", "8"],
            "--nodes must be 1 to 10,000",
        ),
        *(
            (["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", time], f"--time {time!r}")
            for time in ("soon", "99:99:99", "1:60", "2-24:00", "1-2-3")
        ),
        (
            ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--warning-s", "100000"],
            "--warning-s must be 0 to 65,535 seconds, got 100000",
        ),
        (
            ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--time", "10", "--warning-s", "600"],
            "--warning-s 600 is not shorter than the job's time limit, --time 10 (600 s)",
        ),
        (
            ["slurm", "--nodes", "2", "--gpus-per-node", "1", "parallel.strategy=towers"],
            "parallel.strategy=towers runs in one process",
        ),
        (
            ["k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "", "--volume-claim", "v"],
            "--image names the container image",
        ),
        (
            ["k8s", "--nodes", "2", "--gpus-per-node", "8", "--image", "i"],
            "--volume-claim is needed: without a volume that every pod mounts",
        ),
        *(
            (
                [
                    "k8s",
                    "--nodes",
                    "1",
                    "--gpus-per-node",
                    "1",
                    "--image",
                    image,
                    "--volume-claim",
                    "v",
                ],
                f"--image {image!r} is not a container image reference",
            )
            for image in ("me/Train:1", "train:", "train:a tag", "http://registry/train", "a//b")
        ),
        (
            [
                "k8s",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--image",
                "i",
                "--volume-claim",
                "My_Runs",
            ],
            "--volume-claim 'My_Runs' is not a PersistentVolumeClaim's name",
        ),
        (
            [
                "k8s",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--image",
                "i",
                "--volume-claim",
                "v",
                "--memory",
                "lots",
            ],
            "--memory 'lots' is not a Kubernetes quantity",
        ),
        (
            # a newline, in YAML's quotes
            ["slurm", "--nodes", "1", "--gpus-per-node", "1", 'name="a\\nb"'],
            "name: a run name is one folder's name",
        ),
    ],
)
def test_job_settings_that_make_no_job_are_one_line_errors(cfg_path, args, message, capsys):
    assert cli.main([args[0], "config.yaml", *args[1:], "--output", "job"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not Path("job").exists()


@pytest.mark.parametrize(("command", "lacks"), [("train", "config"), ("resume", "run_dir")])
def test_a_command_without_its_argument_names_that_alone(command, lacks, capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main([command])
    assert ended.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith(f"the following arguments are required: {lacks}")
