"""Dropout and augmentation under every strategy: a model with two dropout layers, trained on items
that draw noise when read, is the same run on one process, one process with two loader workers,
ddp, towers, fsdp, a pipeline and a parameter server's workers, in float64, and across a resume on
another count: masks and noise are keyed by sample."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

from phalanx import config, rundir, worker  # noqa: E402
from phalanx.checkpoint import Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(900)
N_TRAIN, N_VALID = 37, 10


def scenario(devices: int = 1, accumulation: int = 1, **parallel) -> dict:
    """Dropout of 0.3 and 0.15 between the layers; noise on every item read."""
    return toy.regression_config(
        model={"class": "toy.Dropped", "features": 3, "hidden": 8},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={"class": "toy.NoisyRegression", "batch_size": 10, "n_train": N_TRAIN},
        parallel={
            "accelerator": "cpu",
            "devices": devices,
            "gradient_accumulation": accumulation,
            **parallel,
        },
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_same_run(got: dict, want: dict) -> None:
    for name, value in want["params"].items():
        assert rel(got["params"][name], value) < 1e-10, name
    assert len(got["losses"]) == len(want["losses"]) > 0
    assert rel(got["losses"], want["losses"]) < 1e-10
    for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):  # evaluation draws none
        assert mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID
        assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
            theirs["valid"]["loss"]
        )


@pytest.fixture(scope="module")
def one() -> dict:
    return workers.train(scenario())


@pytest.mark.parametrize(
    ("processes", "raw"),
    [
        (2, scenario(2)),
        (3, scenario(3, 2)),
        (1, scenario(2, strategy="towers")),
        (1, {**scenario(), "dataset": {**scenario()["dataset"], "num_workers": 2}}),
        (2, scenario(2, strategy="fsdp")),
        (2, scenario(2, strategy="pipeline", pipeline={"split": ["net.3"], "schedule": "1f1b"})),
    ],
    ids=[
        "ddp-2",
        "ddp-3-accumulation-2",
        "towers-2",
        "two-loader-workers",
        "fsdp-2",
        "pipeline-2-stages-1f1b",
    ],
)
def test_dropout_trains_as_on_one_process(one, processes, raw):
    if processes == 1:
        assert_same_run(workers.train(raw), one)
        return
    [[first], *others] = workers.run_ranks(processes, workers.train_all, [raw])
    assert_same_run(first, one)
    for [got] in others:  # fsdp and the pipeline gather the whole model to rank 0 alone
        assert rel(got["losses"], one["losses"]) < 1e-10


def test_dropout_on_a_parameter_servers_workers_trains_as_on_one_process(one):
    """Two workers claim chunks of each micro-batch as they become free (staleness 0): the chunk's
    samples key its masks, whichever worker computes it."""
    raw = scenario(3, strategy="param_server", param_server={"servers": 1, "staleness": 0})
    for [got] in workers.run_ranks(3, workers.train_all, [raw])[:2]:
        assert_same_run(got, one)


def test_without_per_sample_draws_two_processes_train_otherwise(one):
    """torch's own generators, one a process: the test above could fail."""
    raw = {**scenario(2), "per_sample_random": False}
    [first, _] = workers.run_ranks(2, workers.train_all, [raw])
    assert rel(first[0]["losses"], one["losses"]) > 1e-6


def test_a_ddp_run_stopped_mid_epoch_resumes_on_one_process_as_one_process_trained(tmp_path):
    raw = scenario(2)
    raw["main_loop"] = {"epochs": 2, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 6}}]  # 4 steps an epoch: mid-epoch 2
    path = toy.write_config(tmp_path, raw)
    cfg, _ = config.load(str(path), [])
    run = rundir.create(cfg, path)
    assert workers.run_ranks(2, workers.run_dir_worker, str(run), False, []) == [0, 0]
    more = ["hooks.1.StopAfter.steps=1000", "parallel.devices=1"]
    assert worker.run_worker(run, True, more) == 0
    want = workers.train({**raw, "hooks": [], "parallel": {**raw["parallel"], "devices": 1}})
    got = load_file(Checkpoints(run / "checkpoints").path(8) / "model.safetensors")
    for name, value in want["params"].items():
        assert rel(got[name].tolist(), value) < 1e-10, name
