"""Resuming several processes with randomness: every rank's random streams are saved and restored,
so a 2-process run with dropout and augmentation, stopped mid-epoch and resumed on 2 processes, ends
bit-identical to the same run without a stop; on another process count the streams are re-derived,
as documented."""

from __future__ import annotations

import shutil
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


def _raw(stop: int) -> dict:
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", "devices": 2},
        main_loop={"epochs": 3, "extra_streams": []},
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "SaveLatest",
            {"StopAfter": {"steps": stop}},
        ],
    )
    # each process's own generators (keyed draws need no saving; these are what a checkpoint saves
    # for a model's own draws, and for all of them under per_sample_random: false), drawn by the
    # model's dropout and by the dataset's augmentation (read in the training process: no step's
    # items may be read before the checkpoint that precedes them)
    raw["dataset"] = {**raw["dataset"], "class": "toy.NoisyRegression"}
    return {**raw, "model": toy.dropout_model(), "per_sample_random": False}


def _new_run(folder: Path, raw: dict) -> Path:
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    return rundir.create(cfg, path)


def _final(run: Path) -> tuple[int, dict[str, torch.Tensor]]:
    ckpts = Checkpoints(run / "checkpoints")
    step = ckpts.latest_valid()
    return step, load_file(str(ckpts.path(step) / WEIGHTS))


def test_two_processes_with_dropout_resume_bit_identical(tmp_path):
    whole = _new_run(tmp_path / "whole", _raw(1000))
    assert workers.run_ranks(2, workers.run_dir_worker, str(whole), False, []) == [0, 0]
    parts = _new_run(tmp_path / "parts", _raw(7))
    assert workers.run_ranks(2, workers.run_dir_worker, str(parts), False, []) == [0, 0]
    assert _final(parts)[0] == 7  # 40 samples, batch 8: mid-epoch 2
    copy = tmp_path / "copy"
    shutil.copytree(parts, copy)

    resume = [f"hooks.{STOP}.StopAfter.steps=1000"]
    assert workers.run_ranks(2, workers.run_dir_worker, str(parts), True, resume) == [0, 0]
    (end, want), (got_end, got) = _final(whole), _final(parts)
    assert end == got_end == 15
    for key in want:
        assert torch.equal(got[key], want[key]), key

    # On one process the streams cannot continue: they are re-derived, and the log says so.
    assert worker.run_worker(copy, True, [*resume, "parallel.devices=1"]) == 0
    assert _final(copy)[0] == 15
    assert (
        "random streams re-derived from the seed, the step and the rank"
        in (copy / "log.txt").read_text()
    )
