"""`mesh` on real gloo processes: tensor parallelism (2) alone, and composed with FSDP (shard 2 x
tensor 2, replicate 2 x tensor 2), trains as one process does (float64, to 1e-10) with clipping,
accumulation and a short last batch; a bad tensor plan is one error; a run saved under mesh
resumes on one process and on another mesh."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import cli, config, rundir, worker  # noqa: E402
from phalanx.checkpoint import Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(600)
N_TRAIN, N_VALID = 37, 10  # batch 7: a last batch of 2 (shards of 1 and 0 at accumulation 2)
PLAN = {"net.0": "colwise", "net.2": "rowwise"}


def scenario(**parallel) -> dict:
    """toy.Linear (3 -> 4 -> 1), clipped at a norm it reaches, two micro-batches a step."""
    raw = toy.contract_config(7, 2, N_TRAIN, N_VALID, **parallel)
    raw["optimizer"] = {**raw["optimizer"], "max_grad_norm": 0.05}
    return raw


def mesh(**degrees) -> dict:
    processes = degrees.get("replicate", 1) * degrees.get("shard", 1) * degrees.get("tensor", 1)
    return {"devices": processes, "strategy": "mesh", "mesh": {**degrees, "tensor_plan": PLAN}}


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_same(got: dict, expected: dict, name: str) -> None:
    assert got["params"].keys() == expected["params"].keys(), name
    for key, value in expected["params"].items():  # the whole model, gathered to rank 0
        assert rel(got["params"][key], value) < 1e-10, (name, key)
    assert len(got["losses"]) == len(expected["losses"]) == 12, name
    assert rel(got["losses"], expected["losses"]) < 1e-10, name
    for mine, theirs in zip(got["epochs"], expected["epochs"], strict=True):
        # each validation sample counted once, though two processes computed it
        assert mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID, name
        assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
            theirs["valid"]["loss"]
        )
    assert got["ids"] == expected["ids"], name  # hooks see every batch once, in dataset order


def deep(**degrees) -> dict:
    """toy.Deep (3 -> 4 -> 4 -> 1) with only its first two Linears split: the last one's
    parameters stay whole on the tensor dimension, so the gradient norm spans two meshes."""
    raw = scenario(**mesh(**degrees)) if degrees else scenario()
    raw["model"] = {"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 2}
    return raw


def piped(**degrees) -> dict:
    """toy.Deep (3 -> 4 -> 4 -> 4 -> 4 -> 1) in two stages (split at net.4), each with a colwise /
    rowwise pair on the tensor dimension; the last Linear whole (a stage of split and whole
    parameters); one process's run where `degrees` is empty."""
    raw = scenario()
    raw["model"] = {"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 4}
    if degrees:
        plan = {**PLAN, "net.4": "colwise", "net.6": "rowwise"}
        processes = degrees.get("replicate", 1) * degrees["pipeline"] * degrees["tensor"]
        raw["parallel"] = {
            **raw["parallel"],
            "devices": processes,
            "strategy": "mesh",
            "mesh": {**degrees, "tensor_plan": plan},
            "pipeline": {"split": ["net.4"], "microbatches": 2, "schedule": "1f1b"},
        }
    return raw


def stopped_run(folder: Path, raw: dict, processes: int) -> Path:
    """A run of `raw` on `processes` processes in a new run folder, ended by its hooks."""
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    run = rundir.create(cfg, path)
    codes = workers.run_ranks(processes, workers.run_dir_worker, str(run), False, [], timeout=300)
    assert codes == [0] * processes
    return run


LAYOUTS = {  # name -> (processes, [(a mesh run's config, one process's)], in one launch)
    # replicate alone: ddp's layout, as ddp runs it
    "tensor2-and-replicate2": (
        2,
        [(scenario(**mesh(tensor=2)), scenario()), (scenario(**mesh(replicate=2)), scenario())],
    ),
    # the second with its Sequential's activations recomputed in backward, around the split layers
    "shard2-tensor2-and-replicate2-tensor2": (
        4,
        [
            (scenario(**mesh(shard=2, tensor=2)), scenario()),
            ({**deep(replicate=2, tensor=2), "activation_checkpointing": ["Sequential"]}, deep()),
        ],
    ),
    "pipeline2-tensor2": (4, [(piped(pipeline=2, tensor=2), piped())]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mesh_trains_as_one_process(layout):
    processes, pairs = LAYOUTS[layout]
    want = [workers.train(alone) for _, alone in pairs]
    ranks = workers.run_ranks(processes, workers.train_all, [r for r, _ in pairs], timeout=400)
    for i, (got, expected) in enumerate(zip(ranks[0], want, strict=True)):
        assert_same(got, expected, f"{layout}[{i}]")
    for results in ranks[1:]:  # every rank agrees on every step's loss
        for got, expected in zip(results, want, strict=True):
            assert rel(got["losses"], expected["losses"]) < 1e-10


def test_a_compiled_model_trains_under_mesh_as_one_process():
    """torch.compile over the tensor-parallel model (its DTensor operations traced, forward and
    backward, by aot_eager) and over the replicated one trains as the plain model on one process."""
    pairs = [
        ({**scenario(**mesh(tensor=2)), "compile": {"backend": "aot_eager"}}, scenario()),
        ({**scenario(**mesh(replicate=2)), "compile": {"backend": "eager"}}, scenario()),
    ]
    want = [workers.train(alone) for _, alone in pairs]
    ranks = workers.run_ranks(2, workers.train_all, [r for r, _ in pairs], timeout=400)
    for results in ranks:
        assert all(got["compiled"] for got in results)
    for i, (got, expected) in enumerate(zip(ranks[0], want, strict=True)):
        assert_same(got, expected, f"compiled [{i}]")
    for got, expected in zip(ranks[1], want, strict=True):
        assert rel(got["losses"], expected["losses"]) < 1e-10


GPT = {  # the GPT example's model, small: one block, 2 heads, an MLP 32 wide
    "class": "examples.gpt.model.GPT",
    **{"vocab_size": 16, "block_size": 6, "n_layer": 1, "n_head": 2, "n_embd": 8},
}
ATTENDING = {"class": "toy.Attending", "vocab": 16, "width": 8, "heads": 4}
# every style: attention projections (their heads counted per process), a sequence norm whose
# output the next colwise layer gathers, an embedding split by rows, an MLP
EVERY_STYLE = {
    "embed": "rowwise",
    **{f"attn.{p}_proj": "colwise" for p in "qkv"},
    "attn.o_proj": "rowwise",
    "ln_2": "sequence",
    "mlp.0": "colwise",
    "mlp.2": "rowwise",
}


def language_model(model: dict, plan: dict | str | None = None) -> dict:
    """A language model on random token windows (37 train, 10 valid) in the scenario's steps."""
    parallel = {} if plan is None else mesh(tensor=2)
    if plan is not None:
        parallel["mesh"]["tensor_plan"] = plan
    raw = scenario(**parallel)
    raw["model"] = model
    raw["dataset"] = {**raw["dataset"], "class": "toy.Tokens", "length": 6, "vocab": 16}
    return raw


def test_tensor_plans_auto_and_every_style_train_as_one_process():
    """auto on the GPT example's model (its MLPs: its attention's qkv is fused), a hand-written
    plan of every style on a model with separate attention projections, and the same model with
    per-sample dropout where each process holds a slice of the activations (the attention weights
    of its heads, the MLP's hidden features of its share) and where it holds them whole."""
    dropped = {**ATTENDING, "dropout": 0.3}
    plan = {**{k: v for k, v in EVERY_STYLE.items() if k != "mlp.2"}, "mlp.3": "rowwise"}
    runs = [(GPT, "auto"), (ATTENDING, EVERY_STYLE), (dropped, plan)]
    want = [workers.train(language_model(model)) for model, _ in runs]
    raws = [language_model(model, plan) for model, plan in runs]
    ranks = workers.run_ranks(2, workers.train_all, raws, timeout=400)
    for i, (got, expected) in enumerate(zip(ranks[0], want, strict=True)):
        assert_same(got, expected, f"language model {i}")
    for got, expected in zip(ranks[1], want, strict=True):
        assert rel(got["losses"], expected["losses"]) < 1e-10


def test_a_bad_tensor_plan_is_one_config_error_naming_the_module():
    """Before training, on every process; each kind of bad plan: tests/unit/test_mesh_checks.py."""
    plan = {"net.1": "colwise"}
    message = r"names 'net.1' \(colwise\), a Tanh; colwise splits nn.Linear and nn.Embedding"
    raw = scenario(devices=2, strategy="mesh", mesh={"tensor": 2, "tensor_plan": plan})
    with pytest.raises(AssertionError, match=message) as failure:
        workers.run_ranks(2, workers.train_all, [raw], timeout=120)
    last = str(failure.value).strip().splitlines()[-1]  # what the command line prints, alone
    assert last.startswith("phalanx.errors.ConfigError: parallel.mesh.tensor_plan")


def test_a_run_stopped_under_tensor_parallelism_resumes_on_one_process_and_another_mesh(tmp_path):
    raw = scenario(**mesh(tensor=2))
    raw["main_loop"] = {"epochs": 2, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]  # 6 steps an epoch: mid-epoch 2
    whole = workers.train({**scenario(), "main_loop": raw["main_loop"]})
    run = stopped_run(tmp_path / "mesh", raw, 2)
    assert Checkpoints(run / "checkpoints").steps() == [6, 8]
    more = ["hooks.1.StopAfter.steps=1000"]
    resumed = {  # name -> (processes, overrides)
        "single": (1, ["parallel.devices=1", "parallel.strategy=single"]),
        "mesh-shard2": (2, ["parallel.mesh.tensor=1", "parallel.mesh.shard=2"]),
    }
    for name, (processes, overrides) in resumed.items():
        copy = tmp_path / name
        shutil.copytree(run, copy)
        if processes == 1:
            assert worker.run_worker(copy, True, [*more, *overrides]) == 0
        else:
            args = (str(copy), True, [*more, *overrides])
            codes = workers.run_ranks(processes, workers.run_dir_worker, *args, timeout=300)
            assert codes == [0] * processes
        assert f"resuming {copy} from step 8 " in (copy / "log.txt").read_text(), name
        checkpoints = Checkpoints(copy / "checkpoints")
        assert checkpoints.latest_valid() == 12, name
        out = tmp_path / f"{name}.safetensors"  # the command a user runs, for any layout
        assert cli.main(["export", str(copy), "--checkpoint", "latest", "--output", str(out)]) == 0
        got = load_file(str(out))
        for key, value in whole["params"].items():
            assert rel(got[key].tolist(), value) < 1e-10, (name, key)


def test_a_run_stopped_under_pipeline_and_tensor_parallelism_resumes_on_fsdp(tmp_path):
    """Each process writes its stage's split layers into the sharded checkpoint; fsdp(2) reads
    them back and ends as the run without a stop, and the final model gathers whole."""
    raw = piped(pipeline=2, tensor=2)
    raw["main_loop"] = {"epochs": 2, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]  # 6 steps an epoch: mid-epoch 2
    whole = workers.train({**piped(), "main_loop": raw["main_loop"]})
    run = stopped_run(tmp_path / "piped", raw, 4)
    assert Checkpoints(run / "checkpoints").steps() == [6, 8]
    overrides = ["hooks.1.StopAfter.steps=1000", "parallel.strategy=fsdp", "parallel.devices=2"]
    codes = workers.run_ranks(2, workers.run_dir_worker, str(run), True, overrides, timeout=300)
    assert codes == [0, 0]
    assert f"resuming {run} from step 8 " in (run / "log.txt").read_text()
    assert Checkpoints(run / "checkpoints").latest_valid() == 12
    out = tmp_path / "resumed.safetensors"
    assert cli.main(["export", str(run), "--checkpoint", "latest", "--output", str(out)]) == 0
    got = load_file(str(out))
    for key, value in whole["params"].items():
        assert rel(got[key].tolist(), value) < 1e-10, key


def test_a_run_stopped_under_ddp_resumes_on_shard_and_tensor_and_on_pipeline_and_tensor(tmp_path):
    """The whole-model checkpoint of ddp(2), split as each mesh holds it (each process slices its
    part of every split layer and of its optimizer state)."""
    raw = piped()
    raw["parallel"] = {**raw["parallel"], "devices": 2, "strategy": "ddp"}
    raw["main_loop"] = {"epochs": 2, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]
    whole = workers.train({**piped(), "main_loop": raw["main_loop"]})
    run = stopped_run(tmp_path / "ddp", raw, 2)
    plan = "{net.0: colwise, net.2: rowwise, net.4: colwise, net.6: rowwise}"
    resumed = {
        "shard2-tensor2": ["parallel.mesh={shard: 2, tensor: 2, tensor_plan: %s}" % plan],
        "pipeline2-tensor2": [
            "parallel.mesh={pipeline: 2, tensor: 2, tensor_plan: %s}" % plan,
            "parallel.pipeline={split: [net.4], microbatches: 2, schedule: 1f1b}",
        ],
    }
    for name, overrides in resumed.items():
        copy = tmp_path / name
        shutil.copytree(run, copy)
        args = [
            "hooks.1.StopAfter.steps=1000",
            "parallel.strategy=mesh",
            "parallel.devices=4",
            *overrides,
        ]
        codes = workers.run_ranks(4, workers.run_dir_worker, str(copy), True, args, timeout=300)
        assert codes == [0] * 4, name
        assert f"resuming {copy} from step 8 " in (copy / "log.txt").read_text(), name
        out = tmp_path / f"{name}.safetensors"
        assert cli.main(["export", str(copy), "--checkpoint", "latest", "--output", str(out)]) == 0
        got = load_file(str(out))
        for key, value in whole["params"].items():
            assert rel(got[key].tolist(), value) < 1e-10, (name, key)


def test_the_fsdp_section_shards_the_data_dimensions_under_mesh_as_under_fsdp():
    """parallel.fsdp's dtypes apply to mesh's fully_shard: shard 2 with parameters gathered in
    float32 trains as fsdp(2) does with them, and not as the float64 run does."""
    sharding = {"param_dtype": "fp32", "shard": ["Linear"]}
    under_fsdp = scenario(devices=2, strategy="fsdp", fsdp=sharding)
    under_mesh = scenario(**mesh(shard=2), fsdp=sharding)
    fsdp_run, mesh_run = workers.run_ranks(2, workers.train_all, [under_fsdp, under_mesh])[0]
    float64 = workers.train(scenario())
    assert rel(mesh_run["losses"], fsdp_run["losses"]) < 1e-12
    for key, value in fsdp_run["params"].items():
        assert rel(mesh_run["params"][key], value) < 1e-12, key
    assert rel(mesh_run["losses"], float64["losses"]) > 1e-9  # float32's rounding, not float64's


def test_the_flops_of_a_step_are_the_whole_models_where_the_model_is_sharded():
    """A sharded model cannot be copied to the meta device: under fsdp and mesh its FLOPs are
    counted on the model as it was before, as one process counts them, and no process warns."""
    [alone] = workers.run_ranks(1, workers.counted_flops, scenario())
    assert alone["flops"] is not None
    for parallel in ({"devices": 2, "strategy": "fsdp"}, mesh(shard=2)):
        for got in workers.run_ranks(2, workers.counted_flops, scenario(**parallel)):
            assert got["flops"] == pytest.approx(alone["flops"], rel=1e-12), parallel
            assert not [line for line in got["lines"] if "FLOPs" in line], got["lines"]


def test_a_split_layers_gradients_are_summed_over_its_copies_part_by_part():
    """A pipeline's copies sum a split layer's gradients as DTensors' local parts: every process
    ends with the copies' sum (1 + 2 times the values) of its part; a part without a gradient
    takes part with zeros."""
    for got in workers.run_ranks(4, workers.summed_split_gradients, timeout=120):
        assert got["weight"] == got["expected"]
        assert got["bias"] == [0.0] * 4
        assert got["local_is_shard"]
