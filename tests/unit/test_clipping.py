"""Clipping by the global gradient norm with an optimizer that skips a step on its device (torch's
fused ones): the norm is not read back every step, and a step whose norm is not finite is skipped
exactly as when it is read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import toy

from phalanx import config, engine
from phalanx.trainer import Trainer

TESTS = Path(toy.__file__).parent


def _trained(optimizer: dict, inf_at: int, caplog) -> tuple[Trainer, list[str]]:
    raw = toy.regression_config(
        model={"class": "toy.InfAt", "features": 3, "step": inf_at},
        optimizer={**optimizer, "lr": 0.05, "fused": True, "max_grad_norm": 1.0},
        main_loop={"epochs": 2, "extra_streams": []},
        hooks=[],
    )
    caplog.clear()
    trainer = Trainer(config.validate(raw), None, [TESTS])
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert trainer.run() == 0
    return trainer, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    "optimizer, inf_at",
    [
        ({"class": "AdamW"}, 3),
        ({"class": "AdamW"}, 1),  # the first step skipped: Adam's state stays empty
        ({"class": "SGD"}, 3),
        # fused SGD makes its momentum buffers before it reads the flag: the host decides until
        # they exist, so a skipped first step leaves none
        ({"class": "SGD", "momentum": 0.9}, 1),
        ({"class": "SGD", "momentum": 0.9}, 3),
    ],
)
def test_a_fused_optimizer_skips_a_non_finite_step_on_its_device_as_the_host_would(
    optimizer, inf_at, caplog, monkeypatch
):
    on_device, said = _trained(optimizer, inf_at, caplog)
    assert engine._skips_on_device(on_device.optimizer)
    monkeypatch.setattr(engine, "_skips_on_device", lambda optimizer: False)
    on_host, said_on_host = _trained(optimizer, inf_at, caplog)
    # the same weights and optimizer state, to the bit: the step skipped in both (its step count
    # too), every other step taken
    weights, want = on_device.model.state_dict(), on_host.model.state_dict()
    assert all(torch.equal(weights[k], want[k]) for k in want)
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    state, want_state = on_device.optimizer.state_dict(), on_host.optimizer.state_dict()
    assert state["state"].keys() == want_state["state"].keys()
    for p, values in want_state["state"].items():
        for name, value in values.items():
            assert torch.equal(state["state"][p][name], value), (p, name)
    assert not hasattr(on_device.optimizer, "found_inf")  # handed for the step alone
    # the epoch's norms, and the warning of its first non-finite one
    assert on_device.engine.norms.state_dict() == on_host.engine.norms.state_dict()
    assert said == said_on_host
    assert any(f"is not finite (nan) at step {inf_at} of the epoch" in line for line in said)


def test_norms_left_on_the_device_are_read_once_when_one_is_read():
    norms = engine.GradNorms()
    for value in [1.0, float("nan"), 3.0] + [2.0] * 70:  # more than are kept apart
        norms.add_later(torch.tensor(value, dtype=torch.float64))
    assert norms.last == 2.0
    assert norms.variables() == {
        "grad_norm_nonfinite": 1,
        "grad_norm": pytest.approx((1.0 + 3.0 + 140.0) / 72),
        "grad_norm_max": 3.0,
    }
    norms.add(float("inf"), warn=False)
    norms.add_later(torch.tensor(5.0))
    assert norms.state_dict()["count"] == 73 and norms.state_dict()["nonfinite"] == 2
    assert norms.last == 5.0
    norms.reset()
    assert norms.last is None and norms.variables() == {"grad_norm_nonfinite": 0}


def test_which_optimizers_skip_on_their_device():
    def made(kind, fused=True, **kwargs):
        return kind(torch.nn.Linear(3, 1).parameters(), lr=0.1, fused=fused, **kwargs)

    assert engine._skips_on_device(made(torch.optim.AdamW))
    assert engine._skips_on_device(made(torch.optim.SGD))
    assert not engine._skips_on_device(made(torch.optim.AdamW, fused=False))
    rmsprop = torch.optim.RMSprop(torch.nn.Linear(3, 1).parameters())  # no fused kernel
    assert not engine._skips_on_device(rmsprop)
    # fused SGD with momentum: not before it holds its momentum buffers (a skipped first step
    # would keep the uninitialised ones it makes), then yes
    sgd = made(torch.optim.SGD, momentum=0.9)
    assert not engine._skips_on_device(sgd)
    sgd.param_groups[0]["params"][0].grad = torch.ones(1, 3)
    sgd.param_groups[0]["params"][1].grad = torch.ones(1)
    sgd.step()
    assert engine._skips_on_device(sgd)
    # every group must be fused: an unfused one refuses the flag
    mixed = made(torch.optim.AdamW)
    mixed.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "fused": False})
    assert not engine._skips_on_device(mixed)
