"""`placement`: one process, modules pinned to devices by name; the step is one device's, so the
run is `single`'s (on the CPU every device is the CPU; tests/gpu puts a module on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402
from test_invariance import assert_same_run  # noqa: E402

from phalanx import config, strategies  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def scenario(**parallel) -> dict:
    return toy.regression_config(
        model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 3},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={"class": "toy.Regression", "batch_size": 10, "n_train": 37},
        parallel={"accelerator": "cpu", "devices": 1, "gradient_accumulation": 3, **parallel},
        hooks=[],
    )


def test_placement_trains_as_one_device_and_hooks_see_the_same_outputs():
    want = workers.train(scenario())
    placed = scenario(strategy="placement", placement={"net.0": "cpu", "net.4": "cpu"})
    got = workers.train(placed)
    assert_same_run(got, want)
    assert got["ids"] == want["ids"] and got["predictions"] == want["predictions"]


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ({"net.9": "cpu"}, r"'net.9', which is not a module of the model; its modules include net"),
        ({"net.0": "tpu:0"}, r"puts net.0 on 'tpu:0'; name a device such as cuda:0"),
        ({"net.0": "cuda:99"}, r"puts net.0 on cuda:99, but \d+ GPU\(s\) are visible"),
        ({}, r"needs parallel.placement, the device of each module by name"),
    ],
)
def test_a_placement_the_model_or_the_machine_cannot_make_is_one_error(placement, message):
    raw = scenario(strategy="placement", placement=placement)
    with pytest.raises(config.ConfigError, match=message):
        workers.train(raw)


def test_placement_is_one_process():
    cfg = config.validate(scenario(strategy="placement", placement={"net.0": "cpu"}))
    assert not strategies.needs_launch(cfg)
