"""Resuming (contract 7): a run stopped mid-epoch and resumed ends bit-identical, in float64, to the
same run trained without a stop; the sample order, optimizer, schedulers and RNGs all continue."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import toy
from phalanx import commands
from phalanx.checkpoint import TRAINER, WEIGHTS, Checkpoints
from phalanx.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

STOP = 3  # index of the StopAfter hook in the configs below


@pytest.fixture(autouse=True)
def _reset_logging():
    yield
    logger = logging.getLogger("phalanx")
    for handler in list(logger.handlers):  # `logs.setup` points handlers at this test's files
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = True


def _config(epochs: int = 3, stop_steps: int = 1000, **sections) -> dict:
    raw = toy.regression_config(main_loop={"epochs": epochs, "extra_streams": ["valid"]})
    raw["hooks"] = [{"ComputeStats": {"variables": ["loss"]}}, "LogVariables", "SaveLatest",
                    {"StopAfter": {"steps": stop_steps}}]
    raw.update(sections)
    return raw


def _run_dir(folder: Path) -> Path:
    runs = [p for p in (folder / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def _latest(run_dir: Path) -> tuple[int, dict, dict[str, torch.Tensor]]:
    ckpts = Checkpoints(run_dir / "checkpoints")
    step = ckpts.latest_valid()
    assert step is not None
    state = json.loads((ckpts.path(step) / TRAINER).read_text())
    return step, state, load_file(str(ckpts.path(step) / WEIGHTS))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.float64
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max().item())


def _uninterrupted(tmp_path: Path, raw: dict) -> tuple[int, dict, dict]:
    assert commands.train(str(toy.write_config(tmp_path / "whole", raw)), []) == 0
    return _latest(_run_dir(tmp_path / "whole"))


def _stopped(tmp_path: Path, raw: dict, stop: int) -> Path:
    raw = {**raw, "hooks": [*raw["hooks"][:STOP], {"StopAfter": {"steps": stop}}]}
    assert commands.train(str(toy.write_config(tmp_path / "parts", raw)), []) == 0
    return _run_dir(tmp_path / "parts")


def _check_mid_epoch_stop(run_dir: Path, stop: int, steps_per_epoch: int) -> dict:
    step, state, weights = _latest(run_dir)
    assert step == stop
    assert state["step"] == stop and 0 < state["step_in_epoch"] < steps_per_epoch
    assert state["epoch"] == stop // steps_per_epoch
    return weights


@pytest.mark.parametrize("accumulation", [1, 3])
def test_resume_mid_epoch_matches_uninterrupted_training(tmp_path, accumulation):
    raw = _config(parallel={"gradient_accumulation": accumulation})
    end, state, whole = _uninterrupted(tmp_path, raw)
    assert end == 15 and state["epoch"] == 3  # 40 samples, batch 8: 5 steps per epoch

    run_dir = _stopped(tmp_path, raw, stop=7)
    stopped = _check_mid_epoch_stop(run_dir, 7, 5)
    assert any(not torch.equal(stopped[k], whole[k]) for k in whole)

    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    assert _run_dir(tmp_path / "parts") == run_dir  # the same run continues
    end, state, resumed = _latest(run_dir)
    assert end == 15 and state["epoch"] == 3 and state["step_in_epoch"] == 0
    _assert_equal(resumed, whole)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["hooks"][STOP] == {"StopAfter": {"steps": 1000}}  # the override is recorded


def _dropout_model() -> dict:
    """A plain nn.Sequential with dropout: no wrapper class, the batch mapped by `inputs`."""
    return {"class": "torch.nn.Sequential", "args": [
        {"class": "torch.nn.Linear", "in_features": 3, "out_features": 8},
        {"class": "torch.nn.Dropout", "p": 0.3},
        {"class": "torch.nn.Linear", "in_features": 8, "out_features": 1},
        {"class": "torch.nn.Flatten", "start_dim": 0}],
        "inputs": {"x": "input"}, "outputs": "prediction",
        "loss": {"function": "mse_loss", "output": "prediction", "target": "y"}}


def test_resume_mid_epoch_with_dropout_restores_the_rng(tmp_path):
    raw = _config(model=_dropout_model())
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    _check_mid_epoch_stop(run_dir, 7, 5)
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


def test_dropout_draws_differ_between_seeds(tmp_path):
    """Guards the test above: with dropout, training does depend on the RNG stream."""
    _, _, a = _uninterrupted(tmp_path, _config(epochs=1, model=_dropout_model()))
    _, _, b = _uninterrupted(tmp_path / "other", _config(epochs=1, model=_dropout_model(), seed=1))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_mid_epoch_classes_with_momentum_warmup_and_scheduler(tmp_path):
    """60 samples, batch 7 (last batch 4), accumulation 2; momentum and schedules must be restored."""
    raw = _config(
        model={"class": "toy.Classifier", "features": 4, "classes": 3},
        dataset={"class": "toy.Classes", "batch_size": 7},
        optimizer={"class": "SGD", "lr": 0.1, "momentum": 0.9, "warmup_steps": 4},
        scheduler={"class": "StepLR", "step_size": 5, "gamma": 0.7, "interval": "step"},
        parallel={"gradient_accumulation": 2})
    end, _, whole = _uninterrupted(tmp_path, raw)
    assert end == 27  # 9 steps per epoch
    run_dir = _stopped(tmp_path, raw, stop=13)
    _check_mid_epoch_stop(run_dir, 13, 9)
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 27
    _assert_equal(resumed, whole)


def test_resume_falls_back_to_the_previous_valid_checkpoint(tmp_path):
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert ckpts.steps() == [5, 7]  # SaveLatest after epoch 1, and at the stop
    weights = ckpts.path(7) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


def test_resume_mid_epoch_with_another_batch_size_is_a_config_error(tmp_path):
    run_dir = _stopped(tmp_path, _config(), stop=7)
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError) as info:
        commands.resume(str(run_dir), ["dataset.batch_size=4", f"hooks.{STOP}.StopAfter.steps=1000"])
    message = str(info.value)
    assert "dataset.batch_size=8" in message and "4" in message
    assert (run_dir / "config.yaml").read_text() == before  # a refused resume changes nothing
    assert Checkpoints(run_dir / "checkpoints").latest_valid() == 7


def test_resume_at_an_epoch_boundary_may_change_the_batch_size(tmp_path):
    raw = _config(hooks=[{"ComputeStats": {"variables": ["loss"]}}, "LogVariables", "SaveLatest",
                         {"StopAfter": {"epochs": 1}}])
    assert commands.train(str(toy.write_config(tmp_path / "parts", raw)), []) == 0
    run_dir = _run_dir(tmp_path / "parts")
    step, state, _ = _latest(run_dir)
    assert (step, state["epoch"], state["step_in_epoch"]) == (5, 1, 0)
    assert commands.resume(str(run_dir), ["dataset.batch_size=4", f"hooks.{STOP}.StopAfter.epochs=1000"]) == 0
    step, state, _ = _latest(run_dir)
    assert (step, state["epoch"], state["batch_size"]) == (5 + 2 * 10, 3, 4)
