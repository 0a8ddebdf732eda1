"""torch's threads on the CPU: one rule (`strategies.cpu_threads`) for the runs and for the plan
that predicts them. One process alone keeps the threads it has; the processes of one machine share
its cores; the plan measures each setup's computation with the threads its processes will have, and
leaves its own process's threads as they were."""

from __future__ import annotations

import json

import pytest
import torch
import toy

import phalanx
from phalanx import config, costs, planner, strategies
from phalanx.costs import Compute, Setup
from phalanx.strategies import pricing

pytestmark = pytest.mark.timeout(240)

# a model that notes the threads torch computes its forward with
RECORDING = """
import torch

import toy

SEEN = set()


class Recording(toy.Linear):
    def forward(self, x, y):
        SEEN.add(torch.get_num_threads())
        return super().forward(x, y)
"""


@pytest.fixture
def threads_kept():
    """This test process's threads, as they were before the test."""
    own = torch.get_num_threads()
    yield own
    torch.set_num_threads(own)


def test_a_process_alone_keeps_its_threads_and_several_share_the_cores(monkeypatch):
    monkeypatch.setattr(strategies, "cpu_cores", lambda: 8)
    assert strategies.cpu_threads("auto", 1) is None  # torch's own: OMP_NUM_THREADS, or every core
    assert strategies.cpu_threads("auto", 2) == 4
    assert strategies.cpu_threads("auto", 3) == 2
    assert strategies.cpu_threads("auto", 16) == 1
    # a number is per device: a process that drives three has three times as many
    assert strategies.cpu_threads(2, 4) == 2
    assert strategies.cpu_threads(2, 1, devices=3) == 6


def test_more_threads_than_cores_asked_for_are_said(tmp_path, monkeypatch, threads_kept):
    monkeypatch.setattr(strategies, "cpu_cores", lambda: 8)
    assert strategies.too_many_threads(8, 1) is None and strategies.too_many_threads(4, 2) is None
    assert strategies.too_many_threads(3, 3) == (
        "parallel.cpu_threads asks for 3 processes of 3 threads, more than this machine's 8 cores: "
        "the threads will wait for each other; set parallel.cpu_threads: auto, or at most 2"
    )
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", "cpu_threads": 9},
        main_loop={"epochs": 1},
        output_root=str(tmp_path),
    )
    run = phalanx.fit(raw)
    assert run.code == 0
    assert (
        "asks for 9 threads, more than this machine's 8 cores"
        in (run.run_dir / "log.txt").read_text()
    )


def test_the_plan_prices_each_setup_with_its_processes_threads(monkeypatch, threads_kept):
    monkeypatch.setattr(strategies, "cpu_cores", lambda: 8)
    cfg = config.validate(toy.regression_config())
    own = threads_kept
    # two machines of 4 processes at most: a setup of 6 puts 4 on one of them
    assert planner._threads(cfg, "cpu", 4, 8) == {
        1: own,
        2: 4,
        3: 2,
        4: 2,
        5: 2,
        6: 2,
        7: 2,
        8: 2,
    }
    cfg = config.validate(toy.regression_config(parallel={"cpu_threads": 3}))
    assert planner._threads(cfg, "cpu", 2, 2) == {1: 3, 2: 3}
    # each setup computes at its processes' threads; one process alone at the single one's
    m = costs.Measured(
        batch=64,
        accumulation=1,
        compute=Compute(0.0, 0.001),
        optimizer_s=0.0,
        param_bytes=0,
        grad_bytes=0,
        optimizer_bytes=0,
        activation_bytes_per_sample=0.0,
        device_memory=1 << 30,
        all_reduce={2: costs.Link(1e-6, 1e12)},
        computes={2: Compute(0.0, 0.004)},
    )
    assert pricing.predict(m, Setup("single", 1)).parts["compute"] == pytest.approx(0.064)
    assert pricing.predict(m, Setup("ddp", 2)).parts["compute"] == pytest.approx(0.128)
    assert pricing.predict(m, Setup("towers", 2)).parts["compute"] == pytest.approx(0.032)


def test_the_plan_measures_at_each_thread_count_and_leaves_its_own(tmp_path, threads_kept):
    (tmp_path / "recording.py").write_text(RECORDING)
    path = toy.write_config(
        tmp_path, toy.regression_config(model={"class": "recording.Recording", "features": 3})
    )
    cfg = config.load(str(path), [])[0]
    alone = threads_kept + 1  # none that the run would have by chance
    measured = planner.measure(str(path), planner._one(cfg, [], "cpu"), "cpu", 1, {1: alone, 2: 1})
    import recording

    assert recording.SEEN == {alone, 1}
    assert set(measured.computes) == {2}  # the shared cores' computation, apart from one's
    assert torch.get_num_threads() == threads_kept


def test_a_run_that_plans_keeps_the_threads_of_its_process_and_says_them(
    tmp_path, monkeypatch, threads_kept
):
    """`strategy: plan` measures and trains in one process: the run computes with the threads the
    plan measured one device with, its process's own, and its first line says how many."""
    monkeypatch.chdir(tmp_path)
    own = strategies.cpu_cores() + 1  # not what a plan that set its own would leave
    torch.set_num_threads(own)
    raw = toy.regression_config(
        parallel={"strategy": "plan", "devices": 1, "accelerator": "cpu"},
        main_loop={"epochs": 1, "extra_streams": []},
        hooks=[],
        output_root="runs",
    )
    run = phalanx.fit(toy.write_config(tmp_path, raw))
    assert run.code == 0
    first = next(
        line
        for line in (run.run_dir / "log.txt").read_text().splitlines()
        if "strategy single:" in line
    )
    assert f"1 process driving 1 cpu device with {own} threads;" in first
    plan = json.loads((run.run_dir / "plan.json").read_text())
    assert plan["cpu_threads_per_process"] == {"1": own}
    assert torch.get_num_threads() == own
