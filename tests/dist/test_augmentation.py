"""Augmentation drawn in a dataset's __getitem__ (torch, numpy and random noise, toy.NoisyRegression)
on real gloo processes, in float64: keyed by sample (per_sample_random, the default), one process,
one process with 2 loader workers and ddp on 2 processes train the same, evaluation included, and a
ddp run stopped mid-epoch and resumed on one process ends as one process's run; with
per_sample_random false, the noise is each process's own and 2 processes train otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import config, rundir, worker  # noqa: E402
from phalanx.checkpoint import WEIGHTS, Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(300)
STOP = 2  # the StopAfter hook's index


def _raw(devices: int = 1, stop: int = 1000, per_sample: bool = True, **dataset) -> dict:
    # 41 samples in batches of 7: 6 steps an epoch, the last of 6 samples, uneven shards on 2
    return toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        dataset={"class": "toy.NoisyRegression", "batch_size": 7, "n_train": 41, **dataset},
        parallel={"accelerator": "cpu", "devices": devices},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        per_sample_random=per_sample,
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "SaveLatest",
            {"StopAfter": {"steps": stop}},
        ],
    )


@pytest.fixture(scope="module")
def one_process() -> dict:
    return workers.train(_raw())


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def same_params(got: dict, want: dict) -> bool:
    assert got.keys() == want.keys()
    return all(rel(got[name], want[name]) < 1e-10 for name in want)


def assert_same_run(got: dict, want: dict) -> None:
    assert same_params(got["params"], want["params"])
    assert rel(got["losses"], want["losses"]) < 1e-10
    valid = [[epoch["valid"]["loss"] for epoch in run["epochs"]] for run in (got, want)]
    assert rel(*valid) < 1e-10  # evaluation's noise is keyed too


def test_augmented_training_is_the_same_on_workers_and_processes(one_process):
    assert_same_run(workers.train(_raw(num_workers=2)), one_process)  # persistent workers
    keyed, plain = workers.run_ranks(
        2, workers.train_all, [_raw(2), _raw(2, per_sample=False)], timeout=240
    )[0]
    assert_same_run(keyed, one_process)
    # without per-sample streams, rank 1's shards draw rank 1's noise: another training
    assert not same_params(plain["params"], workers.train(_raw(per_sample=False))["params"])


def _new_run(folder: Path, raw: dict) -> Path:
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    return rundir.create(cfg, path)


def test_a_run_stopped_on_two_processes_resumes_on_one_with_the_same_augmentation(
    tmp_path, one_process
):
    run = _new_run(tmp_path / "run", _raw(2, stop=9))  # mid-epoch 2
    assert workers.run_ranks(2, workers.run_dir_worker, str(run), False, [], timeout=240) == [0, 0]
    resume = [f"hooks.{STOP}.StopAfter.steps=1000", "parallel.devices=1"]
    assert worker.run_worker(run, True, resume) == 0
    checkpoints = Checkpoints(run / "checkpoints")
    step = checkpoints.latest_valid()
    assert step == 12
    weights = load_file(str(checkpoints.path(step) / WEIGHTS))
    assert same_params({k: v.tolist() for k, v in weights.items()}, one_process["params"])
