"""The model protocol: which batch keys reach forward, plain modules through `inputs`/`outputs`/`loss`,
and the per-sample loss sum each shard contributes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import toy
from phalanx import data
from phalanx.config import ModelConfig
from phalanx.errors import ConfigError, ModelError
from phalanx.model import Forward, build_model, check_loss, shard_loss_mean

pytestmark = pytest.mark.timeout(60)


def _cfg(**fields) -> ModelConfig:
    return ModelConfig.model_validate({"class": "unused.Module", **fields})


class Spy(nn.Module):
    """Records the keyword arguments forward receives."""

    def __init__(self):
        super().__init__()
        self.seen: dict | None = None
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, y, weight=None):
        self.seen = {"x": x, "y": y, "weight": weight}
        return {"prediction": self.scale * x, "loss": (self.scale * x - y) ** 2}


def _batch(n=4):
    return {"x": torch.arange(n, dtype=torch.float32), "y": torch.ones(n), "id": torch.arange(n)}


def test_forward_passes_the_keys_forward_names_and_no_others():
    spy = Spy()
    batch = _batch()
    outputs = Forward(spy, _cfg())(batch)
    assert set(spy.seen) == {"x", "y", "weight"}
    assert spy.seen["x"] is batch["x"] and spy.seen["y"] is batch["y"]
    assert spy.seen["weight"] is None  # an optional argument missing from the batch keeps its default
    assert torch.equal(outputs["loss"], (2 * batch["x"] - 1) ** 2)
    batch["weight"] = torch.full((4,), 3.0)
    Forward(spy, _cfg())(batch)
    assert spy.seen["weight"] is batch["weight"]


def test_forward_with_var_keyword_gets_the_whole_batch():
    class TakesAll(nn.Module):
        def forward(self, **batch):
            self.keys = sorted(batch)
            return {"loss": batch["x"] * 0}

    module = TakesAll()
    Forward(module, _cfg())(_batch())
    assert module.keys == ["id", "x", "y"]


def test_forward_missing_key_names_it():
    batch = _batch()
    del batch["y"]
    with pytest.raises(ModelError) as info:
        Forward(Spy(), _cfg())(batch)
    message = str(info.value)
    assert "['y']" in message and "Spy" in message and "model.inputs" in message


def test_forward_returns_outputs_and_records_their_names():
    forward = Forward(toy.Linear(3), _cfg())
    stream = toy.Regression().streams()["train"]
    batch = data.collate([stream[i] for i in range(5)])
    outputs = forward(batch)
    assert set(outputs) == {"prediction", "loss"}
    assert forward.output_names == ["prediction", "loss"]
    assert outputs["loss"].shape == (5,)


def test_inputs_mapping_for_a_plain_sequential():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    cfg = _cfg(inputs={"features": "input"}, outputs="scores",
               loss={"function": "mse_loss", "output": "scores", "target": "goal"})
    batch = {"features": torch.randn(6, 3), "goal": torch.randn(6, 2), "other": torch.zeros(6)}
    outputs = Forward(net, cfg)(batch)
    expected = net(batch["features"])
    assert torch.equal(outputs["scores"], expected)
    # a loss over several values per sample is averaged to one value per sample
    assert outputs["loss"].shape == (6,)
    assert torch.allclose(outputs["loss"], ((expected - batch["goal"]) ** 2).mean(dim=1))


def test_inputs_mapping_names_missing_batch_keys():
    cfg = _cfg(inputs={"image": "input"}, loss={"function": "mse_loss", "target": "y"})
    with pytest.raises(ModelError) as info:
        Forward(nn.Linear(3, 1), cfg)({"x": torch.zeros(2, 3), "y": torch.zeros(2, 1)})
    assert "['image']" in str(info.value)


@pytest.mark.parametrize("function", ["cross_entropy", "torch.nn.functional.cross_entropy"])
def test_loss_spec_with_cross_entropy_gives_per_sample_loss(function):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    stream = toy.Classes().streams()["train"]
    batch = data.collate([stream[i] for i in range(7)])
    cfg = _cfg(inputs={"x": "input"}, outputs="logits", loss={"function": function, "output": "logits", "target": "y"})
    outputs = Forward(net, cfg)(batch)
    logits = net(batch["x"])
    expected = torch.stack([-torch.log_softmax(logits[i], dim=0)[batch["y"][i]] for i in range(7)])
    assert outputs["loss"].shape == (7,)
    assert torch.allclose(outputs["loss"], expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(outputs["loss"].mean(), F.cross_entropy(logits, batch["y"]))


def test_loss_spec_unknown_function():
    with pytest.raises(ConfigError) as info:
        Forward(nn.Linear(4, 3), _cfg(loss={"function": "cross_entropyy", "target": "y"}))
    assert 'did you mean "cross_entropy"' in str(info.value)


def test_loss_spec_bad_output_or_target():
    net = nn.Linear(4, 3)
    batch = {"input": torch.zeros(2, 4), "y": torch.zeros(2, dtype=torch.long)}
    cfg = _cfg(inputs={"input": "input"}, loss={"function": "cross_entropy", "output": "logits", "target": "y"})
    with pytest.raises(ModelError, match="'logits' is not an output"):
        Forward(net, cfg)(batch)
    cfg = _cfg(inputs={"input": "input"}, loss={"function": "cross_entropy", "target": "label"})
    with pytest.raises(ModelError, match="'label' is not a batch key"):
        Forward(net, cfg)(batch)


def test_model_returning_no_loss_is_an_error():
    class NoLoss(nn.Module):
        def forward(self, x):
            return {"prediction": x}

    with pytest.raises(ModelError) as info:
        Forward(NoLoss(), _cfg())({"x": torch.zeros(2)})
    assert "no 'loss'" in str(info.value) and "model.loss" in str(info.value)
    with pytest.raises(ModelError, match="no 'loss'"):
        Forward(nn.Linear(3, 1), _cfg(inputs={"x": "input"}))({"x": torch.zeros(2, 3)})


def test_tuple_outputs_must_match_the_names():
    class Two(nn.Module):
        def forward(self, x):
            return x, x * 2

    cfg = _cfg(outputs=["a", "b"], loss={"function": "l1_loss", "output": "b", "target": "x"})
    outputs = Forward(Two(), cfg)({"x": torch.ones(3)})
    assert torch.equal(outputs["b"], torch.full((3,), 2.0))
    assert torch.equal(outputs["loss"], torch.ones(3))
    with pytest.raises(ModelError, match="returned 2 values"):
        Forward(Two(), _cfg(outputs="a", loss={"function": "l1_loss", "target": "x"}))({"x": torch.ones(3)})


def test_loss_shapes_per_sample_scalar_and_wrong():
    per_sample = torch.tensor([1.0, 2.0, 4.0])
    assert check_loss(per_sample, 3) is per_sample
    assert shard_loss_mean(per_sample, 3).item() == pytest.approx(7 / 3)
    assert shard_loss_mean(torch.tensor(2.5), 4).item() == 2.5
    assert torch.equal(check_loss(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), 2), torch.tensor([2.0, 2.0]))
    with pytest.raises(ModelError, match="one value per sample \\(4\\)"):
        check_loss(per_sample, 4)


def test_build_model_from_config_with_nested_modules():
    cfg = ModelConfig.model_validate({"class": "torch.nn.Sequential", "args": [
        {"class": "torch.nn.Linear", "in_features": 3, "out_features": 2}, {"class": "torch.nn.ReLU"}]})
    module = build_model(cfg, [])
    assert isinstance(module, nn.Sequential)
    assert isinstance(module[0], nn.Linear) and module[0].in_features == 3 and isinstance(module[1], nn.ReLU)
    module = build_model(ModelConfig.model_validate({"class": "toy.Linear", "features": 5, "hidden": 4}), [])
    assert module.net[0].in_features == 5


def test_build_model_rejects_a_non_module():
    with pytest.raises(ModelError, match="not a torch.nn.Module"):
        build_model(ModelConfig.model_validate({"class": "collections.OrderedDict"}), [])
