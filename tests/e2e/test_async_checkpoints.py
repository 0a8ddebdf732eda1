"""`checkpoints.async: true`: the same checkpoints as written in the training thread, written by a
thread of their own; a process killed (SIGKILL) while one is written leaves no trace of that step,
and `phalanx resume` continues from the one before as if nothing had happened."""

from __future__ import annotations

import json

import pytest
import torch
import toy
from procs import finish, start, wait_until
from safetensors.torch import load_file

from phalanx import config
from phalanx.checkpoint import Checkpoints
from phalanx.errors import StorageError
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(300)


def raw(asynchronous: bool, **sections) -> dict:
    return toy.regression_config(
        checkpoints={"async": asynchronous, "keep_last": 100},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        hooks=[{"SaveEvery": {"steps": 1}}, "SaveLatest"],
        **sections,
    )


def test_async_checkpoints_are_the_ones_the_training_thread_writes(tmp_path):
    ends = {}
    for asynchronous in (False, True):
        run = tmp_path / str(asynchronous)
        run.mkdir()
        trainer = Trainer(config.validate(raw(asynchronous)), run, [])
        assert trainer.run() == 0
        ckpts = Checkpoints(run / "checkpoints")
        ends[asynchronous] = {
            step: (
                load_file(ckpts.verify(step) / "model.safetensors"),
                torch.load(ckpts.path(step) / "optimizer.pt", weights_only=True),
                json.loads((ckpts.path(step) / "trainer.json").read_text()),
            )
            for step in ckpts.steps()
        }
        events = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines()]
        assert sorted({e["step"] for e in events if e["event"] == "checkpoint"}) == ckpts.steps()
        assert (trainer.background is not None) == asynchronous
    assert list(ends[True]) == list(ends[False]) == list(range(1, 11))
    for step, (weights, optimizer, state) in ends[False].items():
        got_weights, got_optimizer, got_state = ends[True][step]
        assert (
            all(torch.equal(got_weights[k], v) for k, v in weights.items()) and got_state == state
        )
        moments = optimizer["optimizer"]["state"]
        assert all(
            torch.equal(
                got_optimizer["optimizer"]["state"][i]["momentum_buffer"], s["momentum_buffer"]
            )
            for i, s in moments.items()
        )


def test_a_failed_background_write_fails_the_run_at_the_next_save_or_its_end(tmp_path, monkeypatch):
    def full_disk(self, step, *args, **kwargs):
        raise StorageError(f"cannot write {self.path(step)}: the disk is full")

    monkeypatch.setattr(Checkpoints, "save", full_disk)
    trainer = Trainer(config.validate(raw(True)), tmp_path, [])
    with pytest.raises(StorageError, match="step-1: the disk is full"):
        trainer.run()
    assert (
        trainer.step == 2
    )  # raised at the second save, the first one's error: training went on meanwhile


def test_a_kill_during_an_async_write_leaves_no_trace_of_that_step_and_resume_goes_on(tmp_path):
    big = {
        "model": {
            "class": "toy.Linear",
            "features": 3,
            "hidden": 1_000_000,
        },  # 40 MB of weights, 40 of moments
        "dataset": {"class": "toy.Regression", "batch_size": 8, "n_train": 40},
        "main_loop": {"epochs": 3},
    }
    want_dir = tmp_path / "whole"
    want_dir.mkdir()
    whole = Trainer(config.validate({**raw(False, **big), "hooks": []}), None, [])
    assert whole.run() == 0
    want = {k: v.detach() for k, v in whole.model.state_dict().items()}

    exp = tmp_path / "exp"
    toy.write_config(exp, {**raw(True, **big), "checkpoints": {"async": True, "keep_last": 2}})
    proc = start("train", "config.yaml", cwd=exp)
    folder = lambda: next(iter((exp / "runs").glob("*/checkpoints")), None)  # noqa: E731
    wait_until(
        lambda: (
            (f := folder()) is not None and Checkpoints(f).steps() and list(f.glob(".tmp-step-*"))
        ),
        proc,
        what="a checkpoint being written after one was committed",
    )
    proc.kill()  # SIGKILL, while the writer thread writes
    finish(proc)
    ckpts = Checkpoints(folder())
    [partial] = [int(p.name.split("-")[2]) for p in ckpts.root.glob(".tmp-step-*")]
    assert partial not in ckpts.steps() and ckpts.steps()
    for step in ckpts.steps():
        ckpts.verify(step)  # every step that shows is whole

    result = finish(start("resume", str(ckpts.root.parent), cwd=exp), timeout=200)
    assert result.returncode == 0, result.stderr
    got = load_file(Checkpoints(ckpts.root).verify(15) / "model.safetensors")
    for key, value in want.items():
        assert float((got[key] - value).abs().max()) <= 1e-10 * float(value.abs().max()), key
