"""The invariance contract on real gloo processes: world sizes 2, 3 and 4 against one process, in
float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import data  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# 41 = 5 * 8 + 1: the last batch (1 sample) is smaller than every world size
N_TRAIN, N_VALID = 41, 10


def scenario(batch: int, accumulation: int, **extra) -> dict:
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={
            "class": "toy.Regression",
            "batch_size": batch,
            "n_train": N_TRAIN,
            "n_valid": N_VALID,
        },
        parallel={"accelerator": "cpu", "devices": 1, "gradient_accumulation": accumulation},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )
    for key, value in extra.items():
        merged = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
        raw[key] = (
            {k: v for k, v in merged.items() if v is not None}
            if isinstance(merged, dict)
            else merged
        )
    return raw


SCENARIOS = {
    **{f"batch{b}-accum{k}": scenario(b, k) for b in (7, 8, 10) for k in (1, 3)},
    "sync-batchnorm": scenario(
        8,
        1,
        model={"class": "toy.BatchNormNet", "features": 3, "hidden": 6},
        dataset={"n_train": 40},
    ),
    "adamw-warmup": scenario(
        10, 2, optimizer={"class": "AdamW", "lr": 0.01, "warmup_steps": 3, "momentum": None}
    ),
    # buckets far smaller than a parameter: every gradient reduced in a bucket of its own
    "ddp-small-buckets": scenario(7, 1, parallel={"ddp": {"bucket_cap_mb": 1e-6}}),
}


def for_world(raw: dict, world_size: int) -> dict:
    out = {**raw, "parallel": {**raw["parallel"], "devices": world_size}}
    if raw["model"]["class"] == "toy.BatchNormNet" and world_size > 1:
        out["parallel"] = {**out["parallel"], "sync_batchnorm": True}
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {name: workers.train(raw) for name, raw in SCENARIOS.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_same_run(got: dict, want: dict) -> None:
    for name, value in want["params"].items():
        if name.endswith("num_batches_tracked"):
            continue
        assert rel(torch.tensor(got["params"][name]), torch.tensor(value)) < 1e-10, name
    assert len(got["losses"]) == len(want["losses"])
    assert rel(torch.tensor(got["losses"]), torch.tensor(want["losses"])) < 1e-10
    for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):
        assert (
            mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID
        )  # every sample once
        assert mine["train"]["loss_count"] == theirs["train"]["loss_count"]
        assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
            theirs["valid"]["loss"]
        )


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_world_size_trains_as_one_process(world_size, reference):
    raws = [for_world(raw, world_size) for raw in SCENARIOS.values()]
    per_rank = workers.run_ranks(world_size, workers.train_all, raws)
    for rank_results in per_rank:  # every rank holds the same parameters and sees the same losses
        for name, got in zip(SCENARIOS, rank_results, strict=True):
            assert_same_run(got, reference[name])
    for name, got in zip(SCENARIOS, per_rank[0], strict=True):
        raw = SCENARIOS[name]
        batch, n_train = raw["dataset"]["batch_size"], raw["dataset"]["n_train"]
        for epoch, seen in enumerate(_epochs(got["ids"]["train"], -(-n_train // batch)), start=1):
            order = data.permutation(raw.get("seed", 0), epoch, n_train)
            # dataset order, each sample once
            assert [i for step in seen for i in step] == order, name
        assert got["ids"]["valid"][:1] and sorted(
            i for b in got["ids"]["valid"] for i in b
        ) == sorted(list(range(N_VALID)) * 2)


def _epochs(steps: list[list[int]], per_epoch: int) -> list[list[list[int]]]:
    return [steps[i : i + per_epoch] for i in range(0, len(steps), per_epoch)]


def test_shard_weights_give_the_same_training(reference):
    raw = for_world(SCENARIOS["batch10-accum1"], 3)
    raw["parallel"]["shard_weights"] = [1, 2, 3]
    per_rank = workers.run_ranks(3, workers.train_all, [raw])
    for rank_results in per_rank:
        assert_same_run(rank_results[0], reference["batch10-accum1"])


def test_sync_batchnorm_with_an_empty_shard_is_a_clear_error_not_a_hang():
    raw = for_world(SCENARIOS["sync-batchnorm"], 4)
    raw["dataset"] = {
        **raw["dataset"],
        "n_train": N_TRAIN,
    }  # the last batch has 1 sample for 4 processes
    with pytest.raises(
        AssertionError, match="sync_batchnorm needs a sample for each of the 4 processes"
    ):
        workers.run_ranks(4, workers.train_all, [raw], timeout=120)


def test_the_loss_and_stop_flag_through_autograd_give_the_same_training(reference):
    """On a torch whose DDP reducer cannot be told directly that the carrier's gradient is ready,
    the carrier goes through autograd: the same parameters and losses, uneven shards, empty ones and
    accumulation included."""
    names = ["batch7-accum3", "batch10-accum1"]
    per_rank = workers.run_ranks(
        3, workers.train_all, [for_world(SCENARIOS[n], 3) for n in names], True
    )
    for rank_results in per_rank:
        for name, got in zip(names, rank_results, strict=True):
            assert_same_run(got, reference[name])


@pytest.mark.parametrize("through_autograd", [False, True], ids=["reducer", "autograd"])
def test_a_stop_asked_on_one_rank_stops_every_rank_after_the_same_step(through_autograd):
    """The stop flag travels with the gradients: rank 2 alone asks after step 3; every rank takes
    step 4 (which carries the flag), then saves and exits with SIGTERM's code."""
    raw = for_world(SCENARIOS["batch8-accum3"], 3)
    ends = workers.run_ranks(3, workers.stop_on_one_rank, raw, 2, 3, through_autograd, timeout=120)
    assert [end["code"] for end in ends] == [143, 143, 143]
    assert [end["step"] for end in ends] == [4, 4, 4]
    assert (
        ends[0]["losses"] == ends[1]["losses"] == ends[2]["losses"]
    )  # the same global loss everywhere


@pytest.mark.parametrize("wait_in_backward", [True, False])
def test_log_profile_reports_the_gradient_all_reduce(wait_in_backward):
    """Waited for inside backward (DDP's reducer by itself, as on GPUs): DDP's sampled timing of
    it; started in backward and waited for after it (ddp on CPUs): the wait is the step's
    communication, in the share of the training time."""
    raw = for_world(SCENARIOS["batch8-accum1"], 2)
    first, second = workers.run_ranks(
        2, workers.profile_lines, raw, wait_in_backward, timeout=120
    )
    reported = [line for line in first["lines"] if "gradient all-reduce in backward" in line]
    assert not [line for line in second["lines"] if "gradient all-reduce" in line]
    if wait_in_backward:
        comm, overlap = first["sampled"]
        assert comm > 0 and 0 <= overlap
        # at most once per epoch, on rank 0, when a sample changed it
        assert 1 <= len(reported) <= 2, reported
        for line in reported:  # DDP's averages cover the run so far, and say so
            assert line.startswith(
                "gradient all-reduce in backward, DDP's sampled average over the run so far"
            )
        assert "ms per step" in reported[-1] and "hidden behind computation" in reported[-1]
        # the last line is DDP's average at the end
        assert f"{1e3 * comm:.2f} ms per step" in reported[-1]
    else:  # nothing is waited for in backward: the share below counts the wait after it
        assert first["sampled"] is None and not reported
    # once a run, the share of the step spent communicating (a 3-weight model's step is mostly
    # communication, though on a busy machine the step's other parts may outweigh it), and where
    # it is more than half, what one device would take instead
    shares = [line for line in first["lines"] if line.startswith("communication | ")]
    assert len(shares) == 1 and "% of the training time" in shares[0]
    share = float(shares[0].split("communication | ")[1].split("%")[0])
    warned = [line for line in first["lines"] if "more than half of each step waits" in line]
    if share != 50:  # the share is printed rounded: at 50 either is right
        assert len(warned) == (1 if share > 50 else 0), (shares, warned)
    for line in warned:
        assert "one device would take about" in line
        assert "times 2, no communication" in line and "phalanx plan" in line
    assert not [line for line in second["lines"] if line.startswith("communication | ")]


def test_stop_after_minutes_stops_every_rank_at_the_same_agreement_step():
    """Rank 1's clock runs out first; the ranks agree every 10 steps, so both stop at step 10."""
    raw = for_world(SCENARIOS["batch8-accum1"], 2)
    raw["main_loop"] = {**raw["main_loop"], "epochs": 5}  # 6 steps an epoch: 30 in all
    ends = workers.run_ranks(2, workers.stop_after_minutes, raw, timeout=120)
    assert ends == [{"code": 0, "step": 10}, {"code": 0, "step": 10}]


def test_ddp_on_the_cpu_reads_the_next_batch_while_the_gradients_are_reduced():
    """On the CPU, ddp's step reads the next step's batch while its gradient all-reduce runs: by a
    step's after_batch a rank has read that step's items and the next one's, but at an epoch's
    last step; one process, whose step waits on nothing, reads each batch in its turn. The time
    counts as the profile's data time. (That it trains as one process: the scenarios above, whose
    ddp-small-buckets reduces several buckets a step.)"""
    raw = scenario(8, 1, dataset={"class": "toy.CountedRegression"})
    got = workers.run_ranks(2, workers.reads_seen, for_world(raw, 2))
    alone = workers.reads_seen(0, raw)
    for rank, world, run in ((0, 2, got[0]), (1, 2, got[1]), (0, 1, alone)):
        expected, total = [], 0
        for epoch in (1, 2):
            plan = data.Plan(data.epoch_order(raw.get("seed", 0), epoch, N_TRAIN), 8, 1, rank, world)
            sizes = [sum(len(m.shard) for m in plan.step(k)) for k in range(len(plan))]
            for k, size in enumerate(sizes):
                ahead = sizes[k + 1] if world > 1 and k + 1 < len(sizes) else 0
                expected.append(total + size + ahead)
                total += size
        assert run["reads"] == expected, (rank, world)
        assert all(profile["data"] > 0 for profile in run["profiles"])
