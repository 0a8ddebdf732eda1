"""The `mesh` strategy's checks, in one process: a tensor plan the model cannot take, and degrees
whose product is not the job's processes, are one ConfigError each that names the fix."""

from __future__ import annotations

import pytest
import toy

from phalanx import config
from phalanx.errors import ConfigError
from phalanx.strategies import mesh, tensor
from phalanx.strategies.tensor import Tensor, check_tensor_plan


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"net.5": "colwise"},
            r"names 'net.5', which the model does not have; its modules a plan can split are "
            r"net.0, net.2$",
        ),
        (
            {"net.1": "colwise"},
            r"names 'net.1' \(colwise\), a Tanh; colwise splits nn.Linear and nn.Embedding "
            r"modules; name one of net.0, net.2$",
        ),
        (
            {"net.0": "colwise", "net.2": "colwise"},
            r"'net.2' \(colwise\) splits its 1 outputs over parallel.mesh.tensor=2 processes, "
            r"which does not divide them; .* or leave 'net.2' out of the plan$",
        ),
        ({}, r"parallel.mesh.tensor is 2 but parallel.mesh.tensor_plan is empty"),
    ],
    ids=["missing", "not-linear", "indivisible", "empty"],
)
def test_a_plan_the_model_cannot_take_is_one_error_naming_the_module(plan, message):
    with pytest.raises(ConfigError, match=message):
        tensor.check_plan(toy.Linear(features=3, hidden=4), plan, 2)


def test_a_plan_the_model_takes_passes():
    tensor.check_plan(toy.Linear(features=3, hidden=4), {"net.0": "colwise", "net.2": "rowwise"}, 2)


def test_degrees_whose_product_is_not_the_processes_are_one_error_with_the_arithmetic():
    raw = toy.regression_config(
        parallel={"strategy": "mesh", "devices": 4, "mesh": {"shard": 2, "tensor": 3}}
    )
    with pytest.raises(
        ConfigError,
        match=r"parallel.mesh: replicate\(1\) \* shard\(2\) \* pipeline\(1\) \* tensor\(3\) = 6, "
        r"but the job has 4 processes; set parallel.devices to 6, or degrees whose product is 4$",
    ):
        mesh.check(config.validate(raw), "cpu", 4)


def test_a_tensor_degree_without_a_plan_is_refused_before_any_process_starts():
    raw = toy.regression_config(parallel={"strategy": "mesh", "devices": 2, "mesh": {"tensor": 2}})
    with pytest.raises(
        ConfigError, match=r"tensor_plan is empty; .* or set parallel.mesh.tensor: 1$"
    ):
        mesh.check(config.validate(raw), "cpu", 2)


def test_a_style_other_than_colwise_or_rowwise_is_refused_by_the_schema():
    raw = toy.regression_config(
        parallel={"strategy": "mesh", "mesh": {"tensor": 2, "tensor_plan": {"net.0": "col"}}}
    )
    with pytest.raises(ConfigError, match="parallel.mesh.tensor_plan.net.0"):
        config.validate(raw)


PLAN = {"net.0": "colwise", "net.2": "rowwise", "net.4": "colwise", "net.6": "rowwise"}


def staged(mesh_degrees: dict, pipeline: dict | None) -> config.Config:
    processes = 1
    for degree in mesh_degrees.values():
        processes *= degree
    parallel = {
        "strategy": "mesh",
        "devices": processes,
        "mesh": {**mesh_degrees, "tensor_plan": PLAN},
    }
    if pipeline is not None:
        parallel["pipeline"] = pipeline
    return config.validate(toy.regression_config(parallel=parallel))


@pytest.mark.parametrize(
    ("degrees", "pipeline", "message"),
    [
        (
            {"pipeline": 2, "shard": 2, "tensor": 2},
            {"split": ["net.4"]},
            r"pipeline\(2\) with shard\(2\) is not supported: .* set parallel.mesh.replicate to 2 "
            r"and parallel.mesh.shard to 1$",
        ),
        (
            {"pipeline": 2, "tensor": 2},
            None,
            r"parallel.strategy=mesh needs parallel.pipeline.split",
        ),
        (
            {"pipeline": 2, "tensor": 2},
            {"split": ["net.2", "net.4"]},
            r"parallel.mesh.pipeline is 2, but parallel.pipeline makes 3 stages, 1 a process; set "
            r"parallel.mesh.pipeline to 3, or split the model into 2 stages$",
        ),
    ],
    ids=["sharded-stages", "no-split", "stages-mismatch"],
)
def test_a_pipeline_dimension_the_config_cannot_make_is_refused_before_processes_start(
    degrees, pipeline, message
):
    with pytest.raises(ConfigError, match=message):
        mesh.check(staged(degrees, pipeline), "cpu", 2 * 2 * degrees.get("shard", 1))


def deep() -> toy.Deep:
    return toy.Deep(features=3, hidden=4, layers=4)


def test_a_stage_starting_inside_a_colwise_rowwise_pair_is_one_error_naming_where_to_move_it():
    with pytest.raises(
        ConfigError,
        match=r"starts a stage at 'net.2', between 'net.0' \(colwise\) and 'net.2' \(rowwise\), .*"
        r"move the split point before 'net.0' or after 'net.2'$",
    ):
        check_tensor_plan(deep(), Tensor(2, PLAN), ["net.2"], set(), None)
    check_tensor_plan(deep(), Tensor(2, PLAN), ["net.4"], set(), None)


def test_a_split_block_is_refused_where_a_process_passes_activations_through_its_stages():
    blocks = {f"net.{i}" for i in range(9)}
    with pytest.raises(
        ConfigError, match=r"splits 'net.0', a block .* \(parallel.pipeline.schedule=zbv\)"
    ):
        check_tensor_plan(deep(), Tensor(2, PLAN), ["net.4"], blocks, "zbv")
    check_tensor_plan(deep(), Tensor(2, PLAN), ["net.4"], blocks, None)


# --- tensor_plan: auto, and the styles beyond Linear -----------------------------------------


def tiny_gpt():
    """The GPT example's tiny.yaml model."""
    from examples.gpt.model import GPT

    return GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)


def test_auto_splits_the_gpt_examples_mlps_and_leaves_its_fused_attention_whole():
    found = tensor.find_plan(tiny_gpt(), 2)
    assert found.styles == {
        "blocks.0.mlp.fc": "colwise",
        "blocks.0.mlp.proj": "rowwise",
        "blocks.1.mlp.fc": "colwise",
        "blocks.1.mlp.proj": "rowwise",
    }
    assert list(found.whole) == ["blocks.0.attn", "blocks.1.attn"]
    assert "its q, k and v are one Linear ('qkv')" in found.whole["blocks.0.attn"]
    line = tensor.describe_plan(tiny_gpt(), "auto", 2)
    assert line == (
        "tensor plan (auto) over 2 processes: colwise blocks.*.mlp.fc (2); rowwise "
        "blocks.*.mlp.proj (2); blocks.*.attn (2) left whole: " + found.whole["blocks.0.attn"]
    )


def test_auto_splits_separate_attention_projections_and_sequential_mlps():
    assert tensor.resolve_plan(toy.Attending(width=8, heads=4), "auto", 2) == {
        "attn.q_proj": "colwise",
        "attn.k_proj": "colwise",
        "attn.v_proj": "colwise",
        "attn.o_proj": "rowwise",
        "mlp.0": "colwise",
        "mlp.2": "rowwise",
    }
    assert tensor.resolve_plan(toy.Deep(3, 4, 3), "auto", 2) == {
        "net.0": "colwise",
        "net.2": "rowwise",
        "net.4": "colwise",
        "net.6": "rowwise",
    }


def test_auto_leaves_attention_whole_where_its_heads_do_not_split_or_its_head_size_is_unknown():
    three_heads = tensor.find_plan(toy.Attending(width=12, heads=3), 2)
    assert "attn.q_proj" not in three_heads.styles
    assert three_heads.whole == {"attn": "its 3 heads (n_heads) do not split over 2"}
    model = toy.Attending(width=8, heads=4)
    del model.attn.head_dim
    assert tensor.find_plan(model, 2).whole["attn"].startswith("no head_dim attribute")


@pytest.mark.parametrize(
    ("model", "degree", "message"),
    [
        (toy.Linear(features=3, hidden=4), 3, r"net.0 and net.2 left whole: their 4 hidden "),
        (toy.Tied(), 2, r"found nothing in Tied to split"),
        (
            toy.Linear(features=3),
            2,
            r"found nothing in Linear to split over parallel.mesh.tensor=2",
        ),
    ],
    ids=["indivisible", "tied", "one-layer"],
)
def test_auto_finding_nothing_to_split_is_one_error_with_the_fix(model, degree, message):
    with pytest.raises(ConfigError, match=message) as error:
        tensor.resolve_plan(model, "auto", degree)
    assert str(error.value).endswith("or set parallel.mesh.tensor: 1")


@pytest.mark.parametrize(
    ("plan", "degree", "message"),
    [
        (
            {"embed": "colwise"},
            5,
            r"'embed' \(colwise\) splits its 24 embedding dimensions over parallel.mesh.tensor=5 ",
        ),
        ({"embed": "rowwise"}, 4, r"'embed' \(rowwise\) splits its 18 rows over "),
        (
            {"mlp.0": "sequence"},
            2,
            r"names 'mlp.0' \(sequence\), a Linear; sequence splits nn.LayerNorm and nn.RMSNorm "
            r"modules; name one of ln_1, ln_2$",
        ),
        (
            {"ln_1": "colwise"},
            2,
            r"names 'ln_1' \(colwise\), a LayerNorm; colwise splits nn.Linear",
        ),
        (
            {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise"},
            4,
            r"splits the q, k and v of 'attn', but its 6 heads \(n_heads\) do not split over 4 ",
        ),
        ({"ln_1": "diagonal"}, 2, r"gives 'ln_1' the style 'diagonal'; choose one of colwise, "),
    ],
    ids=["embedding-dims", "embedding-rows", "sequence-linear", "colwise-norm", "heads", "style"],
)
def test_each_plan_the_model_cannot_take_is_one_error_naming_the_module(plan, degree, message):
    with pytest.raises(ConfigError, match=message):
        tensor.check_plan(toy.Attending(vocab=18, width=24, heads=6), plan, degree)


def test_a_plan_that_splits_a_tied_weight_is_one_error_naming_both_modules():
    model = toy.Attending(vocab=18, width=24, heads=6)
    model.head.weight = model.embed.weight  # as a language model ties its head to its embedding
    with pytest.raises(
        ConfigError, match=r"names 'head', whose weight another module shares \('embed'\)"
    ):
        tensor.check_plan(model, {"head": "rowwise"}, 2)


def test_the_schema_takes_auto_and_the_sequence_style():
    for plan in ("auto", {"ln_1": "sequence", "embed": "rowwise"}):
        raw = toy.regression_config(parallel={"strategy": "mesh", "mesh": {"tensor_plan": plan}})
        assert config.validate(raw).parallel.section("mesh", mesh.MeshSettings).tensor_plan == plan


def test_the_gpt_examples_mesh_config_is_shard_2_by_tensor_2_with_auto_on_4_processes():
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "gpt" / "mesh.yaml"
    cfg, _ = config.load(str(path), [])
    layout = cfg.parallel.section("mesh", mesh.MeshSettings)
    assert (layout.shard, layout.tensor, layout.tensor_plan) == (2, 2, "auto")
    mesh.check(cfg, "cpu", 4)  # the degrees' product is the processes


@pytest.mark.parametrize(
    ("fsdp", "message"),
    [
        (
            {"init": "meta"},
            r"parallel.fsdp.init=meta is not supported under parallel.strategy=mesh",
        ),
        (
            {"offload": True},
            r"parallel.fsdp.offload with parallel.mesh.tensor > 1 is not supported",
        ),
    ],
    ids=["meta", "offload"],
)
def test_fsdp_settings_mesh_cannot_honour_are_refused_not_ignored(fsdp, message):
    raw = toy.regression_config(
        parallel={
            "strategy": "mesh",
            "devices": 4,
            "mesh": {"shard": 2, "tensor": 2, "tensor_plan": {"net.0": "colwise"}},
            "fsdp": fsdp,
        }
    )
    with pytest.raises(ConfigError, match=message):
        mesh.check(config.validate(raw), "cpu", 4)
