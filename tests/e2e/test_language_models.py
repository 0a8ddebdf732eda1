"""What language-model training needs beyond the contract, through the real CLI: evaluation every N
steps of one long epoch (validation rows, the best checkpoint and early stopping at the configured
steps, the same on 1 and 2 processes, and across a resume), schedulers whose length is `auto`,
gradient clipping that skips a step whose norm is not finite, and token files on disk."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import toy
from procs import only_run
from procs import run as phalanx

from phalanx import config, data
from phalanx.checkpoint import Checkpoints
from phalanx.errors import DataError
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# --- evaluation every N steps ------------------------------------------------------------------


def rounds_config(devices: int = 1, stop_steps: int = 1000) -> dict:
    """One epoch of 11 steps (41 samples, batch 4), evaluated every 3 steps; the valid loss never
    improves by min_delta, so StopOnPlateau(patience 2) stops after the third round, at step 9."""
    return toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={"class": "toy.Regression", "batch_size": 4, "n_train": 41},
        parallel={"accelerator": "cpu", "devices": devices},
        main_loop={"epochs": 1, "extra_streams": ["valid"], "eval_every_n_steps": 3},
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "WriteCSV",
            {"SaveBest": {"variable": "valid.loss", "mode": "min"}},
            "SaveLatest",
            {"StopOnPlateau": {"variable": "valid.loss", "patience": 2, "min_delta": 1.0e9}},
            {"StopAfter": {"steps": stop_steps}},
        ],
    )


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> dict[int, Path]:
    runs = {}
    for devices in (1, 2):
        folder = tmp_path_factory.mktemp(f"rounds{devices}")
        result = phalanx("train", str(toy.write_config(folder, rounds_config(devices))), cwd=folder)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[devices] = only_run(folder / "runs")
    return runs


def test_one_long_epoch_is_evaluated_every_n_steps_and_stops_early_on_a_round(rounds):
    run = rounds[1]
    got = rows(run)
    assert [(int(r["epoch"]), int(r["step"])) for r in got] == [(1, 3), (2, 6), (3, 9)]
    assert all(
        r["valid.loss"] and r["train.loss"] for r in got
    )  # validation and training means per round
    checkpoints = Checkpoints(run / "checkpoints")
    assert checkpoints.steps() == [3, 6, 9]
    best = json.loads((checkpoints.path(checkpoints.best()) / "trainer.json").read_text())
    losses = [float(r["valid.loss"]) for r in got]
    assert best["step"] == 3 * (1 + losses.index(min(losses)))
    log = (run / "log.txt").read_text()
    assert "has not improved for 2 epochs" in log


def test_rounds_are_the_same_on_two_processes(rounds):
    one, two = rows(rounds[1]), rows(rounds[2])
    assert [(r["epoch"], r["step"]) for r in one] == [(r["epoch"], r["step"]) for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("train.loss", "valid.loss"):
            assert abs(float(a[key]) - float(b[key])) <= 1e-10 * abs(float(a[key])), key
    assert (
        Checkpoints(rounds[1] / "checkpoints").best()
        == Checkpoints(rounds[2] / "checkpoints").best()
    )


def test_a_run_stopped_between_rounds_resumes_them_on_the_beat(tmp_path, rounds):
    """Stopped at step 4 (after round 1), resumed: rounds at steps 6 and 9 as without the stop."""
    raw = rounds_config(stop_steps=4)
    assert phalanx("train", str(toy.write_config(tmp_path, raw)), cwd=tmp_path).returncode == 0
    run = only_run(tmp_path / "runs")
    assert [int(r["step"]) for r in rows(run)] == [3]
    result = phalanx("resume", str(run), "hooks.5.StopAfter.steps=1000", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    want = rows(rounds[1])
    got = rows(run)
    assert [(r["epoch"], r["step"]) for r in got] == [(r["epoch"], r["step"]) for r in want]
    assert [float(r["valid.loss"]) for r in got] == pytest.approx(
        [float(r["valid.loss"]) for r in want], rel=1e-12
    )


# --- the run's length as a scheduler argument ----------------------------------------------------


def test_auto_is_the_number_of_optimizer_steps_of_the_run():
    raw = toy.regression_config(
        dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 41},
        main_loop={"epochs": 3, "extra_streams": []},
        hooks=[],
        scheduler={"class": "OneCycleLR", "max_lr": 0.1, "total_steps": "auto"},
    )
    trainer = Trainer(config.validate(raw), None, [TESTS])
    assert trainer.schedulers[0][0].total_steps == 3 * 6
    assert (
        trainer.run() == 0
    )  # OneCycleLR refuses a step beyond total_steps: the run takes exactly that many
    raw["scheduler"] = {"class": "CosineAnnealingLR", "T_max": "auto", "interval": "epoch"}
    assert Trainer(config.validate(raw), None, [TESTS]).schedulers[0][0].T_max == 3


# --- clipping ----------------------------------------------------------------------------------


def test_a_step_whose_gradient_norm_is_not_finite_is_skipped_and_counted(tmp_path):
    """toy.InfAt returns an infinite loss on step 3: the clipped run skips that step (the weights
    stay finite), counts it in the epoch's row, and logs the norms."""
    raw = toy.regression_config(
        model={"class": "toy.InfAt", "features": 3, "step": 3},
        optimizer={"class": "SGD", "lr": 0.05, "max_grad_norm": 1.0},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "WriteCSV",
            "SaveLatest",
            {"WriteTensorBoard": {"every_n_steps": 1}},
        ],
    )
    assert phalanx("train", str(toy.write_config(tmp_path, raw)), cwd=tmp_path).returncode == 0
    run = only_run(tmp_path / "runs")
    got = rows(run)
    assert [float(r["train.grad_norm_nonfinite"]) for r in got] == [1, 0]
    assert all(0 < float(r["train.grad_norm"]) <= float(r["train.grad_norm_max"]) for r in got)
    from safetensors.torch import load_file

    checkpoints = Checkpoints(run / "checkpoints")
    weights = load_file(checkpoints.path(checkpoints.latest_valid()) / "model.safetensors")
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert "the gradient norm is not finite" in (run / "log.txt").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    norms = [e.value for e in events.Scalars("train/step_grad_norm")]
    assert (
        len(norms) == 10 and sum(not np.isfinite(v) for v in norms) == 1
    )  # every step's, step 3's infinite
    assert [e.value for e in events.Scalars("train/grad_norm_nonfinite")] == [1, 0]


# --- token files -------------------------------------------------------------------------------


def test_token_windows_read_next_token_pairs_from_a_memory_mapped_file(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    windows = data.TokenWindows(path, 16)
    assert len(windows) == (1000 - 1) // 16
    item = windows[2]
    assert torch.equal(item["tokens"], torch.arange(32, 48)) and torch.equal(
        item["targets"], torch.arange(33, 49)
    )
    assert item["tokens"].dtype == torch.int64
    assert torch.equal(windows[len(windows) - 1]["targets"][-1], torch.tensor(len(windows) * 16))
    with pytest.raises(IndexError):
        windows[len(windows)]
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        data.TokenWindows(tmp_path / "odd.bin", 4)
    with pytest.raises(DataError, match="is not a file"):
        data.TokenWindows(tmp_path / "missing.bin", 4)


def test_the_gpt_example_trains_from_token_files_it_prepares(tmp_path):
    """examples/gpt/tokens.yaml, shortened: the token files are written once, read memory-mapped,
    and the run learns; its scheduler's T_max is the run's length and its rows come every 110
    steps."""
    overrides = [
        f"output_root={tmp_path / 'runs'}",
        f"dataset.folder={tmp_path / 'tokens'}",
        "dataset.max_bytes=60000",
        "main_loop.epochs=1",
        "main_loop.eval_every_n_steps=10",
        "dataset.batch_size=16",
    ]
    result = phalanx("train", "examples/gpt/tokens.yaml", *overrides, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "tokens" / "train.bin").stat().st_size == 2 * (60000 - 6000)
    run = only_run(tmp_path / "runs")
    got = rows(run)
    steps = -(-((60000 - 6000 - 1) // 64) // 16)
    assert [int(r["step"]) for r in got] == [*range(10, steps, 10), steps]
    assert float(got[-1]["train.loss"]) < float(got[0]["train.loss"]) < np.log(256)
    assert f"T_max = {steps}" in (run / "log.txt").read_text()
