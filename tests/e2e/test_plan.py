"""`phalanx plan` end to end on CPU processes: what it measures and writes,
a run of `strategy: plan`, auto accumulation, and bad input as one line. No test here asserts which
setup is fastest: that is the machine's and its load's (see bench/plan_accuracy.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import forks
import pytest
import toy

from phalanx import costs, strategies
from phalanx.strategies import pricing

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(strategies.cpu_cores() < 2, reason="two CPU processes need two cores"),
]
EXAMPLES = Path(__file__).resolve().parents[2]

SMALL = {  # examples/digits' data, a 64-32-10 MLP: the gradients' all-reduce outweighs the step
    "name": "digits-mlp",
    "model": {"class": "toy.DigitsMLP", "hidden": 32},
    "optimizer": {"class": "SGD", "lr": 0.05},
    "dataset": {"class": "examples.digits.data.Digits", "batch_size": 32},
    "main_loop": {"epochs": 1, "extra_streams": []},
    "hooks": [],
}
WIDE = {  # 64 -> 512 -> 512 -> 512 -> 1 on batches of 1024: the step is computation
    "name": "wide-mlp",
    "model": {"class": "toy.Deep", "features": 64, "hidden": 512, "layers": 3},
    "optimizer": {"class": "SGD", "lr": 0.01},
    "dataset": {"class": "toy.Regression", "batch_size": 1024, "n_train": 4096, "features": 64},
    "main_loop": {"epochs": 1, "extra_streams": []},
    "hooks": [],
}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES), env.get("PYTHONPATH", "")])
    return forks.run(args, cwd, env, 300)


def test_plan_measures_this_machine_and_prices_what_it_measured(tmp_path):
    """`phalanx plan` measures the step, the links and the memory here, and ranks the setups by
    pricing those figures. Which setup is fastest depends on the machine and its load, so it is
    not asserted here: the ranking of recorded measurements is (tests/unit/test_costs.py), and
    the live comparison is bench/plan_accuracy.py. `phalanx bench`, which sets the plan's
    prediction beside what it measured, has its own test (tests/e2e/test_bench.py)."""
    path = toy.write_config(tmp_path, SMALL)
    planned = _run(["plan", str(path), "--devices", "2", "--output", "plan.json"], tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    # the links the prediction used were measured here, and the table says so
    links = plan["measured"]["all_reduce"]["2"]
    assert links["source"].startswith("measured") and links["bandwidth"] > 0
    assert "links: measured" in planned.stdout
    # the ranking is the cost model's on the figures the plan wrote: a plan can be priced again
    measured = costs.Measured.from_json(plan["measured"])
    again = pricing.rank(measured, pricing.candidates(measured, 2))
    assert [p["setup"] for p in plan["predictions"]] == [pricing.label(p.setup) for p in again]
    assert {"single", "ddp x2", "fsdp x2"} <= {p["setup"] for p in plan["predictions"]}
    single = next(p for p in plan["predictions"] if p["strategy"] == "single")
    assert single["speedup"] == 1.0 and single["parts_ms"]["compute"] > 0


@pytest.mark.parametrize(
    ("extra", "change", "message"),
    [
        ([], {"model": {"class": "toy.NoSuchModel"}}, "has no 'NoSuchModel'"),
        (["--devices", "64"], {}, "--devices 64: this machine has"),
        (["--nnodes", "1000000000"], {}, "plans for 1,024 at most; give --nnodes"),
        (["--link", "10"], {}, "--link '10' is not a known link; use one of ['ethernet-10g'"),
        # said before the minutes of measuring, not after them
        (["--output", "missing/plan.json"], {}, "folder 'missing' does not exist"),
    ],
    ids=[
        "model-that-does-not-build",
        "devices-the-machine-lacks",
        "machines-past-the-bound",
        "a-link-misspelt",
        "output-into-a-missing-folder",
    ],
)
def test_bad_input_is_one_line(tmp_path, extra, change, message):
    path = toy.write_config(tmp_path, {**SMALL, **change})
    result = _run(["plan", str(path), *extra], tmp_path)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "plan.json").exists()


def test_the_plan_says_what_it_measures_and_why_strategies_have_no_row(tmp_path):
    path = toy.write_config(tmp_path, SMALL)
    result = _run(["plan", str(path), "--devices", "1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan: timing one device's training step" in result.stderr, result.stderr
    said = [line for line in result.stdout.splitlines() if line.startswith("not planned: ")]
    named = {name for line in said for name in line.split(": ")[1].split(", ")}
    assert named == {
        "ddp",
        "fsdp",
        "mesh",
        "towers",
        "pipeline",
        "placement",
        "param_server",
    }, said
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan["not_planned"]) == named


def test_a_run_of_strategy_plan_trains_with_the_plans_choice_and_says_why(tmp_path):
    path = toy.write_config(tmp_path, SMALL)
    result = _run(["train", str(path), "parallel.strategy=plan", "output_root=runs"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list((tmp_path / "runs").iterdir())
    plan = json.loads((run / "plan.json").read_text())
    chosen = plan["predictions"][0]  # which one depends on the machine's load
    log = (run / "log.txt").read_text()
    assert f"parallel.strategy=plan chose {chosen['setup']}: predicted" in log
    assert f"strategy: {chosen['strategy']}" in (run / "config.yaml").read_text()  # what resumes


def test_auto_accumulation_trains_with_the_fewest_micro_batches_that_fit(tmp_path):
    """Devices of 8 MB: the wide MLP's 4.5 MB of parameters and gradients and the activations of
    1,024 samples (about 6.5 MB) do not fit in one micro-batch; the run takes the fewest that do,
    says so, and keeps the count in its config."""
    raw = {
        **WIDE,
        "dataset": {**WIDE["dataset"], "n_train": 2048},
        "parallel": {"gradient_accumulation": "auto", "device_memory_gb": 0.008},
    }
    path = toy.write_config(tmp_path, raw)
    result = _run(["train", str(path), "output_root=runs"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list((tmp_path / "runs").iterdir())
    said = [
        line
        for line in (run / "log.txt").read_text().splitlines()
        if "parallel.gradient_accumulation=auto chose" in line
    ]
    assert len(said) == 1, said
    count = int(said[0].split("chose ")[1].split(":")[0])
    assert count >= 2 and "of 8.2 MB a device" in said[0]
    assert f"gradient_accumulation: {count}" in (run / "config.yaml").read_text()
    # a device that holds nothing more than the state is one line, before any run is made
    raw["parallel"]["device_memory_gb"] = 0.001
    toy.write_config(tmp_path, raw)
    result = _run(["train", str(path), "output_root=runs2"], tmp_path)
    assert result.returncode != 0 and "found no count that fits" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs2").exists()
