"""The param_server strategy on real gloo processes: at staleness 0 exactly one process's training,
in float64; above 0, workers that do not wait for a slow one, within the bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402
from test_invariance import assert_same_run, rel, scenario  # noqa: E402
from test_weighted import lm  # noqa: E402

from phalanx import data  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SCENARIOS = {
    # 41 samples: the last batch of 1 is smaller than the workers
    "batch7": scenario(7, 1),
    "batch10-accum3": scenario(10, 3),
    "adamw-warmup-clipped": scenario(
        10,
        2,
        optimizer={
            "class": "AdamW",
            "lr": 0.01,
            "warmup_steps": 3,
            "momentum": None,
            "max_grad_norm": 0.05,
        },
    ),
    "weighted-tokens": lm(3, model="toy.WeighingLM"),
}


def served(raw: dict, devices: int, servers: int, staleness: int = 0) -> dict:
    parallel = {
        **raw["parallel"],
        "devices": devices,
        "strategy": "param_server",
        "param_server": {"servers": servers, "staleness": staleness},
    }
    return {**raw, "parallel": parallel}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {name: workers.train(raw) for name, raw in SCENARIOS.items()}


@pytest.mark.parametrize(
    ("devices", "servers"), [(3, 1), (4, 2)], ids=["1-server-2-workers", "2-servers-2-workers"]
)
def test_staleness_zero_trains_as_one_process(devices, servers, reference):
    raws = [served(raw, devices, servers) for raw in SCENARIOS.values()]
    per_rank = workers.run_ranks(devices, workers.train_all, raws)
    for rank_results in per_rank[: devices - servers]:  # every worker: the same run as one process
        for name, got in zip(SCENARIOS, rank_results, strict=True):
            if name == "weighted-tokens":  # compared below: its valid stream is not of 10
                continue
            assert_same_run(got, reference[name])
            # a gathering hook sees each global batch whole, in dataset order, on every worker
            assert got["ids"] == reference[name]["ids"], name
    for name in ("weighted-tokens",):
        got, want = per_rank[0][list(SCENARIOS).index(name)], reference[name]
        for key, value in want["params"].items():
            assert rel(torch.tensor(got["params"][key]), torch.tensor(value)) < 1e-10, key
        assert rel(torch.tensor(got["losses"]), torch.tensor(want["losses"])) < 1e-10
        assert got["epochs"][-1]["train"]["loss"] == pytest.approx(
            want["epochs"][-1]["train"]["loss"], rel=1e-10
        )


def test_workers_that_do_not_wait_for_a_slow_one_stay_within_the_bound_and_learn():
    """Staleness 2, worker 1 computing slower (20 ms more a chunk): worker 0 takes more of each
    batch and runs ahead, every gradient is at most 2 updates old (the logged histogram), every sample is trained
    on once an epoch, and the digits are learnt."""
    raw = {
        "name": "digits",
        "model": {"class": "toy.SlowDigitsMLP", "hidden": 64, "rank": 1, "seconds": 0.02},
        "optimizer": {"class": "AdamW", "lr": 0.01},
        "dataset": {"class": "toy.DigitsWithIds", "batch_size": 64},
        "main_loop": {"epochs": 6, "extra_streams": ["test"]},
        "hooks": [],
    }
    raw = served({**raw, "parallel": {"accelerator": "cpu"}}, 3, 1, staleness=2)
    first, second, _ = workers.run_ranks(3, workers.dealt, raw, timeout=300)
    n_train = len(toy.DigitsWithIds().streams()["train"])
    for epoch, (mine, theirs) in enumerate(zip(first["ids"], second["ids"], strict=True)):
        assert sorted(mine + theirs) == list(range(n_train)), epoch  # each sample once
        assert len(mine) > 1.5 * len(theirs)  # the fast worker took more
    lines = [line for line in first["lines"] if line.startswith("param_server | ")]
    assert len(lines) == 6  # an epoch each
    staleness = {
        int(k): int(v)
        for line in lines
        for k, v in (pair.split(": ") for pair in line.split("old): ")[1].split("; ")[0].split(", "))
    }
    assert max(staleness) <= 2 and any(k > 0 for k in staleness), lines
    assert first["metrics"]["test.accuracy"] >= 0.95
    assert not [line for line in second["lines"] if line.startswith("param_server | ")]
