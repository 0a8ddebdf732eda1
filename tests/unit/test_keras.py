"""Keras 3 models under phalanx: names that every build shares, a Keras loss per sample, and the
errors that say what to do."""

from __future__ import annotations

import copy
import errno
import os
import subprocess
import sys

import pytest
import torch
import toy

from phalanx import (
    config,
    keras_models,  # noqa: E402
)
from phalanx.errors import ModelError, StorageError
from phalanx.model import build_model, per_sample_loss

keras = keras_models.import_keras()

pytestmark = pytest.mark.timeout(120)


def test_a_second_build_has_the_same_names_and_loads_the_firsts_weights():
    first = keras_models.KerasModule(toy.keras_net())
    second = keras_models.KerasModule(toy.keras_net())  # Keras names it dense_2, conv2d_1 ...
    assert [v.path for v in first.keras_model.weights] != [
        v.path for v in second.keras_model.weights
    ]
    assert list(first.state_dict()) == list(second.state_dict())
    x = torch.randn(5, 16, dtype=torch.float64)
    first.eval(), second.eval()
    assert not torch.equal(first(x), second(x))
    second.load_state_dict(first.state_dict())
    assert torch.equal(first(x), second(x))  # the weights Keras reads are the module's


def test_a_keras_model_named_in_the_config_is_built_as_a_module():
    cfg = config.validate(toy.regression_config(model={"class": "toy.keras_net", "features": 9}))
    module = build_model(cfg.model, [])
    assert isinstance(module, keras_models.KerasModule)
    assert module(torch.randn(2, 9, dtype=torch.float64)).shape == (2, 3)


def test_a_keras_loss_gives_torchs_loss_per_sample():
    loss = keras_models.per_sample(
        keras.losses.SparseCategoricalCrossentropy, {"from_logits": True}
    )
    logits, target = torch.randn(6, 4, dtype=torch.float64), torch.randint(4, (6,))
    want = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    assert torch.allclose(loss(logits, target), want, rtol=1e-12)


def test_an_unbuilt_keras_model_names_the_fix():
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ModelError, match=r"not built.*keras.Input\(shape=...\)"):
        keras_models.KerasModule(unbuilt)


def test_another_keras_backend_is_one_error():
    code = "from phalanx import keras_models; keras_models.import_keras()"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode != 0
    assert "KERAS_BACKEND=jax, but phalanx trains Keras models on its torch backend" in (
        result.stderr
    )


def test_fp64_asks_for_a_keras_model_that_computes_in_float64():
    from phalanx.precision import Precision

    with pytest.raises(
        ModelError, match=r"precision=fp64, but the Keras model computes in float32"
    ):
        Precision("fp64", torch.device("cpu")).convert_module(
            keras_models.KerasModule(toy.keras_net(dtype="float32"))
        )


def test_a_keras_path_without_keras_installed_says_what_to_install(tmp_path):
    """In a process where `import keras` fails as it does where Keras is not installed."""
    code = (
        "import sys; sys.modules['keras'] = None\n"
        "from phalanx.construct import import_object\n"
        "import_object('keras.losses.SparseCategoricalCrossentropy')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert result.returncode != 0
    assert "needs Keras, which is not installed: pip install -e" in result.stderr


def test_a_keras_loss_on_a_single_output_against_a_target_per_sample_is_one_value_each():
    """The usual regression head: a (B, 1) output against (B,) targets, which Keras's
    MeanSquaredError matches itself (not every output against every target)."""
    loss = keras_models.per_sample(keras.losses.MeanSquaredError, {})
    output, target = torch.randn(6, 1, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    got = per_sample_loss(loss, output, target, None, {}).per_sample
    assert got.shape == (6,)
    # Keras's mean computes in float32 on its torch backend, whatever the dtype
    assert torch.allclose(got, (output.squeeze(-1) - target) ** 2, rtol=1e-6)


def test_shapes_a_keras_loss_does_not_match_are_an_error_naming_the_loss():
    """(B, 1, 1) against (B,): Keras matches ranks that differ by one only, so the two would
    broadcast to (B, 1, B)."""
    loss = keras_models.per_sample(keras.losses.MeanSquaredError, {})
    output, target = torch.randn(6, 1, 1, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    with pytest.raises(ModelError, match=r"model.loss: MeanSquaredError compares .* \[6, 1, 1\]"):
        per_sample_loss(loss, output, target, None, {})


def _with_a_lambda() -> keras_models.KerasModule:
    """Its lambda reads this module's global `keras`, as a lambda in a user's module does."""
    return keras_models.KerasModule(
        keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, dtype="float64"),
                keras.layers.Lambda(lambda t: keras.ops.tanh(t) * 2),
            ]
        )
    )


def test_a_copy_of_a_keras_model_with_a_lambda_computes_as_the_original_on_its_own_weights():
    """A tower's replica is a deep copy."""
    original = _with_a_lambda().eval()
    twin = copy.deepcopy(original)
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(twin(x), original(x))
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    assert not torch.equal(twin(x), original(x))
    assert {p.data_ptr() for p in twin.parameters()}.isdisjoint(
        p.data_ptr() for p in original.parameters()
    )


class _FillsTheDisk(keras.layers.Layer):
    """Saved part-way through Keras's writing of a file: the write fails as on a full disk."""

    def save_own_variables(self, store):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"])
def test_a_keras_file_on_a_full_disk_is_one_error_and_leaves_the_old_file(tmp_path, name):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), _FillsTheDisk()])
    (tmp_path / name).write_text("the earlier export")
    with pytest.raises(StorageError) as info:
        keras_models.save(model, tmp_path / name)
    message = str(info.value)
    assert str(tmp_path / name) in message and "the disk is full" in message
    assert "\n" not in message
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no half-written file
    assert (tmp_path / name).read_text() == "the earlier export"


def test_a_keras_file_where_the_system_refuses_it_is_one_error_and_leaves_nothing(tmp_path):
    """Under a regular file, where root cannot write either."""
    (tmp_path / "a-file").write_text("")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(StorageError, match=r"cannot write .*a-file/m.keras: Not a directory"):
        keras_models.save(model, tmp_path / "a-file" / "m.keras")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]
