"""SaveLatest, then SaveBest at the same step (the default hooks' order): the step is written once
and recorded as the best under every strategy, sync and async, and retention keeps it."""

from __future__ import annotations

import json

import pytest
import toy
from procs import run as phalanx_cli

import phalanx
from phalanx.checkpoint import Checkpoints

pytestmark = pytest.mark.timeout(240)

# train.loss falls every epoch here, so its largest value, the best with mode max, is epoch 1's
HOOKS = [
    {"ComputeStats": {"variables": ["loss"]}},
    "SaveLatest",
    {"SaveBest": {"variable": "train.loss", "mode": "max"}},
]


def _raw(**parallel) -> dict:
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", **parallel},
        main_loop={"epochs": 3, "extra_streams": []},
        checkpoints={"keep_last": 1},
        hooks=HOOKS,
    )
    raw["dataset"]["n_train"] = 24  # 3 steps an epoch
    return raw


def _best_is_kept(run_dir) -> None:
    checkpoints = Checkpoints(run_dir / "checkpoints")
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert best["step"] == 3 and best["variable"] == "train.loss"
    assert checkpoints.steps() == [3, 9]  # the latest, and the best that retention keeps
    assert checkpoints.select("best") == 3


@pytest.mark.parametrize(
    "parallel, async_",
    [
        ({}, False),
        ({}, True),
        ({"devices": 2, "strategy": "towers"}, False),
        ({"strategy": "fsdp"}, False),  # one device: sharded steps, in this process
        ({"strategy": "fsdp"}, True),
    ],
    ids=["single", "single-async", "towers", "fsdp", "fsdp-async"],
)
def test_the_best_step_is_recorded_when_it_was_saved_already(
    tmp_path, monkeypatch, parallel, async_
):
    monkeypatch.chdir(tmp_path)
    raw = _raw(**parallel)
    raw["checkpoints"]["async"] = async_
    run = phalanx.fit(raw)
    assert run.code == 0
    _best_is_kept(run.run_dir)


def test_fsdp_on_two_processes_records_and_keeps_the_best(tmp_path):
    path = toy.write_config(tmp_path, _raw(strategy="fsdp", devices=2))
    result = phalanx_cli("train", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    _best_is_kept(run_dir)
    listed = phalanx_cli("ls", str(tmp_path / "runs"), cwd=tmp_path)
    assert "train.loss=" in listed.stdout and "@ 3" in listed.stdout
