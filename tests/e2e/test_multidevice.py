"""`parallel.devices: N` through the real launcher: worker processes, gloo on loopback, a failing
rank, portable checkpoints across device counts, and a stop request."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import toy

pytestmark = pytest.mark.timeout(400)

_SCRIPT = Path(sys.executable).with_name("phalanx")
PHALANX = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "phalanx.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def phalanx(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*PHALANX, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def only_run(root: Path) -> Path:
    [run] = [p for p in root.iterdir() if p.is_dir()]
    return run


def weights(run: Path) -> dict[str, torch.Tensor]:
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    return load_file(run / "checkpoints" / f"step-{steps[-1]}" / "model.safetensors")


def relative(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


CFG = toy.regression_config(
    model={"class": "toy.Linear", "features": 3, "hidden": 4},
    optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
    dataset={"class": "toy.Regression", "batch_size": 7, "n_train": 41},
    parallel={"accelerator": "cpu", "devices": 1},
    main_loop={"epochs": 3, "extra_streams": ["valid"]},
    hooks=[{"ComputeStats": {"variables": ["loss"]}}, "LogVariables", "SaveLatest", {"StopAfter": {"steps": 1000}}])


def test_checkpoint_saved_on_three_processes_resumes_on_two_and_on_one(tmp_path):
    reference = toy.write_config(tmp_path / "ref", CFG)
    assert phalanx("train", str(reference), cwd=tmp_path).returncode == 0
    want = weights(only_run(tmp_path / "ref" / "runs"))

    interrupted = toy.write_config(tmp_path / "n3", CFG)
    first = phalanx("train", str(interrupted), "parallel.devices=3", "hooks.3.StopAfter.steps=9", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run = only_run(tmp_path / "n3" / "runs")
    assert (run / "checkpoints" / "step-9" / "manifest.json").is_file()  # 6 steps an epoch: step 9 is mid-epoch
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)

    on_two = phalanx("resume", str(run), "parallel.devices=2", "hooks.3.StopAfter.steps=1000", cwd=tmp_path)
    assert on_two.returncode == 0, on_two.stderr
    assert relative(weights(run), want) < 1e-10
    on_one = phalanx("resume", str(copy), "parallel.devices=1", "hooks.3.StopAfter.steps=1000", cwd=tmp_path)
    assert on_one.returncode == 0, on_one.stderr
    assert relative(weights(copy), want) < 1e-10
    log = (run / "log.txt").read_text()
    assert "on 2 process(es)" in log and "epoch 3 (step 18)" in log


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    cfg = {**CFG, "model": {"class": "toy.FailAt", "features": 3, "rank": 1, "step": 3}}
    path = toy.write_config(tmp_path, cfg)
    start = time.monotonic()
    result = phalanx("train", str(path), "parallel.devices=2", cwd=tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert elapsed < 60  # process start-up included; the failure itself ends the job in seconds
    assert result.stderr.count("injected failure on rank 1 at step 3") == 1  # its traceback, once
    assert "rank 1 failed first" in result.stderr
    leftover = subprocess.run(["pgrep", "-f", "phalanx.launch"], capture_output=True, text=True).stdout
    assert not leftover.strip()


def test_a_stop_request_saves_and_resume_finishes(tmp_path):
    cfg = {**CFG, "dataset": {"class": "toy.SlowRegression", "batch_size": 4, "delay": 0.02},
           "main_loop": {"epochs": 6}}
    path = toy.write_config(tmp_path, cfg)
    proc = subprocess.Popen([*PHALANX, "train", str(path), "parallel.devices=2"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def test_under_torchrun_phalanx_joins_its_workers_instead_of_launching(tmp_path):
    """torchrun starts the processes (as on each machine of a multi-machine job); phalanx sees its
    environment, does not launch again, and trains as one process would."""
    reference = toy.write_config(tmp_path / "ref", CFG)
    assert phalanx("train", str(reference), cwd=tmp_path).returncode == 0
    want = weights(only_run(tmp_path / "ref" / "runs"))

    path = toy.write_config(tmp_path / "torchrun", CFG)
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run([*torchrun, "-m", "phalanx.cli", "train", str(path), "parallel.devices=2"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(tmp_path / "torchrun" / "runs")  # one run directory: rank 0's
    assert relative(weights(run), want) < 1e-10
    log = (run / "log.txt").read_text()
    assert "on 2 process(es)" in log and "starting 2 workers" not in result.stderr + log
