"""A strategy of one's own is one module that registers itself (`tests/toy_strategy.py`) and one
import: the config then knows its name and checks its section, and a run trains with it."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import toy

import phalanx
from phalanx import config
from phalanx.errors import ConfigError
from phalanx.strategies import registry


@pytest.fixture
def toy_strategy(monkeypatch):
    """The module imported afresh, into a registry that forgets it after the test."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry.families()))
    monkeypatch.delitem(sys.modules, "toy_strategy", raising=False)
    return importlib.import_module("toy_strategy")


def test_a_strategy_module_of_ones_own_trains_from_a_config(toy_strategy):
    raw = toy.regression_config(
        parallel={"strategy": "toy", "toy": {"tag": "from-the-config", "every": 2}},
        main_loop={"epochs": 2, "extra_streams": []},
        hooks=[],
    )
    model = toy.Linear(features=3)
    before = [p.detach().clone() for p in model.parameters()]
    run = phalanx.fit(raw, model=model)
    assert run.code == 0
    (built,) = toy_strategy.BUILT
    assert built.settings.tag == "from-the-config" and built.settings.every == 2
    assert built.steps == 2 * 5 and built.counted == 5  # 2 epochs of 40 samples, 8 a batch
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))
    assert "strategy toy: 1 process" in (run.run_dir / "log.txt").read_text()


def test_its_section_is_checked_as_every_section(toy_strategy):
    raw = toy.regression_config(parallel={"strategy": "toy", "toy": {"every": 0}})
    with pytest.raises(ConfigError, match=r"parallel\.toy\.every"):
        config.validate(raw)
    raw["parallel"]["toy"] = {"tga": "x"}
    with pytest.raises(ConfigError, match=r"unknown key 'parallel\.toy\.tga' \(did you mean"):
        config.validate(raw)


def test_without_its_module_the_strategy_is_unknown():
    raw = toy.regression_config(parallel={"strategy": "auto", "toy": {"tag": "x"}})
    with pytest.raises(ConfigError, match=r"unknown key 'parallel\.toy'"):
        config.validate(raw)
