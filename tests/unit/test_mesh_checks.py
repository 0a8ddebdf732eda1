"""The `mesh` strategy's checks, in one process: a tensor plan the model cannot take, and degrees
whose product is not the job's processes, are one ConfigError each that names the fix."""

from __future__ import annotations

import pytest
import toy

from phalanx import config
from phalanx.errors import ConfigError
from phalanx.strategies import mesh
from phalanx.strategies.pipeline import Tensor, check_tensor_plan


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"net.5": "colwise"},
            r"names 'net.5', which the model does not have; its Linear modules are net.0, net.2$",
        ),
        (
            {"net.1": "colwise"},
            r"names 'net.1', a Tanh; only nn.Linear modules are split; name one of net.0, net.2$",
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
        mesh.check_plan(toy.Linear(features=3, hidden=4), plan, 2)


def test_a_plan_the_model_takes_passes():
    mesh.check_plan(toy.Linear(features=3, hidden=4), {"net.0": "colwise", "net.2": "rowwise"}, 2)


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
