"""The everyday path through the real CLI: fine-tuning from a trained run on several processes."""

from __future__ import annotations

import pytest
import torch
import toy
from procs import only_run
from procs import run as phalanx
from safetensors.torch import load_file

from phalanx.checkpoint import Checkpoints

pytestmark = pytest.mark.timeout(300)


def test_init_from_on_two_processes_with_ddp_and_fsdp_trains_as_one(tmp_path):
    """A run started from another's best checkpoint ends with the same weights on 1 process, ddp on
    2 and fsdp on 2 (each rank loads the weights; fsdp keeps its shards of them)."""
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={"class": "toy.Regression", "batch_size": 7, "n_train": 41},
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            {"SaveBest": {"variable": "valid.loss", "mode": "min"}},
            "SaveLatest",
        ],
    )
    assert (
        phalanx("train", str(toy.write_config(tmp_path / "source", raw)), cwd=tmp_path).returncode
        == 0
    )
    source = only_run(tmp_path / "source" / "runs")
    ends = {}
    for name, parallel in (
        ("one", ["parallel.devices=1"]),
        ("ddp", ["parallel.devices=2"]),
        ("fsdp", ["parallel.devices=2", "parallel.strategy=fsdp"]),
    ):
        path = toy.write_config(tmp_path / name, {**raw, "parallel": {"accelerator": "cpu"}})
        result = phalanx("train", str(path), f"model.init_from={source}", *parallel, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        run = only_run(tmp_path / name / "runs")
        log = (run / "log.txt").read_text()
        assert f"weights from {source}" in log
        # the model's size at the start: 3x4 + 4 and 4x1 + 1 parameters, in float64
        assert "model Linear: 21 parameters (21 trainable), 168 B; net (Sequential) 21" in log
        checkpoints = Checkpoints(run / "checkpoints")
        step = checkpoints.latest_valid()
        folder = checkpoints.path(step)
        if (folder / "model.safetensors").is_file():
            ends[name] = load_file(folder / "model.safetensors")
        else:
            from phalanx.shards import read_shards_model

            ends[name] = read_shards_model(folder / "shards")
    for name in ("ddp", "fsdp"):
        for key, value in ends["one"].items():
            assert torch.allclose(ends[name][key], value, rtol=1e-10, atol=1e-12), (name, key)


def test_predict_writes_arrays_or_csv_with_the_predicted_class(tmp_path):
    """A classifier's predictions: CSV columns per logit and the argmax class; a .safetensors file
    with every value whole; both the same numbers, reloaded."""
    import csv

    from safetensors.torch import load_file

    raw = toy.regression_config(
        model={"class": "toy.Classifier", "features": 4, "classes": 3},
        dataset={"class": "toy.Classes", "batch_size": 8},
        hooks=[{"ComputeStats": {"variables": ["loss"]}}, "SaveLatest"],
    )
    assert phalanx("train", str(toy.write_config(tmp_path, raw)), cwd=tmp_path).returncode == 0
    run = only_run(tmp_path / "runs")
    for name in (
        "pred.csv",
        "pred.safetensors",
    ):  # no SaveBest: the default checkpoint is the latest
        result = phalanx(
            "predict", str(run), "--stream", "test", "--output", str(tmp_path / name), cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-2000:]
    arrays = load_file(tmp_path / "pred.safetensors")
    assert arrays["logits"].shape == (20, 3) and torch.equal(arrays["index"], torch.arange(20))
    assert torch.equal(arrays["logits.class"], arrays["logits"].argmax(dim=1))
    with open(tmp_path / "pred.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20 and {"logits.0", "logits.2", "logits.class", "loss", "y"} <= set(rows[0])
    for i, row in enumerate(rows):
        assert int(row["logits.class"]) == int(arrays["logits.class"][i])
        assert float(row["logits.1"]) == pytest.approx(float(arrays["logits"][i, 1]), rel=1e-12)
        assert float(row["loss"]) == pytest.approx(float(arrays["loss"][i]), rel=1e-12)
