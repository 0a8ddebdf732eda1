"""Signals sent to a real `phalanx train` process: the first SIGINT (to the process group, as a
terminal's Ctrl-C) or SIGTERM finishes the step, saves, leaves every file of the run whole and exits
with 128 + the signal number; `phalanx resume` then ends where an uninterrupted run ends; a second
signal exits at once and leaves no half-written checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import toy
from procs import finish, start, wait_until
from safetensors.torch import load_file

from phalanx import config
from phalanx.hooks import StopAfter
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(240)

EPOCHS, STEPS_PER_EPOCH = 8, 10

SLOW = '''
import time

from torch.utils.data import Dataset

import toy


class Slow(Dataset):
    def __init__(self, items, delay):
        self.items, self.delay = items, delay

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.items[i]


class SlowRegression(toy.Regression):
    """toy.Regression whose items take `delay` seconds each to load: training takes seconds."""

    def __init__(self, delay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def streams(self):
        return {name: Slow(items, self.delay) for name, items in super().streams().items()}
'''


def slow_config(delay: float) -> dict:
    return toy.regression_config(
        # loader workers, which a terminal's Ctrl-C reaches too
        dataset={
            "class": "slowtoy.SlowRegression",
            "batch_size": 4,
            "delay": delay,
            "num_workers": 2,
        },
        main_loop={"epochs": EPOCHS},
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "WriteCSV",
            "SaveLatest",
            "PlotLines",
            {"WriteTensorBoard": {"every_n_steps": 5}},
        ],
    )


def trace(run: Path) -> list[dict]:
    try:
        lines = (run / "trace.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _log(exp: Path) -> str:
    logs = list((exp / "runs").glob("*/log.txt"))
    return logs[0].read_text() if logs else ""


def the_run(root: Path) -> Path | None:
    runs = list(root.iterdir()) if root.is_dir() else []
    return runs[0] if len(runs) == 1 else None


def reference_weights(exp: Path, **stop) -> dict[str, torch.Tensor]:
    """Weights of the same config trained in this process without delays, in one go."""
    hooks = [StopAfter(**stop)] if stop else []
    trainer = Trainer(config.validate(slow_config(delay=0.0)), None, [exp], hooks=hooks)
    assert trainer.run() == 0
    return trainer.module.state_dict()


def assert_weights_equal(run: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    saved = load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))
    assert set(saved) == set(expected)
    for name, value in saved.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """train, SIGINT to its process group after the first epoch (while the drawing process of the
    plots starts); resume, SIGTERM after one more epoch; resume to the end."""
    exp = tmp_path_factory.mktemp("signals") / "exp"
    toy.write_config(exp, slow_config(delay=0.01))
    (exp / "slowtoy.py").write_text(SLOW)
    root = exp / "runs"

    proc = start("train", "config.yaml", cwd=exp, new_session=True)
    wait_until(
        lambda: (run := the_run(root)) and any(e["event"] == "epoch" for e in trace(run)),
        proc,
        what="the first epoch",
    )
    run = the_run(root)
    os.killpg(proc.pid, signal.SIGINT)
    first = finish(proc)
    first.trace = trace(run)
    first.run = shutil.copytree(
        run, exp / "after-sigint"
    )  # as it was: the resumes below prune checkpoints

    proc = start("resume", str(run), cwd=exp)
    before = len(first.trace)
    wait_until(
        lambda: any(e["event"] == "epoch" for e in trace(run)[before:]),
        proc,
        what="an epoch after resuming",
    )
    proc.send_signal(signal.SIGTERM)
    second = finish(proc)
    second.trace = trace(run)[before:]
    second.run = shutil.copytree(run, exp / "after-sigterm")

    third = finish(start("resume", str(run), cwd=exp), timeout=120)
    third.trace = trace(run)[before + len(second.trace) :]
    return SimpleNamespace(exp=exp, run=run, first=first, second=second, third=third)


def test_sigint_finishes_the_step_saves_and_exits_130(chain):
    first = chain.first
    assert first.returncode == 130, first.stderr
    last = first.trace[-1]
    assert last["event"] == "interrupted"
    step = last["step"]
    assert STEPS_PER_EPOCH < step < EPOCHS * STEPS_PER_EPOCH  # stopped in the middle of training
    folder = chain.first.run / "checkpoints" / f"step-{step}"
    assert (folder / "manifest.json").is_file()
    state = json.loads((folder / "trainer.json").read_text())
    assert state["step"] == step
    assert state["epoch"] * STEPS_PER_EPOCH + state["step_in_epoch"] == step
    # the step was finished, not cut: the weights are those of exactly `step` steps
    assert_weights_equal(chain.first.run, step, reference_weights(chain.exp, steps=step))
    assert f"interrupted at step {step}" in first.stderr and "phalanx resume" in first.stderr
    # said once, by the training process: its loader workers leave the stop to it
    assert first.stderr.count("SIGINT received") == 1, first.stderr
    assert "Traceback" not in first.stderr
    assert not list((chain.first.run / "checkpoints").glob(".tmp-*"))


def test_sigint_to_the_process_group_leaves_every_file_of_the_run_whole(chain):
    """Plots, metrics and TensorBoard events hold every epoch done; no temporary file is left."""
    run = chain.first.run
    step = chain.first.trace[-1]["step"]
    state = json.loads((run / "checkpoints" / f"step-{step}" / "trainer.json").read_text())
    epochs = list(range(1, state["epoch"] + 1))
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
    [history] = [h["history"] for name, h in state["hooks"].items() if name.endswith("PlotLines")]
    assert [epoch for epoch, _ in history["valid.loss"]] == epochs
    from phalanx.plots import draw

    draw(chain.exp / "whole", history)
    assert (run / "plots" / "loss.png").read_bytes() == (
        chain.exp / "whole" / "loss.png"
    ).read_bytes()
    rows = (run / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == epochs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("epoch")] == epochs
    assert max(e.step for e in events.Scalars("train/step_loss")) == 5 * (step // 5)


def test_sigterm_saves_and_exits_143(chain):
    second = chain.second
    assert second.returncode == 143, second.stderr
    assert (
        second.trace[0]["event"] == "started"
        and second.trace[0]["step"] == chain.first.trace[-1]["step"]
    )
    last = second.trace[-1]
    assert last["event"] == "interrupted" and last["step"] > second.trace[0]["step"]
    assert (second.run / "checkpoints" / f"step-{last['step']}" / "manifest.json").is_file()
    assert "SIGTERM" in second.stderr and "Traceback" not in second.stderr


def test_resume_after_the_interruptions_ends_like_an_uninterrupted_run(chain):
    third = chain.third
    assert third.returncode == 0, third.stderr
    assert third.trace[0]["step"] == chain.second.trace[-1]["step"]
    assert (
        third.trace[-1]["event"] == "finished"
        and third.trace[-1]["step"] == EPOCHS * STEPS_PER_EPOCH
    )
    rows = (chain.run / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, EPOCHS + 1))
    assert_weights_equal(chain.run, EPOCHS * STEPS_PER_EPOCH, reference_weights(chain.exp))


def test_a_second_signal_exits_at_once_leaving_no_partial_checkpoint(tmp_path):
    exp = tmp_path / "exp"
    # every checkpoint takes 10 minutes to write, so both signals arrive while one is half written
    toy.write_config(
        exp,
        toy.regression_config(
            model={"class": "toy.SlowSave", "save_delay": 600.0},
            main_loop={"epochs": 3},
            hooks=["SaveLatest"],
        ),
    )
    (exp / "slowtoy.py").write_text(SLOW)
    checkpoints = lambda: next((exp / "runs").glob("*/checkpoints"), None)  # noqa: E731
    proc = start("train", "config.yaml", cwd=exp)
    wait_until(
        lambda: (c := checkpoints()) is not None and any(c.glob(".tmp-*")),
        proc,
        what="a checkpoint being written",
    )
    proc.send_signal(signal.SIGINT)
    # the second once the first was taken (two sent while the process waits for the CPU would be
    # one pending signal)
    wait_until(
        lambda: "SIGINT received: finishing the current step" in _log(exp),
        proc,
        what="the first signal being taken",
    )
    proc.send_signal(signal.SIGINT)
    # at once: not after the save, which takes 10 minutes
    result = finish(proc, timeout=180)
    assert result.returncode == 130, result.stderr
    folder = checkpoints()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp")] == []
    for step in folder.glob("step-*"):
        assert (step / "manifest.json").is_file(), f"{step} has no manifest"
    assert "interrupted" not in [
        e["event"] for e in trace(folder.parent)
    ]  # it did not wait to save
    assert "Traceback" not in result.stderr
