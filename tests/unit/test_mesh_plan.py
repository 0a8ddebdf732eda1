"""`phalanx plan` prices the `mesh` strategy: its shapes from the measured Linears, each one's
tensor all-reduces, split compute and memory from the figures it is given; a row's label and the
settings `strategy: plan` trains it with; and the line that says at which link tensor parallelism
would pay where it does not on the measured one."""

from __future__ import annotations

import dataclasses
import json

import pytest
import toy

from phalanx import config, costs, planner
from phalanx.costs import Compute, Link, Measured, Setup
from phalanx.errors import ConfigError
from phalanx.strategies import mesh, mesh_pricing, pricing, registry, tensor

GB = 1 << 30
MB = 1 << 20


def mlp(activation: float = 4 * MB, hidden: int = 4096) -> tuple[costs.Linear, ...]:
    """A transformer's MLP on one device: up (1024 -> hidden) and down (hidden -> 1024), each
    sample's activations `activation` bytes, 45% of the FLOPs each; the head outside the pair."""
    return (
        costs.Linear("mlp.up", 1024, hidden, 400 * MB, activation, activation, 0.45, "", True),
        costs.Linear("mlp.down", hidden, 1024, 400 * MB, activation, activation, 0.45, "mlp.up"),
        costs.Linear("head", 1024, 10, 40 << 10, activation, 40.0, 0.01, ""),
    )


def measured(**changes) -> Measured:
    """1 GB of parameters, 80% of them in the MLP; 1 ms a call and 1 ms a sample on one device;
    devices of 80 GB joined by a 10 GB/s link."""
    base = dict(
        batch=64,
        accumulation=1,
        compute=Compute(0.001, 0.001),
        optimizer_s=0.005,
        param_bytes=GB,
        grad_bytes=GB,
        optimizer_bytes=2 * GB,
        activation_bytes_per_sample=MB,
        device_memory=80 * GB,
        all_reduce={n: Link(1e-5, 10e9) for n in (2, 3, 4)},
        linears=mlp(),
    )
    return Measured(**{**base, **changes})


def priced(m: Measured, shape: tuple[int, int, int]) -> costs.Prediction:
    plan = tuple(mesh_pricing.plan_for(m, shape[2]).items())
    devices = shape[0] * shape[1] * shape[2]
    return pricing.predict(m, Setup("mesh", devices, mesh=shape, tensor_plan=plan))


def test_the_tensor_all_reduces_grow_with_the_activations_and_shrink_with_the_bandwidth():
    base = priced(measured(), (1, 1, 2))
    tensor = base.parts["tensor"]
    # forward: down's outputs summed; backward: up's input gradient summed; 64 samples each
    assert tensor == pytest.approx(2 * 1e-5 + 2 * 64 * 4 * MB / 10e9)
    heavier = priced(measured(linears=mlp(activation=8 * MB)), (1, 1, 2)).parts["tensor"]
    faster = priced(measured(all_reduce={2: Link(1e-5, 100e9)}), (1, 1, 2)).parts["tensor"]
    assert heavier > 1.9 * tensor
    assert faster < tensor / 9
    assert "its all-reduces of 512.0 MB of activations take" in base.reason


def test_only_the_planned_layers_split_their_compute_and_their_state():
    p = priced(measured(), (1, 1, 2))
    # the MLP's 90% of the per-sample compute halves; the call's fixed cost and the rest do not
    assert p.parts["compute"] == pytest.approx(0.001 + 0.001 * 64 * (1 - 0.9 / 2))
    assert "90% of the FLOPs split 2 ways" in p.reason
    # the MLP's parameters, gradients and optimizer state halve; the rest is whole
    held = GB - 800 * MB / 2
    assert p.memory_bytes == pytest.approx(held + held + 2 * GB * held / GB + 64 * MB)
    assert p.parts["optimizer"] == pytest.approx(0.005 * held / GB)
    # a plan that splits no measured Linear splits nothing
    whole = pricing.predict(
        measured(), Setup("mesh", 2, mesh=(1, 1, 2), tensor_plan=(("other", "colwise"),))
    )
    assert whole.parts["compute"] == pytest.approx(0.001 + 0.001 * 64)
    assert whole.parts["tensor"] == 0.0


def test_the_data_dimensions_are_priced_as_fsdp_and_ddp_price_them():
    m = measured()
    sharded = priced(m, (1, 2, 2))
    fsdp = pricing.predict(m, Setup("fsdp", 2))
    # each tensor group computes half the batch, with half the MLP's products
    assert sharded.parts["compute"] == pytest.approx(0.001 + 0.001 * 32 * (1 - 0.9 / 2))
    # fsdp gathers what a tensor rank holds: less than the whole model
    assert 0 < sharded.parts["communication"] < fsdp.parts["communication"]
    replicated = priced(m, (2, 1, 2))
    ddp = pricing.predict(m, Setup("ddp", 2))
    assert 0 < replicated.parts["communication"] < ddp.parts["communication"]
    assert replicated.memory_bytes > sharded.memory_bytes  # a replica holds its whole share


def test_the_shapes_are_the_tensor_degrees_that_divide_the_devices_and_the_hidden_features():
    shapes = {s.mesh for s in mesh_pricing.setups(measured(linears=mlp(hidden=6)), 4)}
    # 6 hidden features split over 2 or 3, not 4; the data degrees sharded or replicated
    assert shapes == {(1, 1, 2), (1, 1, 3), (1, 2, 2), (2, 1, 2)}
    plan = mesh_pricing.plan_for(measured(), 2)
    assert plan == {"mlp.up": "colwise", "mlp.down": "rowwise"}  # the head is no pair's
    # the config's own plan is priced where it names one, at the degrees that divide its splits
    named = {"mlp.up": "colwise", "mlp.down": "rowwise", "head": "colwise"}  # head: 10 outputs
    m = measured(settings={"mesh": {"tensor_plan": named}})
    assert {s.mesh for s in mesh_pricing.setups(m, 4)} == {(1, 1, 2), (1, 2, 2), (2, 1, 2)}
    assert all(dict(s.tensor_plan) == named for s in mesh_pricing.setups(m, 4))


def test_without_a_pair_to_split_the_plan_says_why_it_has_no_mesh_row():
    assert mesh_pricing.setups(measured(linears=()), 4) == []
    left = planner.unplanned(measured(linears=()), 4)["mesh"]
    assert "no pair of Linear layers to split" in left
    assert "name them in parallel.mesh.tensor_plan" in left
    odd = planner.unplanned(measured(linears=mlp(hidden=5)), 4)["mesh"]
    assert odd == (
        "no tensor degree from 2 to 4 divides the hidden features of the model's MLP pairs (5)"
    )
    assert "mesh" not in planner.unplanned(measured(), 4)


def small_batch(activation: float, bandwidth: float = 1e9) -> Measured:
    """Two samples a step of 10 ms each on links of `bandwidth` (bytes reduced a second): more
    devices than samples, where only a tensor dimension can split the work further."""
    return measured(
        batch=2,
        compute=Compute(0.001, 0.010),
        linears=mlp(activation=activation),
        all_reduce={n: Link(1e-5, bandwidth) for n in (2, 3, 4)},
    )


@pytest.mark.parametrize(("activation", "nvlink"), [(64 * MB, False), (512 * MB, True)])
def test_where_tensor_parallelism_pays_only_on_faster_links_the_plan_says_from_which(
    activation, nvlink
):
    m = small_batch(activation)
    ranked = pricing.rank(m, pricing.candidates(m, 4))
    assert ranked[0].setup.strategy == "single"
    scale, winner = mesh_pricing.pays_from(m, ranked)
    (line,) = planner.notes(m, ranked)
    tensor = winner.setup.mesh[2]
    have = mesh_pricing.bus_bandwidth(1e9, tensor)
    assert line.startswith(
        f"tensor parallelism does not pay on the measured links ({have / 1e9:.2f} GB/s between "
        f"{tensor} devices): on links {scale:.1f}x as fast ({have * scale / 1e9:.1f} GB/s"
    )
    assert line.endswith(f"{pricing.label(winner.setup)} would be the fastest setup")
    assert ("an NVLink-class GPU link" in line) is nvlink
    # priced again on links that fast, that mesh row is the fastest; on links half as fast, not
    fast = small_batch(activation, 1e9 * scale)
    ranked_fast = pricing.rank(fast, pricing.candidates(fast, 4))
    assert ranked_fast[0].setup == winner.setup
    assert planner.notes(fast, ranked_fast) == []
    slower = small_batch(activation, 1e9 * scale / 2)
    assert pricing.rank(slower, pricing.candidates(slower, 4))[0].setup.strategy != "mesh"


def test_where_no_link_would_make_a_mesh_row_the_fastest_the_plan_says_nothing():
    # 64 samples on 4 devices: data parallelism splits the work as well, with no all-reduce of
    # activations, however fast the links
    m = measured(linears=mlp(activation=4 * MB), compute=Compute(0.001, 0.010))
    ranked = pricing.rank(m, pricing.candidates(m, 4))
    assert ranked[0].setup.strategy != "mesh"
    assert mesh_pricing.pays_from(m, ranked) is None
    assert planner.notes(m, ranked) == []


def test_a_mesh_row_is_labelled_by_its_degrees_and_becomes_a_config_the_mesh_accepts():
    """The row `strategy: plan` would pick: its label, its plan.json row and the settings from it,
    which the config's schema, the mesh's checks and the model's Linears accept."""
    m = measured(linears=_deep_linears())
    setup = next(s for s in mesh_pricing.setups(m, 4) if s.mesh == (1, 2, 2))
    assert pricing.label(setup) == "mesh shard 2 x tensor 2"
    assert (
        pricing.label(dataclasses.replace(setup, mesh=(2, 1, 2))) == "mesh replicate 2 x tensor 2"
    )
    assert pricing.label(dataclasses.replace(setup, mesh=(1, 1, 4))) == "mesh tensor 4"
    row = json.loads(json.dumps(planner._row(pricing.predict(m, setup))))  # as plan.json has it
    settings = registry.get(row["strategy"]).plan_settings(row)
    assert settings == {
        "mesh": {
            "replicate": 1,
            "shard": 2,
            "tensor": 2,
            "tensor_plan": {"net.0": "colwise", "net.2": "rowwise"},
        }
    }
    raw = toy.regression_config(
        model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 2},
        parallel={"strategy": "mesh", "devices": row["devices"], **settings},
    )
    cfg = config.validate(raw)
    mesh.check(cfg, "cpu", row["devices"])
    tensor.check_plan(toy.Deep(features=3, hidden=4, layers=2), settings["mesh"]["tensor_plan"], 2)


def _deep_linears() -> tuple[costs.Linear, ...]:
    """toy.Deep(3, 4, 2)'s Linears as the planner measures them (the test below measures them)."""
    return (
        costs.Linear("net.0", 3, 4, 128, 24.0, 32.0, 0.3, "", False),
        costs.Linear("net.2", 4, 4, 160, 32.0, 32.0, 0.5, "net.0"),
        costs.Linear("net.4", 4, 1, 40, 32.0, 8.0, 0.2, "net.2"),
    )


def test_the_planner_measures_each_linear_and_which_one_feeds_it(tmp_path):
    raw = toy.regression_config(
        model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 2},
        parallel={"mesh": {"tensor_plan": {"net.0": "colwise", "net.2": "rowwise"}}},
    )
    path = toy.write_config(tmp_path, raw)
    cfg = config.load(str(path), [])[0]
    m = planner.measure(str(path), planner._one(cfg, [], "cpu"), "cpu", 1, {1: 1})
    assert [(x.name, x.in_features, x.out_features, x.fed_by) for x in m.linears] == [
        ("net.0", 3, 4, ""),
        ("net.2", 4, 4, "net.0"),  # through a Tanh
        ("net.4", 4, 1, "net.2"),
    ]
    first, second, head = m.linears
    assert not first.input_grad and second.input_grad  # the data needs no gradient
    assert first.param_bytes == (3 * 4 + 4) * 8  # float64
    assert second.input_bytes_per_sample == second.output_bytes_per_sample == 4 * 8
    assert head.output_bytes_per_sample == 8
    assert 0 < sum(x.share for x in m.linears) <= 1
    assert second.share > first.share > head.share  # 4x4 products, forward and two backward
    assert m.settings["mesh"]["tensor_plan"] == {"net.0": "colwise", "net.2": "rowwise"}
    again = Measured.from_json(json.loads(json.dumps(dataclasses.asdict(m))))
    assert again == m  # plan.json keeps them


def test_auto_accumulation_under_a_mesh_prices_the_configs_shape_and_refuses_a_wrong_one():
    plan = {"mlp.up": "colwise", "mlp.down": "rowwise"}
    raw = toy.regression_config(
        parallel={
            "strategy": "mesh",
            "devices": 4,
            "mesh": {"shard": 2, "tensor": 2, "tensor_plan": plan},
        }
    )
    cfg = config.validate(raw)
    m = measured(settings={"mesh": {"tensor_plan": plan}})
    setup = mesh_pricing.accumulation_setup(cfg, 4)(m)
    assert setup.mesh == (1, 2, 2) and dict(setup.tensor_plan) == plan
    assert pricing.fitting(m, setup).fits
    with pytest.raises(ConfigError, match=r"tensor\(2\) = 4, but the job has 2 processes"):
        mesh_pricing.accumulation_setup(cfg, 2)


@pytest.mark.parametrize("strategy", ["mesh", "fsdp"])
def test_auto_accumulation_on_several_devices_is_chosen_from_one_device_without_links(
    tmp_path, strategy
):
    """`gradient_accumulation: auto` measures one device, no link: the peak memory decides."""
    raw = toy.regression_config(
        model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 2},
        parallel={
            "strategy": strategy,
            "devices": 2,
            "gradient_accumulation": "auto",
            "mesh": {"tensor": 2, "tensor_plan": {"net.0": "colwise", "net.2": "rowwise"}},
        },
    )
    count, said = planner.accumulation_for(str(toy.write_config(tmp_path, raw)), [])
    assert count == 1
    assert said.endswith(f"({'mesh tensor 2' if strategy == 'mesh' else 'fsdp x2'})")
