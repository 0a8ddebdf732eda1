"""Who failed first, and how: a worker killed by a signal is named as such, not the rank that lost
its connection to it; a machine that ends leaves the other machine's launcher to say so, in one
line, in log.txt and in trace.jsonl."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import pytest
import toy
from procs import finish, start, wait_until

from phalanx.rundir import read_trace

pytestmark = pytest.mark.timeout(180)


_events = read_trace  # the run's trace.jsonl, a line cut short by a write in progress skipped


def _config(devices: int) -> dict:
    return toy.regression_config(
        dataset={"class": "toy.SlowRegression", "batch_size": 4, "delay": 0.02, "init_s": 0.01},
        parallel={"accelerator": "cpu", "devices": devices},
        main_loop={"epochs": 200, "extra_streams": []},
        hooks=[{"ComputeStats": {"variables": ["loss"]}}, "SaveLatest"],
    )


def _training(runs: Path, proc) -> Path:
    wait_until(
        lambda: (
            runs.is_dir() and any(e["event"] == "epoch" for r in runs.iterdir() for e in _events(r))
        ),
        proc,
        what="the first epoch",
    )
    [run] = runs.iterdir()
    return run


def test_a_worker_killed_with_sigkill_is_named_not_the_rank_that_lost_it(tmp_path):
    toy.write_config(tmp_path, _config(devices=2))
    proc = start("train", "config.yaml", cwd=tmp_path)
    run = _training(tmp_path / "runs", proc)
    os.kill(int((tmp_path / "ready-1").read_text()), signal.SIGKILL)
    result = finish(proc, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    # the agent may notice rank 1's death (its signal then known) or rank 0's exit first
    assert re.match(
        r"phalanx: error: rank 1 (was killed by SIGKILL \(exit code -9\) and recorded no error|"
        r"ended without recording an error \(killed by a signal, or crashed in native code\)): "
        r"something outside it ended it",
        errors[0],
    ), errors[0]
    assert "Connection" not in result.stderr.split("phalanx: error:")[-1]
    assert "ERROR the launcher: rank 1 " in (run / "log.txt").read_text()
    failed = [e for e in _events(run) if e["event"] == "failed"]
    assert failed[-1]["error"].startswith("rank 1 ") and failed[-1]["by"] == "the launcher"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_machine_that_ends_is_said_by_the_other_in_one_line_in_its_log_and_trace(tmp_path):
    """Node 1 (a launcher and its worker, as a machine) killed with SIGKILL: node 0's worker loses
    its connection, and node 0 says that another machine ended first."""
    path = toy.write_config(tmp_path, _config(devices=1))
    rdzv = f"127.0.0.1:{_free_port()}"
    flags = ["--nnodes", "2", "--rdzv", rdzv]
    node0 = start("train", str(path), *flags, "--node-rank", "0", cwd=tmp_path)
    node1 = start("train", str(path), *flags, "--node-rank", "1", cwd=tmp_path, new_session=True)
    run = _training(tmp_path / "runs", node0)
    os.killpg(node1.pid, signal.SIGKILL)  # the machine: its launcher and its worker at once
    finish(node1, timeout=120)
    result = finish(node0, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith("phalanx: error: rank 0 lost its connection to the other ranks")
    assert "a rank of another machine, or that machine, ended first" in errors[0]
    said = (run / "log.txt").read_text()
    assert "ERROR node 0's launcher: rank 0 lost its connection" in said
    failed = [e for e in _events(run) if e["event"] == "failed"]
    assert failed and "another machine" in failed[-1]["error"]


def test_when_an_elastic_jobs_node_0_dies_the_other_says_so_in_one_line(tmp_path):
    """--nnodes 1:2: node 0 serves the job's store. Killed (its launcher, then its worker, which
    runs in a process group of its own), it takes the store with it; node 1 says, in one line and
    without torch's tracebacks, that it lost the rendezvous and how to resume."""
    config = _config(devices=1)
    config["parallel"]["max_restarts"] = 2
    path = toy.write_config(tmp_path, config)
    rdzv = f"127.0.0.1:{_free_port()}"
    flags = ["--nnodes", "1:2", "--rdzv", rdzv]
    node0 = start("train", str(path), *flags, "--node-rank", "0", cwd=tmp_path, new_session=True)
    node1 = start("train", str(path), *flags, "--node-rank", "1", cwd=tmp_path)
    try:
        run = _training(tmp_path / "runs", node0)
        wait_until(
            lambda: re.search(r"strategy \w+: 2 processes", (run / "log.txt").read_text()),
            node1,
            what="a round of two",
        )
        os.killpg(node0.pid, signal.SIGKILL)  # the machine that serves the store
        finish(node0, timeout=120)
        result = finish(node1, timeout=150)
    finally:
        for node in (node0, node1):
            node.kill()
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(f"phalanx: error: node 1 lost the job's rendezvous at {rdzv}")
    assert f"phalanx resume {run}" in errors[0]
    failed = [e for e in _events(run) if e["event"] == "failed"]
    assert failed and failed[-1]["by"] == "node 1's launcher"
    # node 0's worker outlives its launcher for a moment and gets torch's SIGINT: not a user's
    # Ctrl-C, so it does not stop the job as one (which ended node 1 with exit 143)
    assert "SIGINT received" not in (run / "log.txt").read_text()
