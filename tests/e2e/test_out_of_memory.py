"""A worker that runs out of device memory (a fault injector raises torch.OutOfMemoryError on one
rank above a micro-batch size): every process stops at once (none waits in a collective), and
the run goes on from its last checkpoint with twice the micro-batches a step, kept in its config,
until they fit; it ends where a run without the fault ends."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import forks
import pytest
import torch
import toy
from safetensors.torch import load_file

from phalanx import api

pytestmark = pytest.mark.timeout(600)


def _raw(model: dict, strategy: str) -> dict:
    return toy.regression_config(
        model=model,
        dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 40},
        parallel={"accelerator": "cpu", "devices": 2, "strategy": strategy},
        main_loop={"epochs": 2, "extra_streams": []},
        hooks=["SaveLatest"],
    )


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return forks.run(args, cwd, env, 500)


@pytest.mark.parametrize(
    ("strategy", "devices", "who"),
    [("ddp", 2, "process 1"), ("fsdp", 2, "process 1"), ("single", 1, "the process")],
)
def test_a_process_out_of_memory_makes_the_run_go_on_with_more_micro_batches(
    tmp_path, strategy, devices, who
):
    # one rank alone fails from its 7th training forward (epoch 2's second step) on shards of more
    # than 8 / devices / 2 samples: with 2 micro-batches a step they fit
    rows, rank = 8 // devices // 2, 1 if devices > 1 else 0
    faulty = {"class": "toy.OutOfMemoryAbove", "features": 3, "rows": rows, "rank": rank}
    raw = _raw({**faulty, "after": 7}, strategy)
    raw["parallel"]["devices"] = devices
    path = toy.write_config(tmp_path, raw)
    result = _run(["train", str(path), "output_root=runs"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list((tmp_path / "runs").iterdir())
    log = " ".join((run / "log.txt").read_text().split())
    assert f"{who} ran out of device memory with 1 micro-batch a step; " in log
    assert "the run goes on from its last checkpoint with 2" in log
    assert ("every process has stopped" in log) == (devices > 1)
    assert "gradient_accumulation: 2" in (run / "config.yaml").read_text()
    out = tmp_path / "model.safetensors"
    exported = _run(["export", str(run), "--checkpoint", "latest", "--output", str(out)], tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    # the run without the fault, on one process with one micro-batch a step, ends the same
    plain = _raw({"class": "toy.Linear", "features": 3}, "single")
    plain["parallel"] = {"accelerator": "cpu"}
    plain["output_root"] = str(tmp_path / "plain")
    reference = api.fit(plain).model.state_dict()
    got = load_file(str(out))
    for key, value in reference.items():
        assert torch.allclose(got[key], value.detach().cpu(), rtol=1e-10, atol=1e-12), key


def test_a_process_out_of_memory_at_one_sample_a_micro_batch_ends_the_run(tmp_path):
    faulty = {"class": "toy.OutOfMemoryAbove", "features": 3, "rows": 0, "rank": 0}
    path = toy.write_config(tmp_path, _raw(faulty, "ddp"))
    result = _run(["train", str(path), "output_root=runs"], tmp_path)
    assert result.returncode != 0
    [run] = list((tmp_path / "runs").iterdir())
    log = (run / "log.txt").read_text()
    assert "process 0 ran out of device memory with micro-batches of one sample" in log
    assert "gradient_accumulation: 8" in (run / "config.yaml").read_text()  # 1, 2, 4, 8 tried
