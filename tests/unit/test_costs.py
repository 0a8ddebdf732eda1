"""The planner's cost model on synthetic measurements: what it predicts follows from the figures
it is given, case by case."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from phalanx import costs
from phalanx.costs import Block, Compute, Link, Measured, Setup
from phalanx.strategies import pricing

GB = 1 << 30


def measured(**changes) -> Measured:
    """A model of 100 MB of parameters in 4 equal blocks, 10 ms of fixed cost a step and 1 ms a
    sample, on devices of 80 GB joined by a 10 GB/s link."""
    base = dict(
        batch=64,
        accumulation=1,
        compute=Compute(0.010, 0.001),
        optimizer_s=0.005,
        param_bytes=100 << 20,
        grad_bytes=100 << 20,
        optimizer_bytes=200 << 20,
        activation_bytes_per_sample=1 << 20,
        device_memory=80 * GB,
        all_reduce={n: Link(1e-4, 10e9) for n in (2, 3, 4)},
        p2p=Link(1e-5, 10e9),
        blocks=tuple(Block(f"net.{i}", 0.25, 25 << 20, 4096, True) for i in range(4)),
        chain="net",
    )
    return Measured(**{**base, **changes})


def best(m: Measured, devices: int) -> costs.Prediction:
    return pricing.rank(m, pricing.candidates(m, devices))[0]


def test_a_compute_bound_model_is_fastest_on_the_most_devices():
    top = best(measured(), 4)
    assert top.setup.devices == 4 and top.setup.strategy in ("ddp", "fsdp")
    assert 2.5 < top.speedup < 4  # 79 ms a step on one; 26 ms of compute on each of four
    assert "each device computes 16 samples" in top.reason


def test_an_all_reduce_bound_model_is_fastest_on_one_device_and_says_why():
    slow = {n: Link(1e-3, 0.1e9) for n in (2, 3, 4)}  # 100 MB at 0.1 GB/s: about 1 s
    m = measured(all_reduce=slow, p2p=Link(1e-3, 0.1e9), compute=Compute(0.001, 0.0001))
    ranked = pricing.rank(m, pricing.candidates(m, 4))
    assert ranked[0].setup.strategy == "single"
    ddp2 = next(p for p in ranked if p.setup == Setup("ddp", 2))
    assert ddp2.speedup < 0.1
    assert "all-reduce of 100.0 MB at 0.10 GB/s takes" in ddp2.reason
    assert "longer than the" in ddp2.reason and "x of one device" in ddp2.reason


def test_a_reduction_that_backward_hides_costs_nothing():
    hidden = pricing.predict(measured(overlap=1.0), Setup("ddp", 2))
    exposed = pricing.predict(measured(overlap=0.0), Setup("ddp", 2))
    reduce = Link(1e-4, 10e9).time(100 << 20)
    assert hidden.parts["communication"] == pytest.approx(0.0)
    assert exposed.parts["communication"] == pytest.approx(reduce)
    assert exposed.step_s - hidden.step_s == pytest.approx(reduce)


def test_the_pipeline_pays_its_bubble_and_more_micro_batches_shrink_it():
    m = measured(all_reduce={2: Link(0.0, 1e18)}, p2p=Link(0.0, 1e18))  # free links
    split = ("net.2",)
    steps = {}
    for mb in (1, 4, 16):
        p = pricing.predict(m, Setup("pipeline", 2, 2, mb, "1f1b", split))
        slot = 0.5 * m.compute.time(64 / mb)  # half the model a stage
        assert p.parts["compute"] == pytest.approx(mb * slot)
        assert p.parts["bubble"] == pytest.approx(slot)  # (stages - 1) slots
        steps[mb] = p.parts["compute"] + p.parts["bubble"]
    one = m.compute.time(64)
    assert steps[1] == pytest.approx(one)  # one micro-batch: the stages take turns
    # each micro-batch pays the fixed cost of a call (10 ms here): 16 cost more than 4
    assert steps[4] < steps[1] < steps[16]
    # without it, the bubble's share falls with more micro-batches: (m + p - 1) / m of the ideal
    free = measured(
        compute=Compute(0.0, 0.001), all_reduce={2: Link(0.0, 1e18)}, p2p=Link(0.0, 1e18)
    )
    ideal = free.compute.time(64) / 2
    for mb in (1, 4, 16):
        p = pricing.predict(free, Setup("pipeline", 2, 2, mb, "1f1b", split))
        assert p.parts["compute"] + p.parts["bubble"] == pytest.approx(ideal * (mb + 1) / mb)
    looped = pricing.predict(m, Setup("pipeline", 2, 2, 4, "interleaved", split))
    assert (
        looped.parts["bubble"]
        < pricing.predict(m, Setup("pipeline", 2, 2, 4, "1f1b", split)).parts["bubble"]
    )


def test_a_pipeline_pays_crowding_only_while_its_processes_compute_at_once():
    """Processes of one machine slow each other while both compute: one micro-batch's stages take
    turns and pay nothing for it; the more micro-batches, the more of the step they share."""
    split = ("net.2",)
    free = {"all_reduce": {2: Link(0.0, 1e18)}, "p2p": Link(0.0, 1e18)}
    alone, crowded = measured(**free), measured(**free, crowding=1.2)

    def busy(m: Measured, mb: int, devices: int = 2) -> float:
        p = pricing.predict(m, Setup("pipeline", devices, 2, mb, "gpipe", split)).parts
        return p["compute"] + p["bubble"]

    assert busy(crowded, 1) == pytest.approx(busy(alone, 1))
    assert busy(crowded, 4) == pytest.approx(busy(alone, 4) * (1 + 0.2 * 3 / 5))
    assert busy(crowded, 16) == pytest.approx(busy(alone, 16) * (1 + 0.2 * 15 / 17))
    # copies of the pipeline compute side by side all the time
    assert busy(crowded, 1, devices=4) == pytest.approx(busy(alone, 1, devices=4) * 1.2)


def test_a_setup_that_does_not_fit_ranks_after_every_one_that_does():
    # 16 GB of parameters, gradients and optimizer state: one 10 GB device cannot hold them; 4
    # fsdp shards (4 GB each) can
    m = measured(
        param_bytes=4 * GB,
        grad_bytes=4 * GB,
        optimizer_bytes=8 * GB,
        device_memory=10 * GB,
        blocks=tuple(Block(f"net.{i}", 0.25, GB, 4096, True) for i in range(4)),
    )
    ranked = pricing.rank(m, pricing.candidates(m, 4))
    fitting = [p for p in ranked if p.fits]
    assert fitting and all(p.fits for p in ranked[: len(fitting)])
    single = next(p for p in ranked if p.setup.strategy == "single")
    assert not single.fits and single.reason.startswith("does not fit: 16.1 GB a device of 10.0 GB")
    assert any(p.setup == Setup("fsdp", 4) for p in fitting)
    assert ranked[0].fits


def test_every_candidate_the_measurements_allow_is_priced():
    m = measured()
    setups = pricing.candidates(m, 4)
    kinds = {(s.strategy, s.devices) for s in setups}
    assert {("single", 1), ("ddp", 2), ("ddp", 4), ("fsdp", 3), ("pipeline", 4)} <= kinds
    assert ("towers", 2) not in kinds  # towers and placement need GPUs
    assert all(s.strategy != "placement" for s in setups)
    with_gpus = {(s.strategy, s.devices) for s in pricing.candidates(measured(gpus=2), 2)}
    assert {("towers", 2), ("placement", 2)} <= with_gpus
    no_chain = {s.strategy for s in pricing.candidates(measured(blocks=()), 4)}
    assert "pipeline" not in no_chain


def test_the_partition_balances_the_slowest_stage():
    assert costs.partition([1.0, 1.0, 1.0, 3.0], 2, {1, 2, 3}, [True] * 4) == [3]
    assert costs.partition([1.0, 1.0, 1.0, 1.0], 2, {1, 3}, [True] * 4) == [1]  # 2 is no cut
    assert costs.partition([1.0, 1.0], 3, {1}, [True, True]) is None


def test_the_links_are_calibrated_to_what_a_ddp_step_paid():
    from phalanx.probes import calibrated

    m = measured(compute=Compute(0.0, 0.001), grad_bytes=256 << 10)
    bare = {"2": [0.001, 0.011]}  # 1 KiB in 1 ms; 256 KiB in 11 ms

    def found(alone: float, beside: float, step: float) -> dict:
        return {
            "all_reduce": bare,
            "p2p": [0.001, 0.002],
            "sizes": [1024, 256 << 10],
            "compute_alone": alone,
            "compute_side_by_side": beside,
            "ddp_step": step,
        }

    reduce = calibrated(m, found(0.032, 0.032, 0.0), 2).all_reduce[2].time(256 << 10)
    assert reduce == pytest.approx(0.011)
    # each process's 32 samples take 32 ms alone and 40 ms beside the other (1.25x); the ddp
    # step took that, the bare all-reduce, and 5 ms more: every step of several processes pays it
    slow = calibrated(m, found(0.032, 0.040, 0.040 + reduce + 0.005), 2)
    assert slow.crowding == pytest.approx(1.25) and slow.overlap == 0.0
    assert slow.sync_s == pytest.approx(0.005)
    ddp = pricing.predict(slow, Setup("ddp", 2))  # the model gives back the step it was shown
    assert ddp.parts["compute"] + ddp.parts["communication"] == pytest.approx(0.045 + reduce)
    fsdp = pricing.predict(slow, Setup("fsdp", 2))
    assert fsdp.parts["communication"] > slow.sync_s  # its own collectives, and the same wait
    # a step that took less than computing plus the bare reduction hid the rest behind backward
    hid = calibrated(m, found(0.032, 0.032, 0.032 + reduce / 2), 2)
    assert 0 < hid.overlap < 1 and hid.sync_s == 0.0
    ddp = pricing.predict(hid, Setup("ddp", 2))
    assert ddp.parts["communication"] == pytest.approx(reduce / 2)


def test_a_strategy_that_cannot_train_the_model_is_not_planned():
    m = measured(refused={"pipeline": "a tied weight", "placement": "a tied weight"})
    assert {s.strategy for s in pricing.candidates(m, 4)} == {"single", "ddp", "fsdp"}


def test_auto_accumulation_is_the_fewest_micro_batches_whose_peak_fits():
    # 400 MB of state and 1 MB of activations a sample: 64 samples need 464 MB, 16 need 416 MB
    m = measured(device_memory=420 << 20)
    single = pricing.fitting(m, Setup("single", 1))
    assert single.fits and single.accumulation == 4  # 2 micro-batches of 32 need 432 MB
    assert not pricing.predict(m, Setup("single", 1)).fits
    ddp = pricing.fitting(m, Setup("ddp", 2))  # 32 samples a process
    assert ddp.fits and ddp.accumulation == 2
    never = pricing.fitting(measured(device_memory=300 << 20), Setup("single", 1))
    assert not never.fits and never.accumulation == 64  # the state alone does not fit
    ranked = pricing.rank(m, pricing.candidates(m, 2), auto=True)
    assert all(p.fits for p in ranked)
    assert not all(p.fits for p in pricing.rank(m, pricing.candidates(m, 2)))


def test_schedules_of_two_stages_a_process_are_priced_on_twice_the_cuts():
    from phalanx.strategies.schedules import SCHEDULES
    from phalanx.strategies.staging import PipelineSettings

    m = measured(blocks=tuple(Block(f"net.{i}", 1 / 8, 1 << 20, 4096, True) for i in range(8)))
    setups = [s for s in pricing.candidates(m, 2) if s.strategy == "pipeline"]
    assert {s.schedule for s in setups} == set(SCHEDULES)
    for s in setups:
        # what strategy: plan writes into the config is a pipeline the settings accept, with the
        # stages its schedule runs on the processes
        settings = PipelineSettings(
            split=list(s.split), microbatches=s.microbatches, schedule=s.schedule
        )
        assert len(s.split) + 1 == s.stages * settings.stages_per_process, s
    v = pricing.predict(m, Setup("pipeline", 2, 2, 4, "zbv", ("net.2", "net.4", "net.6")))
    assert "4 stages on 2 processes" in v.reason
    assert v.parts["compute"] == pytest.approx(4 * 0.5 * m.compute.time(16))  # half each


def test_the_alternating_placement_is_planned_and_takes_turns():
    """Four stages alternating over two processes with one micro-batch (interleaved): a candidate,
    priced as the processes taking turns through the whole model, plus its crossings."""
    m = measured(crowding=1.3)
    setups = [s for s in pricing.candidates(m, 2) if s.schedule == "interleaved"]
    assert any(s.microbatches == 1 and len(s.split) == 3 for s in setups)
    alternating = next(s for s in setups if s.microbatches == 1)
    p = pricing.predict(m, alternating)
    whole = m.compute.time(64)  # one micro-batch of the whole batch, no crowding: they take turns
    assert p.parts["compute"] + p.parts["bubble"] == pytest.approx(whole)
    assert p.parts["communication"] > 0


def test_uneven_stages_fill_and_drain_through_every_stage_not_the_slowest_one_p_times():
    """Stages of 3/4 and 1/4 of the model: one micro-batch takes the whole model's time (the stages
    take turns), not twice the slower stage's; with more, each waits for the others' part once."""
    blocks = tuple(Block(f"net.{i}", 0.25, 25 << 20, 4096, True) for i in range(4))
    m = measured(blocks=blocks, all_reduce={2: Link(0.0, 1e18)}, p2p=Link(0.0, 1e18))
    uneven = ("net.3",)  # 3 blocks, then 1
    one = pricing.predict(m, Setup("pipeline", 2, 2, 1, "gpipe", uneven)).parts
    assert one["compute"] + one["bubble"] == pytest.approx(m.compute.time(64))
    four = pricing.predict(m, Setup("pipeline", 2, 2, 4, "gpipe", uneven)).parts
    whole = m.compute.time(16)
    assert four["compute"] == pytest.approx(4 * 0.75 * whole)
    assert four["bubble"] == pytest.approx(0.25 * whole)


@pytest.mark.parametrize(
    ("devices", "gpus", "chain"),
    [(4, 0, True), (4, 4, True), (4, 4, False), (1, 4, True), (4, 1, False)],
    ids=["cpu", "gpus", "gpus-no-chain", "one-device", "one-gpu-no-chain"],
)
def test_every_strategy_the_plan_leaves_out_is_said_with_why(devices, gpus, chain):
    """Each strategy is planned (it has a row) or in `not_planned` with its reason, never both and
    never neither."""
    from phalanx import planner
    from phalanx.strategies import registry

    m = measured(gpus=gpus, blocks=measured().blocks if chain else ())
    planned = {s.strategy for s in pricing.candidates(m, devices)}
    left = planner.unplanned(m, devices)
    assert planned.isdisjoint(left), (planned, left)
    assert planned | set(left) == set(registry.families()), (planned, left)
    assert all(why and "\n" not in why for why in left.values())
    if gpus < 2:
        assert "GPU" in left["towers"] and ("GPU" in left["placement"] or not chain)
    if not chain and devices > 1:
        assert "no chain of blocks" in left["pipeline"]


# --- recorded measurements ----------------------------------------------------------------------
# What `phalanx plan --devices 2` measured on a quiet 2-core machine (plans/*.json, the "measured"
# of its plan.json), priced again here: the ranking follows from the figures, not from the load of
# the machine running the tests. bench/plan_accuracy.py sets such predictions beside measured runs.
PLANS = Path(__file__).parent / "plans"


def recorded(name: str) -> Measured:
    return Measured.from_json(json.loads((PLANS / f"{name}.json").read_text())["measured"])


def test_a_small_mlp_whose_all_reduce_outweighs_its_step_is_fastest_on_one_device():
    """examples/digits' data through a 64-32-10 MLP, batches of 32: a step takes a fraction of a
    millisecond, less than the all-reduce of its gradients between two processes."""
    m = recorded("digits-mlp")
    ranked = pricing.rank(m, pricing.candidates(m, 2))
    assert ranked[0].setup == Setup("single", 1), [pricing.label(p.setup) for p in ranked[:3]]
    ddp = next(p for p in ranked if p.setup == Setup("ddp", 2))
    assert ddp.speedup < 1 and "of one device" in ddp.reason


def test_a_wide_mlp_whose_step_is_computation_is_fastest_on_two_processes_of_a_thread_each():
    """64 -> 512 -> 512 -> 512 -> 1 on batches of 1,024, at one thread a process: two processes
    halve the matrix products, beside an all-reduce of 2 MB."""
    m = recorded("wide-mlp-one-thread")
    ranked = pricing.rank(m, pricing.candidates(m, 2))
    assert ranked[0].setup == Setup("ddp", 2) and ranked[0].speedup > 1.2, ranked[0]
    single = next(p for p in ranked if p.setup == Setup("single", 1))
    assert single.speedup == 1.0 and single.parts["compute"] > 0


def test_one_process_with_every_core_computes_the_wide_mlp_as_fast_as_two():
    """The same MLP with the threads a run gets: one process alone has both cores, and two have
    one each; their products take as long, so the all-reduce decides for one process."""
    m = recorded("wide-mlp")
    ranked = pricing.rank(m, pricing.candidates(m, 2))
    assert ranked[0].setup == Setup("single", 1), [pricing.label(p.setup) for p in ranked[:3]]
    ddp = next(p for p in ranked if p.setup == Setup("ddp", 2))
    assert 0.5 < ddp.speedup < 1
    assert m.computes[2].per_sample_s > 1.5 * m.compute.per_sample_s  # a core each: slower


def test_a_plan_written_to_json_is_priced_again_the_same():
    """`Measured.from_json` reads what a plan wrote of its measurements: the same predictions."""
    m = measured(refused={"towers": "one GPU"}, sync_s=0.002)
    raw = json.loads(json.dumps(dataclasses.asdict(m)))  # as planner writes it: keys as strings
    again = Measured.from_json(raw)
    assert again == m
    assert [p.step_s for p in pricing.rank(again, pricing.candidates(again, 4))] == [
        p.step_s for p in pricing.rank(m, pricing.candidates(m, 4))
    ]


def test_the_pipeline_a_plan_times_splits_a_sequential_at_its_numbered_blocks(tmp_path):
    """A Sequential's blocks are named by number; the plan's timed pipeline names them as strings,
    which is what the config's split takes."""
    import toy

    from phalanx import config, probes

    path = toy.write_config(tmp_path, toy.regression_config())
    cfg, _ = config.load(path, probes.pipelined(["2", "net.4"]))
    assert cfg.parallel.strategy == "pipeline"
    settings = cfg.parallel.pipeline
    assert settings.split == ["2", "net.4"] and settings.microbatches == 4
