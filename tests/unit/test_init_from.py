"""model.init_from: a new run starts from a trained run's checkpoint or a safetensors file, with a
fresh optimizer; names that do not match are an error, or with strict: false a list in the log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import toy
from safetensors.torch import load_file

from phalanx import commands, config
from phalanx.checkpoint import Checkpoints
from phalanx.errors import CheckpointMismatch, ConfigError
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
TESTS = Path(toy.__file__).parent


def _raw(**model) -> dict:
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4, **model},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
    )
    raw["hooks"] = [
        {"ComputeStats": {"variables": ["loss"]}},
        {"SaveBest": {"variable": "valid.loss", "mode": "max"}},
        "SaveLatest",
    ]
    return raw


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("source")
    assert commands.train(str(toy.write_config(folder, _raw())), []) == 0
    [run] = list((folder / "runs").iterdir())
    return run


def _started(raw: dict) -> Trainer:
    trainer = Trainer(config.validate(raw), None, [TESTS])
    trainer.initialise_from()
    return trainer


def _weights(run: Path, which: str) -> dict[str, torch.Tensor]:
    checkpoints = Checkpoints(run / "checkpoints")
    return load_file(checkpoints.path(checkpoints.select(which)) / "model.safetensors")


@pytest.mark.parametrize("checkpoint", ["auto", "best", "latest"])
def test_a_new_run_starts_from_a_runs_checkpoint(trained, checkpoint):
    spec = (
        str(trained) if checkpoint == "auto" else {"path": str(trained), "checkpoint": checkpoint}
    )
    trainer = _started(_raw(init_from=spec))
    want = _weights(
        trained, "best" if checkpoint == "auto" else checkpoint
    )  # auto: the best where there is one
    got = trainer.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not trainer.optimizer.state  # the optimizer starts afresh
    assert _weights(trained, "best").keys() == want.keys()
    assert any(
        not torch.equal(_weights(trained, "best")[k], _weights(trained, "latest")[k]) for k in want
    )


def test_a_safetensors_file_and_a_run_trained_from_it(trained, tmp_path):
    exported = tmp_path / "weights.safetensors"
    assert commands.export(str(trained), str(exported), "latest") == 4  # tensors written
    trainer = _started(_raw(init_from=str(exported)))
    want = load_file(exported)
    assert all(torch.equal(trainer.model.state_dict()[k], want[k]) for k in want)
    raw = _raw(init_from=str(exported))
    raw["main_loop"] = {"epochs": 1, "extra_streams": ["valid"]}
    assert commands.train(str(toy.write_config(tmp_path / "next", raw)), []) == 0
    [run] = list((tmp_path / "next" / "runs").iterdir())
    assert f"weights from {exported}" in (run / "log.txt").read_text()


def test_names_that_do_not_match_are_an_error_or_with_strict_false_a_list(trained):
    """toy.Linear's weights without a hidden layer: net.weight, not net.0.weight."""
    with pytest.raises(
        CheckpointMismatch,
        match="the weights lack: net.weight, net.bias .*the model lacks: "
        "net.0.bias, net.0.weight.*strict: false",
    ):
        _started(_raw(hidden=0, init_from=str(trained)))
    with pytest.raises(
        CheckpointMismatch, match="does not fit this model"
    ):  # another shape: never loadable
        _started(_raw(hidden=5, init_from={"path": str(trained), "strict": False}))


def test_strict_false_loads_what_matches(trained, tmp_path):
    weights = _weights(trained, "latest")
    from safetensors.torch import save_file

    partial = {k: v for k, v in weights.items() if k.startswith("net.0.")}
    partial["head.extra"] = torch.zeros(2, dtype=torch.float64)
    save_file(partial, tmp_path / "partial.safetensors")
    trainer = _started(
        _raw(init_from={"path": str(tmp_path / "partial.safetensors"), "strict": False})
    )
    state = trainer.model.state_dict()
    assert torch.equal(state["net.0.weight"], weights["net.0.weight"])
    assert not torch.equal(
        state["net.2.weight"], weights["net.2.weight"]
    )  # kept its initial values
    with pytest.raises(
        CheckpointMismatch,
        match="the weights lack: net.2.weight, net.2.bias .*the model lacks: head.extra",
    ):
        _started(_raw(init_from=str(tmp_path / "partial.safetensors")))


def test_a_path_that_is_no_run_or_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _started(_raw(init_from=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match="not a run directory"):
        _started(_raw(init_from=str(tmp_path)))
    unsaved = tmp_path / "unsaved"
    unsaved.mkdir()
    (unsaved / "config.yaml").write_text("name: unsaved\n")
    with pytest.raises(ConfigError, match=f"the run {unsaved} has saved no checkpoint yet"):
        _started(_raw(init_from=str(unsaved)))


@pytest.mark.parametrize("which", ["newest", "-1", -1, "3.5"])
def test_a_checkpoint_that_is_not_best_latest_auto_or_a_step_is_refused_with_the_config(which):
    raw = _raw(init_from={"path": "anywhere", "checkpoint": which})
    with pytest.raises(ConfigError) as info:
        config.validate(raw)
    assert "model.init_from.checkpoint" in str(info.value)
    assert "a checkpoint is best, latest, auto or a step number (0 or more)" in str(info.value)
    assert "--checkpoint" not in str(info.value)  # no flag of the command line is involved


@pytest.mark.parametrize("which", ["best", "latest", "auto", "7", 7, 0])
def test_the_checkpoints_init_from_takes(which):
    assert config.validate(_raw(init_from={"path": "x", "checkpoint": which}))
