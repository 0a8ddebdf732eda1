"""The `mesh` strategy's checks, in one process: a tensor plan the model cannot take, and degrees
whose product is not the job's processes, are one ConfigError each that names the fix."""

from __future__ import annotations

import pytest
import toy

from phalanx import config
from phalanx.errors import ConfigError
from phalanx.strategies import mesh, tensor


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
        tensor.check_plan(toy.Linear(features=3, hidden=4), plan, 2)


def test_a_plan_the_model_takes_passes():
    tensor.check_plan(toy.Linear(features=3, hidden=4), {"net.0": "colwise", "net.2": "rowwise"}, 2)


def test_degrees_whose_product_is_not_the_processes_are_one_error_with_the_arithmetic():
    raw = toy.regression_config(
        parallel={"strategy": "mesh", "devices": 4, "mesh": {"shard": 2, "tensor": 3}}
    )
    with pytest.raises(
        ConfigError,
        match=r"parallel.mesh: replicate\(1\) \* shard\(2\) \* tensor\(3\) = 6, but the job has 4 "
        r"processes; set parallel.devices to 6, or degrees whose product is 4$",
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
