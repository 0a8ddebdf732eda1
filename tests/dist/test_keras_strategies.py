"""A Keras 3 model (torch backend, float64) trained by phalanx on 1, 2 and 3 CPU processes, under
towers and on a parameter server: one run, to 1e-10. Keras's Dense layers compute in float32 whatever their dtype on
the torch backend (see toy.keras_net): with them, the runs agree to float32's precision."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402
import torch  # noqa: E402
from test_invariance import N_VALID, assert_same_run, rel  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def keras_run(dense: bool = False, lambda_layer: bool = False, **parallel) -> dict:
    return toy.regression_config(
        model={
            "class": "toy.keras_net",
            "features": 16,
            "classes": 3,
            "dense": dense,
            "lambda_layer": lambda_layer,
            "inputs": {"x": "x"},
            "outputs": "logits",
            "loss": {
                "function": "keras.losses.SparseCategoricalCrossentropy",
                "output": "logits",
                "target": "y",
                "from_logits": True,
            },
        },
        optimizer={"class": "AdamW", "lr": 0.01, "warmup_steps": 3},
        dataset={
            "class": "toy.Classes",
            "batch_size": 10,
            "n_train": 41,
            "n_valid": N_VALID,
            "features": 16,
        },
        parallel={"accelerator": "cpu", "devices": 1, **parallel},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )


@pytest.fixture(scope="module")
def alone() -> dict:
    return workers.train(keras_run())


@pytest.mark.parametrize("processes", [2, 3])
def test_a_keras_model_trains_on_several_processes_as_on_one(processes, alone):
    for [got] in workers.run_ranks(processes, workers.train_all, [keras_run()])[:1]:
        assert_same_run(got, alone)
        assert got["ids"] == alone["ids"]  # the same samples, in the same order


def test_a_keras_model_trains_under_towers_as_on_one_device(alone):
    assert_same_run(workers.train(keras_run(strategy="towers", devices=2)), alone)


def test_a_keras_model_with_a_lambda_layer_trains_under_towers_as_on_one_device():
    """Each tower's replica is a copy of the model whose lambda still reads the names it did."""
    alone = workers.train(keras_run(lambda_layer=True))
    assert_same_run(
        workers.train(keras_run(lambda_layer=True, strategy="towers", devices=2)), alone
    )


def test_a_keras_model_trains_on_a_parameter_server_as_on_one_process(alone):
    raw = keras_run(strategy="param_server")
    raw["parallel"]["param_server"] = {"servers": 1, "staleness": 0}
    assert_same_run(workers.run_ranks(3, workers.train_all, [raw])[0][0], alone)


def test_the_weights_have_the_names_of_the_models_structure(alone):
    assert sorted(alone["params"]) == [
        "layers.conv2d_2.bias",
        "layers.conv2d_2.kernel",
        "layers.conv2d_4.bias",
        "layers.conv2d_4.kernel",
    ]


def test_with_dense_layers_two_processes_agree_to_float32s_precision():
    want = workers.train(keras_run(dense=True))
    [[got], _] = workers.run_ranks(2, workers.train_all, [keras_run(dense=True)])
    for name, value in want["params"].items():
        assert rel(torch.tensor(got["params"][name]), torch.tensor(value)) < 1e-5, name
    assert got["ids"] == want["ids"]


@pytest.mark.parametrize(
    ("parallel", "why"),
    [
        ({"strategy": "fsdp"}, "it swaps the module's parameters for shards"),
        ({"strategy": "placement", "placement": {"layers": "cpu"}}, "not torch submodules"),
    ],
    ids=["fsdp", "placement"],
)
def test_a_strategy_that_cannot_train_a_keras_model_says_so(parallel, why, tmp_path):
    """In the user's process, through `phalanx.fit`: fsdp on one device made a group of this
    process alone, which the failed run takes down (the conftest's check)."""
    import phalanx
    from phalanx.errors import ModelError

    with pytest.raises(ModelError, match=f"cannot train a Keras model: .*{why}"):
        phalanx.fit({**keras_run(**parallel), "output_root": str(tmp_path)})


def refusal(rank: int, raw: dict) -> str:
    """Train `raw` and expect a ModelError; its message."""
    from phalanx.errors import ModelError

    try:
        workers.train(raw)
    except ModelError as e:
        return str(e)
    raise AssertionError("the run trained")


@pytest.mark.parametrize(
    "parallel",
    [
        {"mesh": {"shard": 2}},
        {"mesh": {"pipeline": 2}, "pipeline": {"split": ["layers.conv2d_4"], "microbatches": 2}},
    ],
    ids=["shard", "pipeline"],
)
def test_a_mesh_refuses_a_keras_model_in_its_own_name(parallel):
    """Whichever strategy runs the mesh's shape (fsdp's sharding, or the pipeline's stages), the
    error names the strategy the config names, on every process."""
    raw = keras_run(strategy="mesh", **parallel)
    raw["parallel"]["devices"] = 2
    for said in workers.run_ranks(2, refusal, raw, timeout=120):
        assert said.startswith("parallel.strategy=mesh cannot train a Keras model: "), said


def test_a_keras_run_stopped_mid_epoch_resumes_to_the_uninterrupted_end(tmp_path):
    """Stopped after 3 of 10 steps and resumed in a new build of the model (Keras names its
    weights apart from an earlier build's), the checkpoint loads by structure and the end is the
    whole run's."""
    from safetensors.torch import load_file

    from phalanx import commands
    from phalanx.checkpoint import WEIGHTS, Checkpoints

    def latest(run: Path) -> dict:
        checkpoints = Checkpoints(run / "checkpoints")
        return load_file(str(checkpoints.path(checkpoints.latest_valid()) / WEIGHTS))

    raw = {**keras_run(), "hooks": ["SaveLatest"]}
    assert commands.train(str(toy.write_config(tmp_path / "whole", raw)), []) == 0
    [whole] = (tmp_path / "whole" / "runs").iterdir()
    stopped = {**raw, "hooks": ["SaveLatest", {"StopAfter": {"steps": 3}}]}
    assert commands.train(str(toy.write_config(tmp_path / "parts", stopped)), []) == 0
    [parts] = (tmp_path / "parts" / "runs").iterdir()
    assert commands.resume(str(parts), ["hooks.1.StopAfter.steps=1000"]) == 0
    want, got = latest(whole), latest(parts)
    assert sorted(got) == sorted(want)
    for name in want:
        assert rel(got[name], want[name]) < 1e-10, name


# the run's model code: it says when it is imported and when it builds the model
COUNTED_NET = """
from pathlib import Path

import toy

Path(__file__).with_name("imported").open("a").write("once")


def build(**kwargs):
    Path(__file__).with_name("built").open("a").write("once")
    return toy.keras_net(**kwargs)
"""


def test_export_writes_files_that_keras_loads_running_none_of_the_runs_code(tmp_path):
    """A run's checkpoint as a .keras model and as .weights.h5, which Keras loads: both give the
    outputs of the model that phalanx.load gives. The model is rebuilt from the description the
    run saved: its module is neither imported nor called again."""
    import phalanx
    from phalanx import commands, keras_models

    keras = keras_models.import_keras()
    raw = {**keras_run(), "hooks": ["SaveLatest"]}
    raw["model"]["class"] = "counted_net.build"
    folder = tmp_path / "run"
    toy.write_config(folder, raw)
    (folder / "counted_net.py").write_text(COUNTED_NET)
    assert commands.train(str(folder / "config.yaml"), []) == 0
    [run] = (folder / "runs").iterdir()
    sys.modules.pop("counted_net")  # as in a new process
    assert commands.export(str(run), str(tmp_path / "m.keras"), "latest") > 0
    assert commands.export(str(run), str(tmp_path / "m.weights.h5"), "latest") > 0
    assert (folder / "imported").read_text() == (folder / "built").read_text() == "once"
    x = torch.randn(4, 16, dtype=torch.float64)
    want = phalanx.load(run)(x)
    whole = keras.models.load_model(tmp_path / "m.keras")
    assert torch.allclose(whole(x, training=False), want, rtol=1e-12, atol=0)
    rebuilt = toy.keras_net()
    rebuilt.load_weights(tmp_path / "m.weights.h5")
    assert torch.allclose(rebuilt(x, training=False), want, rtol=1e-12, atol=0)


def test_a_keras_model_that_keras_rebuilds_only_by_running_code_is_exported_with_model(
    tmp_path, capsys
):
    """A Lambda's function is code: without --model, one error that names the fix; with it, the
    file. A name the system refuses is one error line too."""
    import phalanx
    from phalanx import cli

    raw = {**keras_run(lambda_layer=True), "hooks": ["SaveLatest"]}
    assert cli.main(["train", str(toy.write_config(tmp_path / "run", raw))]) == 0
    [run] = (tmp_path / "run" / "runs").iterdir()
    output = tmp_path / "m.keras"
    capsys.readouterr()
    assert cli.main(["export", str(run), "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Lambda" in error and "--model toy.keras_net" in error
    assert not output.exists()
    long = tmp_path / ("x" * 300 + ".keras")
    assert cli.main(["export", str(run), "--output", str(long)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "File name too long" in error
    assert cli.main(["export", str(run), "--output", str(output), "--model", "toy.keras_net"]) == 0
    # (Keras's own load of the whole file rebuilds the lambda without the names it reads)
    rebuilt = toy.keras_net(lambda_layer=True)
    rebuilt.load_weights(output)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert torch.allclose(rebuilt(x, training=False), phalanx.load(run)(x), rtol=1e-12, atol=0)
