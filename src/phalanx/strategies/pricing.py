"""The plan's prices: each registered strategy's setups (`candidates`), priced by its own `cost`
(`predict`), ranked fastest first (`rank`), at the fewest micro-batches a step that fit (`fitting`),
and labelled for the plan's table (`label`). The arithmetic they share is `costs`'s."""

from __future__ import annotations

import math
from dataclasses import replace

from phalanx.costs import Compute, Measured, Prediction, Setup
from phalanx.strategies import registry


def label(setup: Setup) -> str:
    """The setup as the plan's table names it."""
    named = registry.get(setup.strategy).label
    if named is not None:
        return named(setup)
    return f"{setup.strategy} x{setup.devices}" if setup.devices > 1 else setup.strategy


def compute_of(m: Measured, setup: Setup) -> Compute:
    """What a process of `setup` computes with: a strategy of one process has the machine's."""
    alone = not registry.get(setup.strategy).process_per_device
    return m.compute if alone else m.computes.get(setup.devices, m.compute)


def predict(m: Measured, setup: Setup) -> Prediction:
    """One setup's prediction (its speedup filled in by `rank`), by its strategy's `cost`."""
    family = registry.get(setup.strategy)
    if family.cost is None:
        raise ValueError(f"the plan does not price {setup.strategy}")
    prediction = family.cost(m, setup)
    if m.data_s_per_sample:  # each process fetches the samples it computes on (all of its copy's)
        if family.readers is not None:
            readers = family.readers(setup)
        else:
            readers = setup.devices if family.process_per_device else 1
        prediction.parts["data"] = m.data_s_per_sample * math.ceil(m.batch / readers)
        prediction.step_s += prediction.parts["data"]
    prediction.samples_per_s = m.batch / prediction.step_s if prediction.step_s > 0 else 0.0
    return prediction


def candidates(m: Measured, devices: int) -> list[Setup]:
    """Every setup up to `devices` devices that the measurements can price: each strategy's."""
    out = [
        setup
        for name, family in registry.families().items()
        if family.setups is not None and name not in m.refused
        for setup in family.setups(m, devices)
    ]
    return out


def fitting(m: Measured, setup: Setup) -> Prediction:
    """The setup at the fewest micro-batches a step, from the measured count up by doubling, whose
    predicted peak fits a device (`gradient_accumulation: auto`); the last tried where none does."""
    accumulation = m.accumulation
    while True:
        prediction = predict(replace(m, accumulation=accumulation), setup)
        prediction.accumulation = accumulation
        if prediction.fits or accumulation >= m.batch:
            return prediction
        accumulation = min(2 * accumulation, m.batch)


def rank(m: Measured, setups: list[Setup], auto: bool = False) -> list[Prediction]:
    """The predictions, fastest first among those that fit, then those that do not; speedups and
    efficiencies against one device. `auto`: each setup at the fewest micro-batches a step that
    fit (`fitting`)."""
    predictions = [fitting(m, s) if auto else predict(m, s) for s in setups]
    for p in predictions:
        if not auto:
            p.accumulation = m.accumulation
    alone = registry.auto(several=False)
    one = next((p.step_s for p in predictions if p.setup.strategy == alone), None)
    for p in predictions:
        if one and p.step_s > 0:
            p.speedup = one / p.step_s
            p.efficiency = p.speedup / p.setup.devices
            if p.setup.devices > 1:
                p.reason += f": {p.speedup:.2f}x of one device"
    return sorted(predictions, key=lambda p: (not p.fits, p.step_s))
