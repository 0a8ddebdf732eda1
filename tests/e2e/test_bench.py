"""`phalanx bench` end to end on CPU with 1 and 2 devices: the table, bench.json and scaling.png."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import toy
from procs import PHALANX

from phalanx import commands, strategies
from phalanx.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def test_bench_runs_each_device_count_and_writes_its_table(tmp_path):
    path = toy.write_config(
        tmp_path,
        toy.regression_config(dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 200}),
    )
    out = tmp_path / "bench"
    result = subprocess.run(
        [*PHALANX, "bench", str(path), "--devices", "1,2", "--steps", "20", "--output", str(out)],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},  # torch's defaults
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2]
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert rows[0]["efficiency"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(
        rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"])
    )
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # beside each measurement, what the planner predicted for it, and by how much it missed
    for r in rows:
        assert r["predicted_samples_per_s"] > 0
        assert r["prediction_error"] == pytest.approx(
            (r["predicted_samples_per_s"] - r["samples_per_s"]) / r["samples_per_s"]
        )
    assert "predicted" in result.stdout and "error" in result.stdout
    assert "efficiency" in result.stdout and "samples/s" in result.stdout
    # each count runs with the threads `phalanx train` gives it, and says them: one process keeps
    # torch's own, two share the cores; the all-reduce that backward waits for is communication
    own = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    threads = [int(own.stdout), max(1, strategies.cpu_cores() // 2)]
    assert [r["cpu_threads"] for r in rows] == threads
    for run, n in zip(
        (next(out.glob("devices1-*")), next(out.glob("devices2-*"))), threads, strict=True
    ):
        said = (run / "log.txt").read_text()
        assert f"cpu device with {n} thread{'s' if n > 1 else ''};" in said
    assert "CPU threads: each process's" in " ".join(result.stdout.split())
    assert rows[0]["communication_share"] == 0 < rows[1]["communication_share"]
    # `phalanx ls` of the folder above lists the runs that bench grouped in its own folder
    listed = subprocess.run(
        [*PHALANX, "ls", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    for n in (1, 2):
        assert f"bench/devices{n}-" in listed.stdout


def test_a_bench_whose_run_fails_before_it_trains_leaves_no_folder(tmp_path, monkeypatch):
    """The run is discarded (nothing trained), and so are the folders made for it."""
    monkeypatch.chdir(tmp_path)
    path = toy.write_config(tmp_path, toy.regression_config(model={"class": "toy.NoSuchModel"}))
    with pytest.raises(ConfigError, match="has no 'NoSuchModel'"):
        commands.bench(str(path), [1], 2, [], None, plan=False)
    assert not (tmp_path / "runs").exists()
