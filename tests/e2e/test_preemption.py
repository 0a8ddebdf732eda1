"""Preemption, with real signals to real processes: SIGTERM sent to one worker of a two-process run
(as a scheduler preempting it would) stops every rank at the same step with one checkpoint and exit
143; SIGUSR1 to the launcher (Slurm's `--signal` notice) does the same with 138; each time
`phalanx resume` goes on, and the run ends as an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import toy
from procs import finish, start, wait_until
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(300)
EPOCHS, STEPS = 6, 10  # 40 samples, batch 4


def events(run: Path) -> list[dict]:
    try:
        return [
            json.loads(line)
            for line in (run / "trace.jsonl").read_text().splitlines()
            if line.endswith("}")
        ]
    except OSError:
        return []


def config(delay: float) -> dict:
    return toy.regression_config(
        dataset={"class": "toy.SlowRegression", "batch_size": 4, "delay": delay, "init_s": 0.01},
        parallel={"accelerator": "cpu", "devices": 2},
        main_loop={"epochs": EPOCHS, "extra_streams": []},
        hooks=[{"ComputeStats": {"variables": ["loss"]}}, "SaveLatest"],
    )


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step}" / "model.safetensors")


def test_a_signal_to_one_worker_or_to_the_launcher_stops_every_rank_at_one_step(tmp_path):
    # the uninterrupted run, beside the rest (its steps do not wait; the experiment's do)
    reference = tmp_path / "reference"
    toy.write_config(reference, config(delay=0.0))
    uninterrupted = start("train", "config.yaml", cwd=reference)

    exp = tmp_path / "exp"
    toy.write_config(exp, config(delay=0.02))
    proc = start("train", "config.yaml", cwd=exp)
    runs = exp / "runs"
    wait_until(
        lambda: (
            runs.is_dir() and any(e["event"] == "epoch" for r in runs.iterdir() for e in events(r))
        ),
        proc,
        what="the first epoch",
    )
    [run] = list(runs.iterdir())
    worker = int((exp / "ready-1").read_text())  # rank 1's pid, which toy.SlowRegression wrote
    os.kill(worker, signal.SIGTERM)
    first = finish(proc, timeout=120)
    assert first.returncode == 143, first.stdout + first.stderr
    stopped = events(run)[-1]
    assert stopped["event"] == "interrupted" and STEPS < stopped["step"] < EPOCHS * STEPS
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    assert steps[-1] == stopped["step"]  # the step every rank stopped at, saved once
    assert "SIGTERM received" in first.stderr and "Traceback" not in first.stderr

    proc = start("resume", str(run), cwd=exp)
    before = len(events(run))
    wait_until(
        lambda: any(e["event"] == "epoch" for e in events(run)[before:]),
        proc,
        what="an epoch after resuming",
    )
    proc.send_signal(signal.SIGUSR1)
    second = finish(proc, timeout=120)
    assert second.returncode == 138, second.stdout + second.stderr
    assert events(run)[-1]["event"] == "interrupted" and events(run)[-1]["step"] > stopped["step"]

    third = finish(start("resume", str(run), cwd=exp), timeout=200)
    assert third.returncode == 0, third.stderr
    assert events(run)[-1]["event"] == "finished"
    assert finish(uninterrupted, timeout=200).returncode == 0
    [whole] = list((reference / "runs").iterdir())
    got, want = weights(run, EPOCHS * STEPS), weights(whole, EPOCHS * STEPS)
    for key, value in want.items():
        assert float((got[key] - value).abs().max()) <= 1e-10 * float(value.abs().max()), key
