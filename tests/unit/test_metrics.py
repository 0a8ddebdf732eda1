"""Throughput, FLOPs, MFU and scaling figures against answers known in advance."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import toy
from torch import nn

from phalanx import config, metrics
from phalanx.hooks import ComputeStats, Hook, LogThroughput
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def test_flops_of_a_linear_layer_are_two_per_multiply_add():
    layer = nn.Linear(10, 20, bias=False)
    x = torch.randn(8, 10)
    assert metrics.count_flops(lambda: layer(x)) == 2 * 8 * 10 * 20


def test_training_flops_count_forward_and_weight_gradients_on_meta_tensors():
    layer = nn.Linear(10, 20, bias=False)
    before = layer.weight.detach().clone()
    flops = metrics.training_flops(layer, lambda m, b: m(b["x"]).sum(), {"x": torch.randn(8, 10)})
    assert flops == 2 * (2 * 8 * 10 * 20)  # forward, and the weight gradient (the input needs none)
    assert (
        torch.equal(layer.weight, before) and layer.weight.grad is None
    )  # the real model is untouched


def test_a_model_on_meta_keeps_its_shapes_and_tied_weights_and_leaves_the_model_as_it_was():
    model = toy.Tied()
    meta = metrics.on_meta(model)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert meta.net[4].weight is meta.net[0].weight  # tied, as in the model
    assert [p.shape for p in meta.parameters()] == [p.shape for p in model.parameters()]
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_scaling_efficiency_is_throughput_over_n_times_one_device():
    rows = metrics.scaling(
        [
            {"devices": 1, "samples_per_s": 100.0},
            {"devices": 2, "samples_per_s": 150.0},
            {"devices": 4, "samples_per_s": 80.0},
        ]
    )
    assert [r["speedup"] for r in rows] == [1.0, 1.5, 0.8]
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, 0.2]


class _Clock:
    """A clock that advances by a fixed interval at every training step: known sleeps."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_samples_per_second_of_a_loop_with_a_known_step_time(tmp_path):
    cfg = config.validate(
        toy.regression_config(
            dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 40},
            main_loop={"epochs": 2, "extra_streams": []},
        )
    )
    hook = LogThroughput(every_n_steps=2, warmup_steps=2, clock=_Clock(0.25), peak_flops=1e3)
    trainer = Trainer(cfg, tmp_path, [toy.__file__.rsplit("/", 1)[0]], hooks=[ComputeStats(), hook])
    assert trainer.run() == 0
    summary = json.loads((tmp_path / "throughput.json").read_text())
    assert summary["samples_per_s"] == pytest.approx(8 / 0.25)  # 8 samples every 0.25 s
    assert summary["steps"] == 10
    # FLOPs of the toy model (3 -> 1 linear) per sample: forward 2*3, weight gradient 2*3
    assert summary["flops_per_sample"] == pytest.approx(12)
    assert summary["mfu"] == pytest.approx(12 * 32 / 1e3)
    assert trainer.epoch_data["train"]["samples_per_s"] == pytest.approx(32)
    # 3 weights and a bias in float64, a gradient of each, and plain SGD keeps no state
    assert summary["state_bytes"] == {"parameters": 32, "gradients": 32, "optimizer": 0}


class _Times:
    """A clock that gives `times` in turn, one a training step."""

    def __init__(self, times: list[float]):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


class _EpochRates(Hook):
    """Keeps each epoch's training samples/s, as LogThroughput put it in the epoch's data."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        self.rates.append(epoch_data["train"]["samples_per_s"])


def test_warm_up_steps_and_the_time_between_epochs_are_not_counted(tmp_path, caplog):
    """8 samples a step; the second step takes 1 s, the others 0.25 s, and 8 s pass between the
    epochs (an evaluation). The run's figure leaves out the warm-up (the first two steps) and the
    gap; an epoch's counts its own steps, warm-up included; a log line, the steps since the last."""
    cfg = config.validate(
        toy.regression_config(
            dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 40},
            main_loop={"epochs": 2, "extra_streams": []},
        )
    )
    first = [0.0, 1.0, 1.25, 1.5, 1.75]
    clock = _Times([*first, *(10 + t for t in (0.0, 0.25, 0.5, 0.75, 1.0))])
    hook, epochs = LogThroughput(every_n_steps=2, warmup_steps=2, clock=clock), _EpochRates()
    trainer = Trainer(cfg, tmp_path, [toy.__file__.rsplit("/", 1)[0]], hooks=[hook, epochs])
    with caplog.at_level(logging.INFO, logger="phalanx"):
        assert trainer.run() == 0
    summary = json.loads((tmp_path / "throughput.json").read_text())
    assert summary["samples_per_s"] == pytest.approx(8 / 0.25)  # the 7 steady steps' rate
    assert epochs.rates == pytest.approx([32 / 1.75, 32 / 1.0])
    lines = re.findall(r"step (\d+) \| ([\d,]+) samples/s", caplog.text)
    # steps 1-2: one interval (1 s); 3-4: two of 0.25 s; 5-6: one (the gap is not counted)
    assert lines[:3] == [("2", "8"), ("4", "32"), ("6", "32")]


def test_flops_are_counted_where_an_output_has_the_name_of_an_input(tmp_path, caplog):
    """The model returns its prediction as `y`, the target's name: the batch that hooks see holds
    the prediction there, and the FLOPs are still counted, on the dataset's own `y`."""
    cfg = config.validate(
        toy.regression_config(
            model={"class": "toy.SameName", "features": 3},
            dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 16},
            main_loop={"epochs": 1, "extra_streams": []},
        )
    )
    hook = LogThroughput(warmup_steps=1, clock=_Clock(0.25))
    trainer = Trainer(cfg, tmp_path, [toy.__file__.rsplit("/", 1)[0]], hooks=[hook])
    assert trainer.run() == 0
    assert hook.flops_per_sample == pytest.approx(12)  # as toy.Linear's, above
    assert "FLOPs" not in caplog.text


def test_peak_flops_are_unknown_on_cpu():
    assert metrics.peak_flops(torch.device("cpu")) is None
    assert metrics.memory(torch.device("cpu"))["memory_peak_gib"] > 0


def test_mfu_under_towers_counts_every_tower(tmp_path):
    """towers x 2 on the CPU, with a given peak per device: the same run at the same pace uses half
    the FLOP/s of its two devices that it used of one."""
    summaries = {}
    for towers in (1, 2):
        cfg = config.validate(
            toy.regression_config(
                dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 40},
                main_loop={"epochs": 1, "extra_streams": []},
                parallel={"accelerator": "cpu", "devices": towers, "strategy": "towers"},
            )
        )
        hook = LogThroughput(warmup_steps=1, clock=_Clock(0.25), peak_flops=1e3)
        run = tmp_path / f"towers{towers}"
        run.mkdir()
        trainer = Trainer(cfg, run, [toy.__file__.rsplit("/", 1)[0]], hooks=[hook])
        assert trainer.run() == 0
        summaries[towers] = json.loads((run / "throughput.json").read_text())
    one, two = summaries[1], summaries[2]
    assert one["mfu"] == pytest.approx(12 * 32 / 1e3)  # as on one device, above
    assert two["mfu"] == pytest.approx(one["mfu"] / 2)
    assert (one["devices"], two["devices"]) == (1, 2)
    assert (one["peak_flops"], two["peak_flops"]) == (1e3, 2e3)
