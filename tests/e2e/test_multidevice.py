"""`parallel.devices: N` through the real launcher: worker processes, gloo on loopback, a failing
rank, portable checkpoints across device counts, and a stop request."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forks
import pytest
import torch
import toy
from procs import ENV, PHALANX, alive, only_run, wait_until
from procs import run as phalanx
from safetensors.torch import load_file

import phalanx as phalanx_api

pytestmark = pytest.mark.timeout(400)


def weights(run: Path) -> dict[str, torch.Tensor]:
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    return load_file(run / "checkpoints" / f"step-{steps[-1]}" / "model.safetensors")


def relative(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """`alone(config)`: the weights an uninterrupted run of `config` on one process ends with,
    trained once for every test of this module that compares with it."""
    trained: dict[str, dict[str, torch.Tensor]] = {}

    def weights_of(raw: dict) -> dict[str, torch.Tensor]:
        key = json.dumps(raw, sort_keys=True)
        if key not in trained:
            folder = tmp_path_factory.mktemp("alone")
            path = toy.write_config(folder / "ref", raw)
            result = phalanx("train", str(path), cwd=folder)
            assert result.returncode == 0, result.stderr[-3000:]
            trained[key] = weights(only_run(folder / "ref" / "runs"))
        return trained[key]

    return weights_of


CFG = toy.regression_config(
    model={"class": "toy.Linear", "features": 3, "hidden": 4},
    optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
    dataset={"class": "toy.Regression", "batch_size": 7, "n_train": 41},
    parallel={"accelerator": "cpu", "devices": 1},
    main_loop={"epochs": 3, "extra_streams": ["valid"]},
    hooks=[
        {"ComputeStats": {"variables": ["loss"]}},
        "LogVariables",
        "SaveLatest",
        {"StopAfter": {"steps": 1000}},
    ],
)


def test_checkpoint_saved_on_three_processes_resumes_on_two_and_on_one(tmp_path, alone):
    want = alone(CFG)

    interrupted = toy.write_config(tmp_path / "n3", CFG)
    first = phalanx(
        "train", str(interrupted), "parallel.devices=3", "hooks.3.StopAfter.steps=9", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    run = only_run(tmp_path / "n3" / "runs")
    assert (
        run / "checkpoints" / "step-9" / "manifest.json"
    ).is_file()  # 6 steps an epoch: step 9 is mid-epoch
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)

    on_two = phalanx(
        "resume", str(run), "parallel.devices=2", "hooks.3.StopAfter.steps=1000", cwd=tmp_path
    )
    assert on_two.returncode == 0, on_two.stderr
    assert relative(weights(run), want) < 1e-10
    on_one = phalanx(
        "resume", str(copy), "parallel.devices=1", "hooks.3.StopAfter.steps=1000", cwd=tmp_path
    )
    assert on_one.returncode == 0, on_one.stderr
    assert relative(weights(copy), want) < 1e-10
    log = (run / "log.txt").read_text()
    assert "strategy ddp: 2 processes" in log and "epoch 3 (step 18)" in log


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    record = tmp_path / "workers.txt"
    model = {"class": "toy.FailAt", "features": 3, "rank": 1, "step": 3, "record": str(record)}
    path = toy.write_config(tmp_path, {**CFG, "model": model})
    # the job ends with the failure, not after the others' 300 s collective timeout (which would
    # outlast `timeout`)
    result = phalanx("train", str(path), "parallel.devices=2", cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("injected failure on rank 1 at step 3") == 1  # its traceback, once
    assert "rank 1 failed first" in result.stderr
    # no process of the job outlives it: its workers, and the server they forked from
    started = {int(pid) for line in record.read_text().splitlines() for pid in line.split()}
    assert len(started) == 3, started  # two workers, one parent
    deadline = time.monotonic() + 30  # a bound on a wait that should end at once, not a speed
    while [pid for pid in started if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if alive(pid)]


def test_an_item_that_a_loader_worker_cannot_read_is_said_as_the_users_and_ends_every_process(
    tmp_path,
):
    """A dataset's item raises in a DataLoader worker of one of two ranks: the terminal shows the
    user's frame and error (not torch's wrapped traceback), the run's log the whole traceback; the
    loader workers are their rank's children, and none outlives the command: the failed rank
    ends at once, and a worker left behind would hold the command's output open."""
    record = tmp_path / "processes.txt"
    path = toy.write_config(tmp_path, {**CFG, "dataset": toy.unreadable_dataset(record)})
    result = phalanx("train", str(path), "parallel.devices=2", cwd=tmp_path, timeout=240)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"phalanx: error: rank [01] failed first; every rank was stopped\. Your code raised this "
        r"in DataLoader worker process 0 \(the run's log\.txt has the whole traceback\):",
        errors[0],
    ), result.stderr
    said = result.stderr.split("phalanx: error: ", 1)[1]
    assert "in __getitem__\n" in said and "ValueError: training item 29 cannot be read" in said
    assert "Traceback" not in said and "site-packages" not in said and "phalanx/" not in said
    log = (only_run(tmp_path / "runs") / "log.txt").read_text()
    assert "Caught ValueError in DataLoader worker process 0" in log  # the whole, kept
    lines = [line.split() for line in record.read_text().splitlines()]
    ranks = {int(pid) for kind, pid, *_ in lines if kind == "rank"}
    workers = {int(line[1]): int(line[2]) for line in lines if line[0] == "worker"}
    assert len(ranks) == 2 and workers, lines
    assert set(workers.values()) <= ranks  # forked by their rank, not by a server of its own
    # killed by Linux when their rank ends, at once
    assert {int(line[3]) for line in lines if line[0] == "worker"} == {signal.SIGKILL}
    deadline = time.monotonic() + 30  # a bound on a wait that should end at once, not a speed
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]


def test_a_stop_request_saves_and_resume_finishes(tmp_path):
    cfg = {
        **CFG,
        "dataset": {"class": "toy.SlowRegression", "batch_size": 4, "delay": 0.02},
        "main_loop": {"epochs": 6},
    }
    path = toy.write_config(tmp_path, cfg)
    proc = subprocess.Popen(
        [*PHALANX, "train", str(path), "parallel.devices=2"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = list((tmp_path / "runs").glob("*/trace.jsonl"))
            if runs and '"epoch"' in runs[0].read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail("training never finished an epoch")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    run = only_run(tmp_path / "runs")
    events = [json.loads(line)["event"] for line in (run / "trace.jsonl").read_text().splitlines()]
    assert events[-1] == "interrupted" and "checkpoint" in events
    resumed = phalanx("resume", str(run), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert '"finished"' in (run / "trace.jsonl").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_two_nodes(args: list[str], cwd: Path, first: int) -> list[tuple[str, str]]:
    """`phalanx ARGS --nnodes 2 --node-rank R --rdzv 127.0.0.1:PORT` for R = 0, 1, node `first`
    started first; both must succeed. Their (stdout, stderr), in the order they started."""
    rdzv = f"127.0.0.1:{_free_port()}"
    nodes = [
        forks.start([*args, "--nnodes", "2", "--node-rank", str(rank), "--rdzv", rdzv], cwd, ENV)
        for rank in (first, 1 - first)
    ]
    return all_succeed(nodes)


def all_succeed(procs: list[forks.Command]) -> list[tuple[str, str]]:
    """Wait for every process (none is left running); each must exit 0. Their (stdout, stderr)."""
    try:
        done = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0] * len(procs), done
    return done


@pytest.mark.parametrize("devices", [1, 2])
def test_two_nodes_on_one_machine_train_as_one_process(tmp_path, devices, alone):
    """`phalanx train --nnodes 2 --node-rank R --rdzv HOST:PORT` on each "machine" (here, two
    launchers on one): node 0 serves the rendezvous and makes the run directory, each starts its
    workers, and the job's result is one process's."""
    want = alone(CFG)

    path = toy.write_config(tmp_path / "nodes", CFG)
    done = on_two_nodes(["train", str(path), f"parallel.devices={devices}"], tmp_path, first=1)
    run = only_run(tmp_path / "nodes" / "runs")  # one run directory, node 0's
    assert relative(weights(run), want) < 1e-10
    assert f"strategy ddp: {2 * devices} processes" in (run / "log.txt").read_text()
    assert f"node 1 of 2: run directory {run}" in done[0][1]


def test_a_mesh_over_two_nodes_trains_as_one_process(tmp_path, alone):
    """shard 2 x tensor 2 on two machines of two processes: the tensor group is the innermost
    dimension (neighbouring ranks), so each machine holds one and the shards span the machines."""
    want = alone(CFG)

    path = toy.write_config(tmp_path / "mesh", CFG)
    layout = "parallel.mesh={shard: 2, tensor: 2, tensor_plan: {net.0: colwise, net.2: rowwise}}"
    on_two_nodes(
        ["train", str(path), "parallel.devices=2", "parallel.strategy=mesh", layout],
        tmp_path,
        first=0,
    )
    run = only_run(tmp_path / "mesh" / "runs")
    log = (run / "log.txt").read_text()
    assert "strategy mesh: 4 processes" in log
    assert "3 to 4 per tensor group" in log  # a batch of 7 over the two data shards
    out = tmp_path / "mesh.safetensors"  # its checkpoints are shards: the whole model, exported
    assert phalanx("export", str(run), "--output", str(out), cwd=tmp_path).returncode == 0
    assert relative(load_file(out), want) < 1e-10


def test_a_run_stopped_on_one_process_resumes_on_two_nodes(tmp_path, alone):
    want = alone(CFG)

    path = toy.write_config(tmp_path / "stopped", CFG)
    assert (
        phalanx("train", str(path), "hooks.3.StopAfter.steps=8", cwd=tmp_path).returncode == 0
    )  # mid-epoch 2
    run = only_run(tmp_path / "stopped" / "runs")
    on_two_nodes(["resume", str(run), "hooks.3.StopAfter.steps=1000"], tmp_path, first=0)
    assert relative(weights(run), want) < 1e-10
    assert (
        "resuming" in (run / "log.txt").read_text()
        and "from step 8" in (run / "log.txt").read_text()
    )


def _elastic_config(delay: float) -> dict:
    return {
        **CFG,
        "dataset": {"class": "toy.SlowRegression", "batch_size": 7, "n_train": 41, "delay": delay},
        "hooks": [{"SaveEvery": {"steps": 2}}, "SaveLatest"],
        "parallel": {"accelerator": "cpu", "devices": 1, "max_restarts": 3},
    }


def _elastic_node(path: Path, rank: int, rdzv: str, cwd: Path) -> forks.Command:
    args = ["train", str(path), "--nnodes", "1:2", "--node-rank", str(rank), "--rdzv", rdzv]
    return forks.start(args, cwd, ENV)


@pytest.mark.parametrize("change", ["leaves", "joins"])
def test_an_elastic_job_goes_on_when_a_machine_leaves_or_joins_with_the_same_global_batch(
    tmp_path, change, alone
):
    """--nnodes 1:2. `leaves`: node 1 is killed (SIGKILL) after a checkpoint of the two; node 0's
    workers start again in a round of one machine and resume on half the processes. `joins`: node 0
    starts alone, node 1 comes after its first checkpoint, and the workers start again in a round of
    two. Either way the run ends as an uninterrupted one does: the global batch and the sample order
    are the job's, not the machines'."""
    want = alone(_elastic_config(0.0))

    path = toy.write_config(tmp_path / "elastic", _elastic_config(0.05))
    rdzv = f"127.0.0.1:{_free_port()}"
    runs = tmp_path / "elastic" / "runs"

    def checkpoints():
        return list(runs.glob("*/checkpoints/step-*/manifest.json")) if runs.is_dir() else []

    nodes = [_elastic_node(path, 0, rdzv, tmp_path)]
    try:
        if change == "leaves":
            nodes.append(_elastic_node(path, 1, rdzv, tmp_path))
            wait_until(lambda: checkpoints(), nodes[0], what="a checkpoint of the two machines")
            nodes[1].kill()  # the machine leaves; its worker ends within a second
        else:
            wait_until(
                lambda: checkpoints(), nodes[0], what="a checkpoint of the first machine alone"
            )
            nodes.append(_elastic_node(path, 1, rdzv, tmp_path))
        done = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert nodes[0].returncode == 0, done[0]
    if change == "joins":
        assert nodes[1].returncode == 0, done[1]
    run = only_run(runs)
    assert relative(weights(run), want) < 1e-10
    log = (run / "log.txt").read_text()
    before, after = (2, 1) if change == "leaves" else (1, 2)
    assert re.search(rf"strategy \w+: {before} process", log)
    restarted = log.split("the workers started again in this run")
    assert len(restarted) == 2 and f"on {after} process(es)" in restarted[1]
    if change == "joins":  # stopped by the agent for a new round, not by a user
        assert "the job re-formed at step" in restarted[0], restarted[0]
        assert "SIGTERM received" not in log and "Continue with" not in log
        assert not (run / ".re-forming").exists()


@pytest.mark.parametrize(
    "parallel",
    [
        {"devices": 2},
        {"devices": 3, "strategy": "param_server", "param_server": {"servers": 1}},
        {"devices": 4, "strategy": "param_server", "param_server": {"servers": 2}},
    ],
    ids=["ddp", "param_server", "param_server-2-servers"],
)
def test_a_worker_killed_mid_run_is_restarted_and_the_job_ends_as_if_uninterrupted(
    parallel, tmp_path, alone
):
    """kill -9 of rank 1 (a worker) at its 9th training forward, in the second epoch, with
    max_restarts 1. ddp: the launcher starts every process again, they resume from the checkpoint
    at the first epoch's end (step 6). param_server: a new process takes the dead one's place
    alone, where the servers are, while the others go on (none restarts), and its claimed chunks
    are dealt again. Either way the end is an uninterrupted run's (one process's)."""
    hooks = ["SaveLatest"]
    want = alone(
        {
            **CFG,
            "hooks": hooks,
            "model": {"class": "toy.Linear"},
            "parallel": {"accelerator": "cpu", "devices": 1},
        }
    )

    faulty = {
        **CFG,
        "hooks": hooks,
        "model": {"class": "toy.FaultAt", "rank": 1, "step": 9, "kind": "kill"},
        "parallel": {"accelerator": "cpu", "max_restarts": 1, **parallel},
    }
    result = phalanx("train", str(toy.write_config(tmp_path / "faulty", faulty)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(tmp_path / "faulty" / "runs")
    assert relative(weights(run), want) < 1e-10
    log = (run / "log.txt").read_text()
    if parallel.get("strategy") == "param_server":
        servers = parallel["param_server"]["servers"]
        assert f"3 to 4 per chunk; {servers} server" in log and "and 2 workers, which take" in log
        assert "worker rank 1 ended by signal 9; a new one takes its place" in result.stderr
        assert "worker rank 1 joins the run in place of one that died, at step" in result.stderr
        assert "started again" not in log and "resuming" not in log  # the others went on
        return
    assert (
        "the workers started again in this run (a worker failed, or the machines changed): "
        "it resumes from the last checkpoint" in log
    )
    assert "resuming" in log and "from step 6 " in log


def test_a_fault_on_every_attempt_ends_after_max_restarts_plus_one_attempts(tmp_path):
    record = tmp_path / "attempts.txt"
    faulty = {
        **CFG,
        "model": {
            "class": "toy.FaultAt",
            "rank": 1,
            "step": 2,
            "kind": "raise",
            "attempts": None,
            "record": str(record),
        },
        "parallel": {"accelerator": "cpu", "devices": 2, "max_restarts": 2},
    }
    result = phalanx("train", str(toy.write_config(tmp_path / "faulty", faulty)), cwd=tmp_path)
    assert result.returncode == 1
    # exactly max_restarts + 1 attempts
    assert record.read_text().split() == ["0", "1", "2"], result.stdout + result.stderr
    assert "injected failure on rank 1, attempt 0" in result.stderr  # the first failure's traceback
    assert result.stderr.count("the workers started again") == 2  # said once a restart, by rank 0
    # the model's frame on the terminal, the whole traceback in the run's log
    assert "Your code raised this" in result.stderr and "Traceback" not in result.stderr
    assert "Traceback" in (only_run(tmp_path / "faulty" / "runs") / "log.txt").read_text()


def test_tasks_that_slurm_starts_join_one_group_and_train_as_one_process(tmp_path, alone):
    """srun starts one `phalanx train` per task with Slurm's variables and no agent's: the tasks
    find each other at the job's master address, rank 0 makes the run directory, and the result is
    one process's."""
    want = alone(CFG)

    path = toy.write_config(tmp_path / "slurm", CFG)
    port = _free_port()
    agent = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    tasks = []
    for rank in range(2):
        env = {k: v for k, v in ENV.items() if k not in agent and not k.startswith("SLURM_")}
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_NTASKS="2",
            SLURM_TASKS_PER_NODE="2",
            SLURM_JOB_NODELIST="127.0.0.1",
            SLURM_JOB_ID="7",
            MASTER_PORT=str(port),
        )
        tasks.append(forks.start(["train", str(path), "parallel.devices=2"], tmp_path, env))
    all_succeed(tasks)
    run = only_run(tmp_path / "slurm" / "runs")
    assert relative(weights(run), want) < 1e-10
    assert "strategy ddp: 2 processes" in (run / "log.txt").read_text()


def test_under_torchrun_phalanx_joins_its_workers_instead_of_launching(tmp_path, alone):
    """torchrun starts the processes (as on each machine of a multi-machine job); phalanx sees its
    environment, does not launch again, and trains as one process would."""
    want = alone(CFG)

    path = toy.write_config(tmp_path / "torchrun", CFG)
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    result = subprocess.run(
        [*torchrun, "-m", "phalanx.cli", "train", str(path), "parallel.devices=2"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(tmp_path / "torchrun" / "runs")  # one run directory: rank 0's
    assert relative(weights(run), want) < 1e-10
    log = (run / "log.txt").read_text()
    assert "strategy ddp: 2 processes" in log and "starting 2 workers" not in result.stderr + log


FIT_SCRIPT = """
import os, sys
import torch
import phalanx, toy

torch.manual_seed(0 if sys.argv[2] == "seeded" else 1 + int(os.environ["RANK"]))
streams = toy.Regression(n_train=41).streams()
model = toy.Linear(features=3, hidden=4)
run = phalanx.fit(sys.argv[1], overrides=["parallel.devices=2", "parallel.strategy=fsdp"],
                  model=model, dataset={"train": streams["train"], "valid": streams["valid"]})
print(os.environ["RANK"], run.status, run.metrics["valid.loss"])
"""


def test_under_torchrun_each_process_fits_its_own_objects(tmp_path, alone):
    """A script that calls phalanx.fit with a model and a dataset it built, in each process of a
    torchrun job (fsdp: each keeps its shards of its own model), trains as one process would; models
    that differ between the processes (not seeded) are an error, not a silent mix."""
    want = alone(CFG)

    path = toy.write_config(tmp_path / "objects", CFG)
    (tmp_path / "objects" / "fit.py").write_text(FIT_SCRIPT)
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "fit.py",
    ]
    result = subprocess.run(
        [*torchrun, str(path), "seeded"],
        cwd=tmp_path / "objects",
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(tmp_path / "objects" / "runs")
    assert (
        relative(
            phalanx_api.load(run, "latest", model=toy.Linear(features=3, hidden=4)).state_dict(),
            want,
        )
        < 1e-10
    )
    ends = sorted(line.split() for line in result.stdout.splitlines())
    assert [rank for rank, _, _ in ends] == ["0", "1"] and {status for _, status, _ in ends} == {
        "finished"
    }
    assert ends[0][2] == ends[1][2]  # every process returns the same numbers

    shutil.rmtree(tmp_path / "objects" / "runs")
    result = subprocess.run(
        [*torchrun, str(path), "unseeded"],
        cwd=tmp_path / "objects",
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode != 0
    assert "the model given differs on rank(s) [1] from rank 0's" in result.stderr
    assert not list((tmp_path / "objects" / "runs").iterdir())  # nothing trained, nothing left


def test_doctor_tries_the_devices_and_an_all_reduce_among_the_configured_processes(tmp_path):
    path = toy.write_config(tmp_path, CFG)
    result = phalanx("doctor", str(path), "parallel.devices=3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "phalanx doctor: 3 process(es) on cpu, gloo" in result.stdout
    rows = [line for line in result.stdout.splitlines() if re.match(r"│ [0-9] ", line)]
    assert [row.split("│")[1].strip() for row in rows] == ["0", "1", "2"]
    assert all("ok" in row and "WRONG" not in row for row in rows)
    assert "all 3 process(es) ready" in result.stdout
    assert not (tmp_path / "runs").exists()  # it trains nothing and leaves nothing

    alone = phalanx("doctor", str(path), cwd=tmp_path)
    assert alone.returncode == 0 and "all 1 process(es) ready" in alone.stdout
