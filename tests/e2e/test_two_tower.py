"""The two-tower example (examples/two_tower) learns the ratings, and trains alike on one process,
split by layers over two (`pipeline`), and with its blocks placed by name (`placement`)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.e2e.test_examples import run_side_by_side

pytestmark = pytest.mark.timeout(400)

CONFIG = "examples/two_tower/config.yaml"
RUNS = {
    "single": [],
    "pipeline": [
        "parallel.strategy=pipeline",
        "parallel.accelerator=cpu",
        "parallel.devices=2",
        "parallel.cpu_threads=1",
        "parallel.pipeline.split=auto",  # cut where the measured times balance
    ],
    "placement": [
        "parallel.strategy=placement",
        "parallel.placement={layers.0: cpu, layers.1.item: cpu, layers.3: cpu}",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_tower")
    trained = run_side_by_side(
        {
            name: [
                "train",
                CONFIG,
                "main_loop.epochs=2",
                "precision=fp64",  # so that the strategies' sums in another order agree to 1e-9
                *overrides,
                f"output_root={root / name}",
            ]
            for name, overrides in RUNS.items()
        },
        timeout=360,
    )
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
    run = runs["single"]
    result = run_side_by_side({"eval": ["eval", str(run), "--stream", "test"]}, timeout=120)["eval"]
    assert result.returncode == 0, result.stderr[-3000:]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    saved = json.loads((run / f"eval-test-step-{best['step']}.json").read_text())
    assert saved["metrics"]["loss"] < 0.45, saved
    assert losses(run)[-1] < 0.35 * losses(run)[0]


def test_the_pipeline_and_placement_train_as_one_process_does(runs):
    """In float64, to 1e-9 over 200 steps (in float32 the pipeline's sums, in another order, drift
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
