"""The shipped examples train to the accuracy their docs promise: `phalanx train` then `phalanx
eval` in real processes, from the repository root so that `examples.digits...` imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import forks
import pytest

# a hang guard, with room for the examples' trainings side by side on a busy machine
pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# run name -> (config, overrides, test accuracy it must reach)
EXAMPLES = {
    "config": ("examples/digits/config.yaml", [], 0.97),
    "plain": ("examples/digits/plain.yaml", [], 0.9),
    # the same run on two CPU processes reaches the one-process run's accuracy
    "config-2cpu": (
        "examples/digits/config.yaml",
        ["parallel.accelerator=cpu", "parallel.devices=2"],
        0.97,
    ),
    # a Keras model (Keras's torch backend), on one process and on two
    "keras": ("examples/keras_digits/config.yaml", [], 0.97),
    "keras-2cpu": ("examples/keras_digits/config.yaml", ["parallel.devices=2"], 0.97),
}


def run_side_by_side(
    commands: dict[str, list[str]], timeout: float
) -> dict[str, subprocess.CompletedProcess]:
    procs = {key: forks.start(args, REPO, ENV) for key, args in commands.items()}
    deadline, results = time.monotonic() + timeout, {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[key] = subprocess.CompletedProcess(commands[key], proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Each example trained once and its best checkpoint evaluated on the test stream."""
    root = tmp_path_factory.mktemp("examples")
    trained = run_side_by_side(
        {
            name: ["train", path, *overrides, f"output_root={root / name}"]
            for name, (path, overrides, _) in EXAMPLES.items()
        },
        timeout=900,
    )
    runs = {}
    for name, result in trained.items():
        assert result.returncode == 0, result.stderr[-3000:]
        [runs[name]] = list((root / name).iterdir())
    evals = run_side_by_side(
        {name: ["eval", str(run), "--stream", "test"] for name, run in runs.items()}, timeout=400
    )
    return {name: (runs[name], trained[name], evals[name]) for name in EXAMPLES}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_digits_example_reaches_its_test_accuracy(evaluated, name):
    run, trained, result = evaluated[name]
    assert result.returncode == 0, result.stderr[-3000:]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    saved = json.loads((run / f"eval-test-step-{best['step']}.json").read_text())
    assert saved["stream"] == "test" and saved["checkpoint"] == best["step"]
    assert saved["metrics"]["accuracy"] >= EXAMPLES[name][2], saved
    assert 0 < saved["metrics"]["loss"] < 1.0
    assert best["variable"] == "valid.accuracy" and best["value"] >= EXAMPLES[name][2]
    assert (run / "metrics.csv").is_file() and (run / "config.yaml").is_file()


def test_the_demo_on_two_processes_is_the_demo_on_one(evaluated):
    """The demo's CNN has dropout: drawn by sample, two processes pick the same best step and
    reach the same test metrics as one, to float32 rounding."""
    found = {}
    for name in ("config", "config-2cpu"):
        run = evaluated[name][0]
        best = json.loads((run / "checkpoints" / "best.json").read_text())
        saved = json.loads((run / f"eval-test-step-{best['step']}.json").read_text())
        found[name] = (best["step"], saved["metrics"])
    (one_step, one), (two_step, two) = found["config"], found["config-2cpu"]
    assert one_step == two_step
    sys.path.insert(0, str(REPO))
    from examples.digits.data import Digits

    samples = len(Digits().streams()["test"])
    assert abs(one["accuracy"] - two["accuracy"]) <= 1 / samples  # at most one prediction apart
    # float32's rounding of sums in another order, grown over 300 steps
    assert abs(one["loss"] - two["loss"]) <= 0.05 * one["loss"]


def test_the_full_example_writes_every_report(evaluated):
    run, trained, _ = evaluated["config"]
    assert {p.name for p in (run / "plots").iterdir()} == {"loss.png", "accuracy.png"}
    assert any((run / "tensorboard").iterdir())
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train.loss", "train.accuracy", "valid.accuracy", "valid.f1"} <= set(header)
    assert "epoch 15 time |" in (run / "log.txt").read_text()


def test_the_python_example_trains_what_the_config_trains(evaluated, tmp_path):
    """examples/digits/fit.py gives phalanx.fit the model and data as objects: the same best
    checkpoint as `phalanx train` of the config, bit for bit, and the same test accuracy."""
    from safetensors.torch import load_file

    result = forks.run([], tmp_path, ENV, 300, script=REPO / "examples" / "digits" / "fit.py")
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list((tmp_path / "runs").iterdir())
    cli = evaluated["config"][0]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == json.loads((cli / "checkpoints" / "best.json").read_text())
    mine = load_file(run / "checkpoints" / f"step-{best['step']}" / "model.safetensors")
    theirs = load_file(cli / "checkpoints" / f"step-{best['step']}" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all((mine[k] == theirs[k]).all() for k in mine)
    accuracy = json.loads((cli / f"eval-test-step-{best['step']}.json").read_text())["metrics"][
        "accuracy"
    ]
    assert f"best checkpoint on the test stream: accuracy {accuracy:.4f}" in result.stdout
    assert "the first test image is a " in result.stdout
