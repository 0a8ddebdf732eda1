"""The two-tower example (examples/two_tower) learns the ratings, and trains alike on one process,
split by layers over two (`pipeline`), and with its blocks placed by name (`placement`, in the
CPU form its README shows); and its README's commands pass the config's checks as written."""

from __future__ import annotations

import csv
import json
import re
import shlex

import pytest
import torch

from phalanx import config, strategies
from tests.e2e.test_examples import REPO, run_side_by_side

pytestmark = pytest.mark.timeout(400)

CONFIG = "examples/two_tower/config.yaml"
README = REPO / "examples" / "two_tower" / "README.md"


def documented() -> list[list[str]]:
    """The README's `phalanx` commands, split as bash splits them (a variable such as `$B`
    expanded where the README sets it), without the word `phalanx`."""
    commands, variables = [], {}
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            name, _, value = words[0].partition("=") if len(words) == 1 else ("", "", "")
            if name.isidentifier() and value:
                variables[name] = shlex.split(value)
                continue
            words = [
                w
                for word in words
                for w in (variables.get(word[1:], [word]) if word.startswith("$") else [word])
            ]
            if words[:1] == ["phalanx"]:
                commands.append(words[1:])
    return commands


def _overrides(command: list[str]) -> tuple[list[str], int | None]:
    """A train or bench command's overrides, and the device count bench gives."""
    words, devices, overrides = iter(command[2:]), None, []
    for word in words:
        if word == "--devices":
            devices = int(next(words))
        elif word in ("--steps", "--output"):
            next(words, None)
        elif not word.startswith("--"):
            overrides.append(word)
    return overrides, devices


CPU_PLACEMENT = next(
    _overrides(c)[0]
    for c in documented()
    if c[0] == "train" and "parallel.strategy=placement" in c and "cuda" not in " ".join(c)
)
# the example as shipped, for two epochs; and the strategies side by side in float64, so that their
# sums in another order agree to 1e-9, on a quarter of its samples (fifty steps)
LEARNS = ["main_loop.epochs=2"]
ALIKE = [*LEARNS, "precision=fp64", "dataset.samples=2000"]
RUNS = {
    "single": [],
    "pipeline": [
        "parallel.strategy=pipeline",
        "parallel.accelerator=cpu",
        "parallel.devices=2",
        "parallel.cpu_threads=1",
        "parallel.pipeline.split=auto",  # cut where the measured times balance
    ],
    "placement": CPU_PLACEMENT,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_tower")
    commands = {
        name: ["train", CONFIG, *ALIKE, *overrides, f"output_root={root / name}"]
        for name, overrides in RUNS.items()
    }
    commands["learns"] = ["train", CONFIG, *LEARNS, f"output_root={root / 'learns'}"]
    trained = run_side_by_side(commands, timeout=360)
    out = {}
    for name, result in trained.items():
        assert result.returncode == 0, result.stderr[-3000:]
        [out[name]] = list((root / name).iterdir())
    return out


def losses(run) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(row["train.loss"]) for row in csv.DictReader(f)]


def test_the_example_learns_the_ratings(runs):
    """The best checkpoint's mean squared error on the test stream is a fraction of the ratings'
    variance (about 1.3): the towers read the tastes and traits out of the texts."""
    run = runs["learns"]
    result = run_side_by_side({"eval": ["eval", str(run), "--stream", "test"]}, timeout=120)["eval"]
    assert result.returncode == 0, result.stderr[-3000:]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    saved = json.loads((run / f"eval-test-step-{best['step']}.json").read_text())
    assert saved["metrics"]["loss"] < 0.45, saved
    assert losses(run)[-1] < 0.35 * losses(run)[0]


def test_the_pipeline_and_placement_train_as_one_process_does(runs):
    """In float64, to 1e-9 over 50 steps (in float32 the pipeline's sums, in another order, drift
    apart by a few percent in 300)."""
    single = losses(runs["single"])
    for name in ("pipeline", "placement"):
        mine = losses(runs[name])
        assert len(mine) == len(single) == 2
        assert all(abs(a - b) <= 1e-9 * b for a, b in zip(mine, single, strict=True)), (
            name,
            mine,
            single,
        )
    log = (runs["pipeline"] / "log.txt").read_text()
    assert "the model in 2 stages on 2 processes" in log
    assert "; split auto at layers." in log  # and the blocks' times it chose by


@pytest.mark.timeout(60)
def test_the_readmes_commands_pass_the_configs_checks_as_written(monkeypatch):
    """Each `phalanx train` and `phalanx bench` of the README, on this machine where it names no
    GPU: the overrides load, the strategy's own checks pass (a pipeline's schedule and its
    micro-batches), and a strategy of one process builds (placement's devices)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RANK", raising=False)
    commands = [c for c in documented() if c[0] in ("train", "bench")]
    assert len(commands) >= 10, commands
    for command in commands:
        overrides, devices = _overrides(command)
        if "cuda:" in " ".join(overrides) and not torch.cuda.is_available():
            continue  # the README says these need two GPUs
        if devices is not None:  # bench runs each count on the CPU where there is no GPU
            overrides = [*overrides, f"parallel.devices={devices}"]
        cfg = config.load(command[1], overrides)[0]
        processes = strategies.resolve_device(cfg)[1]
        strategies.check(cfg, processes)
        if not strategies.needs_launch(cfg):
            strategies.create(cfg)
