"""The model protocol: which batch keys reach forward, plain modules through
`inputs`/`outputs`/`loss`, and the per-sample loss sum each shard contributes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import toy
from torch import nn

from phalanx import batching
from phalanx.config import ModelConfig
from phalanx.errors import ConfigError, ModelError
from phalanx.model import Forward, build_model, check_loss, per_sample_loss, shard_loss_mean

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
    assert (
        spy.seen["weight"] is None
    )  # an optional argument missing from the batch keeps its default
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


def test_model_inputs_naming_an_argument_forward_does_not_take_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.inputs gives Spy.forward 'nope'.*takes x, y"):
        Forward(Spy(), _cfg(inputs={"x": "x", "y": "nope"}))
    Forward(Spy(), _cfg(inputs={"x": "x", "y": "y"}))  # the arguments it takes


def test_a_loss_that_is_not_a_tensor_is_named(tmp_path):
    from phalanx import config
    from phalanx.trainer import Trainer

    raw = toy.regression_config(model={"class": "toy.TextLoss", "features": 3})
    trainer = Trainer(config.validate(raw), tmp_path, [str(Path(toy.__file__).parent)])
    with pytest.raises(ModelError, match="the model's 'loss' is a str, not a tensor"):
        trainer.run()


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
    batch = batching.collate([stream[i] for i in range(5)])
    outputs = forward(batch)
    assert set(outputs) == {"prediction", "loss"}
    assert forward.output_names == ["prediction", "loss"]
    assert outputs["loss"].shape == (5,)


def test_inputs_mapping_for_a_plain_sequential():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    cfg = _cfg(
        inputs={"features": "input"},
        outputs="scores",
        loss={"function": "mse_loss", "output": "scores", "target": "goal"},
    )
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
    batch = batching.collate([stream[i] for i in range(7)])
    cfg = _cfg(
        inputs={"x": "input"},
        outputs="logits",
        loss={"function": function, "output": "logits", "target": "y"},
    )
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
    cfg = _cfg(
        inputs={"input": "input"},
        loss={"function": "cross_entropy", "output": "logits", "target": "y"},
    )
    with pytest.raises(ModelError, match="'logits' is not an output"):
        Forward(net, cfg)(batch)
    cfg = _cfg(inputs={"input": "input"}, loss={"function": "cross_entropy", "target": "label"})
    with pytest.raises(ModelError, match="'label' is not a batch key"):
        Forward(net, cfg)(batch)


@pytest.mark.parametrize(
    "loss, target, said",
    [
        # the plain path: one class index per sample
        (
            {"function": "cross_entropy", "target": "y", "label_smoothing": "abc"},
            torch.zeros(2, dtype=torch.long),
            "model.loss: cross_entropy(output 'output' of shape [2, 3], float32, target 'y' of "
            "shape [2], int64, label_smoothing='abc') failed: TypeError: ",
        ),
        # per_sample_loss: a keyword given as a list, of the wrong length
        (
            {"function": "cross_entropy", "target": "y", "weight": [1.0, 2.0]},
            torch.zeros(2, dtype=torch.long),
            "model.loss: cross_entropy(output 'output' of shape [2, 3], float32, target 'y' of "
            "shape [2], int64, weight=[1.0, 2.0]) failed: RuntimeError: weight tensor should be "
            "defined either for all 3 classes",
        ),
    ],
)
def test_a_loss_that_refuses_the_batch_is_bad_input_in_one_line(loss, target, said):
    cfg = _cfg(inputs={"input": "input"}, loss=loss)
    with pytest.raises(ModelError) as info:
        Forward(nn.Linear(4, 3), cfg)({"input": torch.zeros(2, 4), "y": target})
    assert str(info.value).startswith(said), str(info.value)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(
        "check model.loss's function, output, target and keywords against what the model "
        "returns and the batch holds"
    )


@pytest.mark.parametrize(
    "function, said",
    [
        (
            "torch.nn.MSELoss",
            "model.loss.function: torch.nn.MSELoss is a class, not a loss function",
        ),
        ("math.pi", "model.loss.function: math.pi is a float, not a function"),
    ],
)
def test_a_loss_function_that_is_not_a_function_is_refused_before_any_batch(function, said):
    cfg = _cfg(inputs={"input": "input"}, loss={"function": function, "target": "y"})
    with pytest.raises(ConfigError) as info:
        Forward(nn.Linear(4, 3), cfg)
    assert str(info.value).startswith(said)


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
        Forward(Two(), _cfg(outputs="a", loss={"function": "l1_loss", "target": "x"}))(
            {"x": torch.ones(3)}
        )


def test_outputs_named_for_a_model_that_returns_a_dict_must_be_among_its_names():
    forward = Forward(Spy(), _cfg(outputs=["prediction", "logits"]))
    with pytest.raises(ModelError) as info:
        forward(_batch())
    said = str(info.value)
    assert "model.outputs names 'logits', which the model does not return" in said
    assert "a dict of prediction, loss" in said
    # the names it returns, or the default name (which a resolved config repeats): no error
    for cfg in (_cfg(outputs=["prediction", "loss"]), _cfg(outputs="output"), _cfg()):
        assert set(Forward(Spy(), cfg)(_batch())) == {"prediction", "loss"}


def test_a_loss_keyword_the_function_does_not_take_is_refused_when_the_model_is_built():
    def loss(**extra):
        return _cfg(
            outputs="p", loss={"function": "mse_loss", "output": "p", "target": "y", **extra}
        )

    with pytest.raises(ConfigError) as info:
        Forward(nn.Linear(3, 1), loss(label_smoothing=0.1))
    said = str(info.value)
    assert said.startswith("model.loss: mse_loss takes no argument 'label_smoothing'; it takes")
    assert "size_average, reduce" in said and said.endswith("beside the output and the target")
    with pytest.raises(ConfigError, match="drop model.loss.reduction"):
        Forward(nn.Linear(3, 1), loss(reduction="sum"))
    with pytest.raises(ConfigError, match='did you mean "label_smoothing"'):
        Forward(
            nn.Linear(3, 2),
            _cfg(loss={"function": "cross_entropy", "target": "y", "label_smothing": 0.1}),
        )


def _classes(n: int = 6) -> dict:
    return {"x": torch.randn(n, 3), "y": torch.arange(n) % 2}


@pytest.mark.parametrize(
    ("loss", "net", "batch", "plain"),
    [
        ({"function": "cross_entropy"}, nn.Linear(3, 2), _classes, True),
        (
            {"function": "mse_loss"},
            nn.Linear(3, 2),
            lambda: {"x": torch.randn(6, 3), "y": torch.randn(6, 2)},
            True,
        ),
        (
            {"function": "mse_loss"},
            nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)),
            lambda: {"x": torch.randn(6, 3), "y": torch.randn(6)},
            True,
        ),
        ({"function": "cross_entropy", "label_smoothing": 0.1}, nn.Linear(3, 2), _classes, True),
        ({"function": "cross_entropy", "weight": [1.0, 3.0]}, nn.Linear(3, 2), _classes, False),
        (
            {"function": "cross_entropy"},
            nn.Linear(3, 4),
            lambda: {"x": torch.randn(5, 6, 3), "y": torch.randint(4, (5, 6))},
            False,
        ),
        (
            {"function": "mse_loss"},
            nn.Linear(3, 2),
            lambda: {"x": torch.randn(6, 3), "y": torch.randn(2)},
            False,
        ),
    ],
    ids=[
        "class-index",
        "element-wise",
        "one-value",
        "keywords",
        "list-keyword",
        "tokens",
        "broadcast",
    ],
)
def test_the_plain_loss_path_gives_what_the_general_one_gives(monkeypatch, loss, net, batch, plain):
    """A named loss of one tensor output, with plain shapes, is computed without the general path
    (`per_sample_loss`): the outputs, their names and the gradients are the general path's to the
    bit; any other case takes the general path."""
    from phalanx import model

    general = []
    monkeypatch.setattr(
        model, "per_sample_loss", lambda *a: general.append(1) or per_sample_loss(*a)
    )
    torch.manual_seed(0)
    batch = batch()
    cfg = _cfg(inputs={"x": "input"}, outputs="out", loss={**loss, "output": "out", "target": "y"})
    results = []
    for take_plain in (True, False):
        forward = Forward(net, cfg)
        forward._plain = forward._plain if take_plain else None
        general.clear()
        net.zero_grad()
        outputs = forward(batch)
        outputs.get(model.TOKENS, outputs["loss"]).sum().backward()
        results.append((outputs, forward.output_names, [p.grad.clone() for p in net.parameters()]))
        assert bool(general) is not (plain and take_plain)
    (fast, fast_names, fast_grads), (slow, slow_names, slow_grads) = results
    assert list(fast) == list(slow) == fast_names == slow_names
    assert list(fast)[:2] == ["out", "loss"]
    assert all(torch.equal(fast[k], slow[k]) for k in fast)
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, slow_grads, strict=True))


def test_loss_shapes_per_sample_scalar_and_wrong():
    per_sample = torch.tensor([1.0, 2.0, 4.0])
    assert check_loss(per_sample, 3) is per_sample
    assert shard_loss_mean(per_sample, 3).item() == pytest.approx(7 / 3)
    assert shard_loss_mean(torch.tensor(2.5), 4).item() == 2.5
    assert torch.equal(
        check_loss(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), 2), torch.tensor([2.0, 2.0])
    )
    with pytest.raises(ModelError, match="one value per sample \\(4\\)"):
        check_loss(per_sample, 4)


def test_build_model_from_config_with_nested_modules():
    cfg = ModelConfig.model_validate(
        {
            "class": "torch.nn.Sequential",
            "args": [
                {"class": "torch.nn.Linear", "in_features": 3, "out_features": 2},
                {"class": "torch.nn.ReLU"},
            ],
        }
    )
    module = build_model(cfg, [])
    assert isinstance(module, nn.Sequential)
    assert (
        isinstance(module[0], nn.Linear)
        and module[0].in_features == 3
        and isinstance(module[1], nn.ReLU)
    )
    module = build_model(
        ModelConfig.model_validate({"class": "toy.Linear", "features": 5, "hidden": 4}), []
    )
    assert module.net[0].in_features == 5


def test_build_model_rejects_a_non_module():
    with pytest.raises(ModelError, match="not a torch.nn.Module"):
        build_model(ModelConfig.model_validate({"class": "collections.OrderedDict"}), [])


# --- losses over tokens -------------------------------------------------------------------------


def _sequences(n: int = 5, length: int = 6, vocab: int = 4):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, length, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(vocab, (n, length), generator=g)
    labels[:, 4:] = -100
    labels[1] = -100  # a sequence without a real token
    return logits, labels


@pytest.mark.parametrize("extra", [{}, {"label_smoothing": 0.1}, {"ignore_index": 2}])
def test_a_class_index_loss_on_sequences_weighs_every_real_token_once(extra):
    """Each sample's loss is its mean over its real tokens, its weight their count; other keys of
    model.loss reach the function. sum(w_i l_i) / sum(w_i) is torch's mean over the real tokens."""
    logits, labels = _sequences()
    if "ignore_index" in extra:  # the padding marked with the ignored class instead
        labels[labels == -100] = extra["ignore_index"]
    cfg = _cfg(
        outputs="logits",
        loss={"function": "cross_entropy", "output": "logits", "target": "labels", **extra},
    )
    outputs = Forward(nn.Identity(), cfg)({"input": logits, "labels": labels})
    ignored = extra.get("ignore_index", -100)
    real = labels != ignored
    assert outputs["loss_weight"].tolist() == real.sum(dim=1).tolist()
    kwargs = {k: v for k, v in extra.items()}
    want = F.cross_entropy(
        logits.transpose(1, 2), labels, reduction="none", **{"ignore_index": -100, **kwargs}
    )
    for i in range(len(labels)):
        expected = (
            want[i][real[i]].mean() if real[i].any() else torch.tensor(0.0, dtype=torch.float64)
        )
        assert torch.allclose(outputs["loss"][i], expected), i
    objective = (outputs["loss"] * outputs["loss_weight"]).sum() / outputs["loss_weight"].sum()
    assert torch.allclose(
        objective,
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **{"ignore_index": -100, **kwargs}),
    )
    # the token losses that go back: their sum is the objective's numerator
    assert torch.allclose(
        outputs["_token_losses"].sum(), (outputs["loss"] * outputs["loss_weight"]).sum()
    )


def test_a_list_keyword_of_the_loss_becomes_a_tensor():
    cfg = _cfg(
        outputs="logits",
        loss={
            "function": "binary_cross_entropy_with_logits",
            "output": "logits",
            "target": "y",
            "pos_weight": [1.0, 3.0],
        },
    )
    logits, y = torch.randn(4, 2), torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    outputs = Forward(nn.Identity(), cfg)({"input": logits, "y": y})
    want = F.binary_cross_entropy_with_logits(
        logits, y, pos_weight=torch.tensor([1.0, 3.0]), reduction="none"
    )
    assert torch.allclose(outputs["loss"], want.mean(dim=1)) and "loss_weight" not in outputs


def test_a_hugging_face_model_gets_its_per_token_loss_per_sample():
    """GPT-2 built from its config class (random weights): labels are not passed to it, and each row
    has its own loss, shifted one token, weighted by its real tokens (not the batch mean on every
    row)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1,
            n_head=2,
            n_embd=8,
            vocab_size=20,
            n_positions=8,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).eval()
    ids = torch.randint(20, (3, 8))
    labels = ids.clone()
    labels[0, 5:] = -100
    outputs = Forward(model, _cfg(), inner=model)({"input_ids": ids, "labels": labels})
    assert outputs["loss_weight"].tolist() == [4, 7, 7]  # shifted: positions 1..7 are predicted
    assert "past_key_values" not in outputs  # no attention cache kept for the hooks
    assert len(set(outputs["loss"].tolist())) == 3
    own = model(
        input_ids=ids, labels=labels
    ).loss  # the model's own: the mean over the batch's tokens
    mean = (outputs["loss"] * outputs["loss_weight"]).sum() / outputs["loss_weight"].sum()
    assert torch.allclose(mean, own, rtol=1e-5)


def test_a_loss_whose_output_and_target_broadcast_to_another_shape_is_an_error():
    """(B, 1) against (B,) would train on a (B, B) loss with only a torch warning."""
    cfg = _cfg(
        inputs={"x": "input"},
        outputs="prediction",
        loss={"function": "mse_loss", "output": "prediction", "target": "y"},
    )
    with pytest.raises(
        ModelError,
        match=r"shape \[6, 1\] with a target of shape \[6\], which broadcast to \[6, 6\]",
    ):
        Forward(nn.Linear(3, 1), cfg)({"x": torch.zeros(6, 3), "y": torch.zeros(6)})
    outputs = Forward(nn.Linear(3, 1), cfg)(
        {"x": torch.zeros(6, 3), "y": torch.zeros(6, 1)}
    )  # the same shapes
    assert outputs["loss"].shape == (6,)
    squeezed = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0))
    assert Forward(squeezed, cfg)({"x": torch.zeros(6, 3), "y": torch.zeros(6)})["loss"].shape == (
        6,
    )
