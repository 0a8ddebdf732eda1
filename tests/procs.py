"""Driving the `phalanx` command in real processes, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import forks
import pytest

PHALANX = [str(forks.SCRIPT)] if forks.SCRIPT.is_file() else [sys.executable, "-m", "phalanx.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(
    *args: str, cwd: Path, new_session: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`phalanx ARGS...` started in `cwd`, its output captured (`env`: variables to add)."""
    return subprocess.Popen(
        [*PHALANX, *args],
        cwd=cwd,
        env={**ENV, **(env or {})},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=new_session,
    )


def finish(proc: subprocess.Popen, timeout: float = 180) -> SimpleNamespace:
    """Wait for the process; its exit code and output."""
    out, err = proc.communicate(timeout=timeout)
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err)


def wait_until(condition, proc: subprocess.Popen, timeout: float = 120, what: str = "") -> None:
    """Poll until `condition()` holds; fail, with the process's output, if it ends first or time
    runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (code {proc.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`phalanx ARGS...` run to its end in `cwd`, its output captured: a process forked from one
    that imported torch and phalanx once (`forks`)."""
    return forks.run(list(args), cwd, ENV, timeout)


def only_run(root: Path) -> Path:
    """The one run directory under `root`."""
    [run_dir] = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def hang(run_dir: Path) -> int:
    """A worker's `run` that hangs, after writing its pid to `run_dir/hanging`."""
    (run_dir / "hanging").write_text(str(os.getpid()))
    time.sleep(300)
    return 0


def report(run_dir: Path) -> int:
    """A worker's `run` that writes what it started with to `run_dir/report-<rank>.json`: its
    parent, and the variables of its environment that the tests look at."""
    import json

    rank = os.environ["RANK"]
    seen = {
        "parent": os.getppid(),
        "mark": os.environ.get("PHALANX_TEST_MARK"),
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "world": os.environ.get("WORLD_SIZE"),
    }
    (run_dir / f"report-{rank}.json").write_text(json.dumps(seen))
    return 0
