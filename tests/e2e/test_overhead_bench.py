"""The two CPU overhead benchmarks end to end at tiny sizes, in real processes: every loop runs
every chunk it should, both learn the same task, and the JSON's figures agree with one another. The
figures themselves are measurements, recorded in BENCHMARKS.md, not asserted here. The instruction
counter's variants run natively (callgrind itself takes minutes), its reading of callgrind's
dumps is checked on dumps written here, and its opcode census on functions of known bytecode."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import forks
import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.timeout(300)


def run_bench(tmp_path: Path, script: str, *args: str) -> str:
    """Run a benchmark at a tiny size; what it printed (it must succeed)."""
    result = forks.run(list(args), tmp_path, ENV, 240, script=REPO / "bench" / script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def run_script(
    tmp_path: Path, script: str, *args: str, out_flag: str = "--output"
) -> tuple[str, dict]:
    """Run a benchmark at a tiny size; what it printed and the report it wrote."""
    out = tmp_path / "report.json"
    said = run_bench(tmp_path, script, *args, out_flag, str(out))
    return said, json.loads(out.read_text())


def run(tmp_path: Path, script: str, *args: str) -> dict:
    said, report = run_script(tmp_path, script, *args, out_flag="--out")
    assert "target: phalanx" in said
    return report


def targets_table(results: Path) -> dict[str, str]:
    """bench/targets.py's table of the results in `results`: each row by its file's name."""
    script = REPO / "bench" / "targets.py"
    table = forks.run(["--results", str(results)], REPO, ENV, 60, script=script)
    assert table.returncode == 0, table.stderr
    return {line.split()[0]: line for line in table.stdout.splitlines() if ".json" in line}


def check_figures(entry: dict, chunks: int) -> None:
    wall = entry["wall"]
    assert len(wall["per_chunk_ms_per_step"]) == chunks
    assert all(t > 0 for t in wall["per_chunk_ms_per_step"])
    assert wall["ms_per_step"]["min"] <= wall["ms_per_step"]["median"] <= wall["ms_per_step"]["max"]
    assert wall["ratio_vs_hand"]["median"] > 0 and wall["ratio_of_totals"] > 0


def test_ddp_overhead_runs_both_loops_chunk_by_chunk_on_two_processes(tmp_path):
    steps, chunk, rounds = 20, 10, 2
    report = run(
        tmp_path,
        "ddp_overhead.py",
        "--steps",
        str(steps),
        "--chunk",
        str(chunk),
        "--rounds",
        str(rounds),
        "--warmup",
        "1",
    )
    results, chunks = report["results"], rounds * steps // chunk
    assert report["settings"]["processes"] == 2 and report["settings"]["chunk"] == chunk
    for name in ("hand DDP", "phalanx ddp"):
        check_figures(results[name], chunks)
        assert len(results[name]["wall"]["per_rank_ms_per_step"]) == 2
    assert results["hand DDP"]["wall"]["ratio_vs_hand"]["median"] == 1.0
    assert len(results["phalanx incl. epoch end"]["wall"]["per_epoch_ms_per_step"]) == rounds
    assert report["target"]["met"] == (
        report["target"]["phalanx_ratio"] <= report["target"]["phalanx_ratio_max"]
    )
    assert report["phalanx_checkpoints"], "phalanx's SaveLatest wrote no checkpoint"
    loss = report["final_epoch_loss"]["hand DDP"]
    assert math.isfinite(loss) and loss < math.log(10)  # below chance on 10 classes: it learned


def _perf_samples_here(tmp_path: Path) -> str | None:
    """Why Linux perf cannot sample this user's processes here (None: it can)."""
    if shutil.which("perf") is None:
        return "Linux perf is not installed"
    data = tmp_path / "probe.data"
    probe = subprocess.run(
        ["perf", "record", "-q", "-e", "cpu-clock", "-o", str(data), "--", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if probe.returncode == 0 else f"perf cannot sample here: {probe.stderr[-200:]}"


def test_ddp_overhead_samples_give_each_loop_its_cpu_by_library(tmp_path):
    why = _perf_samples_here(tmp_path)
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "report.json"
    said = run_bench(
        tmp_path,
        "ddp_overhead.py",
        *("--steps", "20", "--chunk", "10", "--rounds", "2", "--warmup", "1"),
        *("--samples", "--samples-hz", "2000", "--out", str(out)),
    )
    assert "target: phalanx" in said
    table = said[said.index("CPU samples in the measured windows") :].splitlines()
    rows = {line[:36].strip(): line[36:].split() for line in table[2:]}
    # the interpreter: a shared libpython, or the python executable where it is linked in
    interpreter = next(name for name in rows if name.startswith(("libpython", "python")))
    hand, phalanx, difference = rows[interpreter]
    assert int(hand.replace(",", "")) > 0 and int(phalanx.replace(",", "")) > 0
    assert int(difference.replace(",", "")) == int(phalanx.replace(",", "")) - int(
        hand.replace(",", "")
    )
    assert "other threads" in rows and "main threads, all" in rows
    assert not out.exists()  # a sampled run's figures are not kept


def test_fsdp_overhead_runs_phalanx_fsdp_against_a_hand_fsdp2_loop(tmp_path):
    steps, chunk, rounds = 20, 10, 2
    report = run(
        tmp_path,
        "ddp_overhead.py",
        "--strategy",
        "fsdp",
        "--steps",
        str(steps),
        "--chunk",
        str(chunk),
        "--rounds",
        str(rounds),
        "--warmup",
        "1",
    )
    results = report["results"]
    assert (
        report["settings"]["strategy"] == "fsdp" and report["target"]["phalanx_ratio_max"] == 1.10
    )
    assert report["phalanx_config"]["parallel"]["strategy"] == "fsdp"
    for name in ("hand FSDP2", "phalanx fsdp"):
        check_figures(results[name], rounds * steps // chunk)
    assert report["phalanx_checkpoints"], "phalanx's SaveLatest wrote no checkpoint"
    loss = report["final_epoch_loss"]["hand FSDP2"]
    assert math.isfinite(loss) and loss < math.log(10)


def test_single_process_overhead_runs_the_hand_loop_and_phalanx_chunk_by_chunk(tmp_path):
    steps, chunk, rounds = 20, 10, 2
    report = run(
        tmp_path,
        "overhead.py",
        "--steps",
        str(steps),
        "--chunk",
        str(chunk),
        "--rounds",
        str(rounds),
    )
    chunks = rounds * steps // chunk
    for name in ("hand loop", "phalanx"):
        check_figures(report["results"][name], chunks)
    assert report["settings"]["chunk"] == chunk
    loss = report["final_epoch_loss"]["hand loop"]
    assert math.isfinite(loss) and loss < math.log(10)
    # make bench's table of targets reads the report: its ratio, target and verdict
    results = tmp_path / "results"
    results.mkdir()
    (results / "overhead.json").write_text((tmp_path / "report.json").read_text())
    rows = targets_table(results)
    target = report["target"]
    verdict = "met" if target["met"] else "NOT met"
    assert f"{target['phalanx_ratio']:.3f}x  <= 1.05x  {verdict}" in rows["overhead.json"]
    assert "no such file" in rows["ddp_overhead.json"]


def test_the_public_overhead_runs_phalanx_fit_with_every_default_hook(tmp_path):
    """`--public`: phalanx as a user's script runs it, `phalanx.fit` with the default hooks
    (ShowProgress and the console log too) and the benchmark's driver after them; its own target
    (1.10x) and its own row in make bench's table."""
    steps, chunk, rounds = 20, 10, 2
    said, report = run_script(
        tmp_path,
        "overhead.py",
        "--public",
        "--steps",
        str(steps),
        "--chunk",
        str(chunk),
        "--rounds",
        str(rounds),
        out_flag="--out",
    )
    assert "target: phalanx <= 1.10x" in said
    assert report["benchmark"] == "overhead_public" and report["settings"]["public"]
    assert "ShowProgress" in report["phalanx_hooks"] and report["phalanx_hooks"][-1] == "Driver"
    assert "hooks" not in report["phalanx_config"]  # the defaults, as the config leaves them
    for name in ("hand loop", "phalanx"):
        check_figures(report["results"][name], rounds * steps // chunk)
    assert report["phalanx_checkpoints"], "phalanx's SaveLatest wrote no checkpoint"
    results = tmp_path / "results"
    results.mkdir()
    (results / "overhead_public.json").write_text((tmp_path / "report.json").read_text())
    target = report["target"]
    assert target["phalanx_ratio_max"] == 1.10
    verdict = "met" if target["met"] else "NOT met"
    row = targets_table(results)["overhead_public.json"]
    assert f"{target['phalanx_ratio']:.3f}x  <= 1.10x  {verdict}" in row


def test_instruction_counter_runs_every_variant(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from instructions import VARIANTS

    said = run_bench(
        tmp_path,
        "instructions.py",
        "--native",
        "--steps",
        "2",
        "--epochs",
        "1",
        "--warmup",
        "1",
        "--epoch-steps",
        "3",
        "--variants",
        ",".join(VARIANTS),
    )
    assert [
        line.split(":")[0] for line in said.splitlines() if "calls, not counted" in line
    ] == VARIANTS


def test_instruction_counter_runs_the_ddp_steps_in_a_group_of_two(tmp_path):
    """--world-size 2: rank 0 counts (here natively) while rank 1 runs the same steps beside it;
    only the ddp steps can, and anything else is refused before a process starts."""
    said = run_bench(
        tmp_path,
        "instructions.py",
        "--native",
        "--world-size",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--variants",
        "hand-ddp-step,phalanx-ddp-step",
    )
    ran = [line for line in said.splitlines() if "calls, not counted" in line]
    assert [line.split(":")[0] for line in ran] == ["hand-ddp-step", "phalanx-ddp-step"]
    assert all(line.endswith("(--native, rank 0 of 2)") for line in ran), ran
    refused = forks.run(
        ["--world-size", "2", "--variants", "hand-step"],
        tmp_path,
        ENV,
        60,
        script=REPO / "bench" / "instructions.py",
    )
    assert refused.returncode == 2 and "counts the ddp steps alone" in refused.stderr


def test_instruction_counter_reads_the_main_threads_dumps(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from instructions import counts

    def dump(name: str, thread: int, label: str, total: int) -> None:
        (tmp_path / f"{name}-{thread:02d}").write_text(
            f"version: 1\ncmd: python\npart: 1\ndesc: Trigger: Client Request: {label}\nthread: "
            f"{thread}\nevents: Ir\nsummary: {total}\n"
        )

    dump("out.1", 1, "hand-step", 4_000_000)
    dump("out.1", 2, "hand-step", 9_999_999)  # gloo's thread: left out
    dump("out.2", 1, "phalanx-step", 4_400_000)
    (tmp_path / "out.3-01").write_text(
        "version: 1\ncmd: python\n"
    )  # no client request: not a variant
    assert counts(tmp_path) == {"hand-step": 4_000_000, "phalanx-step": 4_400_000}


def test_the_ddp_steps_counted_in_a_group_of_two_are_a_row_of_the_targets_table(tmp_path):
    """Counted at world size 2, both ddp steps' instructions a step are written against the ddp
    step's target in instructions (at most the hand step's), where the targets table reads them;
    any other count writes nothing."""
    sys.path.insert(0, str(REPO / "bench"))
    from instructions import write_target

    found = {"hand-ddp-step": {"Ir": 4_000_000}, "phalanx-ddp-step": {"Ir": 3_960_000}}
    path = tmp_path / "ddp_instructions.json"
    args = argparse.Namespace(world_size=2, steps=10, output=path, port=1, rank=0, worker=False)
    written = write_target(found, args, path)
    assert written is not None and json.loads(path.read_text()) == written
    assert written["instructions_per_step"] == {
        "hand-ddp-step": 400_000,
        "phalanx-ddp-step": 396_000,
    }
    assert written["target"] == {"phalanx_ratio": 0.99, "phalanx_ratio_max": 1.0, "met": True}
    assert "port" not in written["args"] and written["args"]["output"] == str(path)
    row = targets_table(tmp_path)["ddp_instructions.json"]
    assert "in instructions (callgrind): hand DDP step *" in row and "0.990x  <= 1.00x  met" in row
    grown = {**found, "phalanx-ddp-step": {"Ir": 4_000_001}}
    assert not write_target(grown, args, path)["target"]["met"]
    path.unlink()
    one = argparse.Namespace(world_size=1, steps=10)
    assert write_target(found, one, path) is None and not path.exists()
    assert write_target({"hand-ddp-step": {"Ir": 1}}, args, path) is None and not path.exists()


def test_instruction_counter_reads_the_cache_misses_and_reports_them_a_step(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    from instructions import events, report

    kinds = "Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw"
    for i, (label, values) in enumerate(
        [
            ("hand-step", "4000 900 400 90 80 20 10 200 100"),
            ("phalanx-step", "4400 1 1 1 1 1 30 260 110"),
        ]
    ):
        (tmp_path / f"out.{i + 1}-01").write_text(
            f"version: 1\ndesc: Trigger: Client Request: {label}\nevents: {kinds}\n"
            f"summary: {values}\n"
        )
    found = events(tmp_path)
    assert found["hand-step"]["DLmw"] == 100 and found["phalanx-step"]["Ir"] == 4400
    report(found, argparse.Namespace(cache=True, steps=10, epochs=1, epoch_steps=1))
    said = capsys.readouterr().out
    # a step: 440 against 400 instructions, 40 against 31 last-level misses
    row = next(line for line in said.splitlines() if line.startswith("phalanx-step - hand-step"))
    assert row.split()[3:] == ["+40", "1.100", "+9", "1.290"]


def test_opcode_census_counts_each_functions_bytecode_alike_on_every_run(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from instructions import opcode_census

    def loop(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    ten, again, twenty = (opcode_census(lambda n=n: loop(n), 3) for n in (10, 10, 20))
    mine = {k: c for k, c in ten.items() if k[2] == "loop"}
    assert len(mine) == 1 and ten == again
    key = next(iter(mine))
    # each of the ten more turns runs the same few opcodes, three calls over
    per_turn = (twenty[key] - ten[key]) / 30
    assert per_turn == int(per_turn) and per_turn >= 3

    said = run_bench(
        tmp_path,
        "instructions.py",
        "--opcodes",
        "5",
        "--variants",
        "hand-step,phalanx-step",
        "--steps",
        "2",
        "--warmup",
        "1",
    )
    totals = {
        line.split(":")[0]: float(line.split()[1].replace(",", ""))
        for line in said.splitlines()
        if line.endswith("Python opcodes a step")
    }
    assert set(totals) == {"hand-step", "phalanx-step"} and totals["hand-step"] > 1000
    listed = said.split("phalanx-step - hand-step")[1].splitlines()[1:]
    assert len(listed) == 5 and any("engine.py" in line for line in listed)


def test_largest_model_search_trains_each_trial_through_phalanx_train(tmp_path):
    """The GPU benchmark's machinery at tiny sizes on the CPU: fsdp on one process with offload and
    a meta-device build trains the example decoder (tied weights) at each size the search tries."""
    out = tmp_path / "largest.json"
    run_bench(
        tmp_path,
        "largest_model.py",
        "--smoke",
        "--mode",
        "fsdp-offload",
        "--max-layers",
        "3",
        "--out",
        str(out),
    )
    found = json.loads(out.read_text())["modes"]["fsdp-offload"]
    assert [t["layers"] for t in found["trials"]] == [1, 2, 3] and all(
        t["fits"] for t in found["trials"]
    )
    assert found["largest_layers"] == 3 and found["capped_at_max_layers"]
    assert (
        found["largest_parameters"]
        == found["trials"][-1]["parameters"]
        > found["trials"][0]["parameters"]
    )


def test_async_checkpoint_benchmark_times_the_three_runs(tmp_path):
    out = tmp_path / "async.json"
    run_bench(
        tmp_path,
        "async_checkpoints.py",
        "--hidden",
        "1000",
        "--steps",
        "10",
        "--every",
        "2",
        "--rounds",
        "1",
        "--out",
        str(out),
    )
    results = json.loads(out.read_text())["results"]
    assert list(results) == [
        "no checkpoints",
        "saved in the training thread",
        "saved in the background",
    ]
    assert results["no checkpoints"]["ratio"] == 1.0 and all(
        r["ms_per_step"] > 0 for r in results.values()
    )


def test_placement_benchmark_times_every_setup_against_one_device(tmp_path):
    said, report = run_script(
        tmp_path, "placement.py", "--batch", "64", "--steps", "1", "--rounds", "2"
    )
    rows = report["rows"]
    assert list(rows) == [
        "one device",
        "naive placement",
        "exaggerated placement",
        "pipeline, 4 micro-batches",
        "pipeline, 8 micro-batches",
        "hand-written, 8 micro-batches",
    ]
    assert rows["one device"]["ratio"] == 1.0
    for name, row in rows.items():
        assert len(report["times"][name]) == 2 and row["ms"] > 0, name
        assert ("to_bound" in row) == ("micro-batches" in name), name
    for name in ("pipeline, 4 micro-batches", "pipeline, 8 micro-batches"):
        stages = report["stages"]["side by side"][name]
        assert len(stages["forward_backward"]) == len(stages["optimizer"]) == 2
    assert "targets: naive placement slower than one device:" in said


def test_pipeline_overhead_benchmark_runs_both_loops(tmp_path):
    said, report = run_script(tmp_path, "pipeline_overhead.py", "--steps", "2", "--rounds", "2")
    assert set(report["times"]) == {"hand", "phalanx"}
    assert all(len(t) == 2 and min(t) > 0 for t in report["times"].values())
    assert len(report["ratios"]) == 2 and "target: <= 1.10x" in said
    # the target's pairing (the hand loop without an agreement), which make bench's table reads
    target = report["target"]
    assert target["phalanx_ratio"] == statistics.median(report["ratios"])
    assert target["phalanx_ratio_max"] == 1.10
    results = tmp_path / "results"
    results.mkdir()
    (results / "pipeline_overhead.json").write_text((tmp_path / "report.json").read_text())
    row = targets_table(results)["pipeline_overhead.json"]
    assert f"{target['phalanx_ratio']:.3f}x  <= 1.10x" in row


def test_a_pipeline_benchmark_whose_hand_loop_agrees_claims_no_target(tmp_path):
    said, report = run_script(
        tmp_path, "pipeline_overhead.py", "--steps", "2", "--rounds", "2", "--hand-agrees", "late"
    )
    assert "target" not in report and "not this run (its hand loop agrees)" in said


def test_the_pipelines_agreement_cost_times_the_hand_loop_against_itself(tmp_path):
    """--agreement-cost: the hand loop without an agreement, then agreeing late, now, and on
    every 2 steps at once, each a ratio to the first; no phalanx step, and no report written."""
    out = tmp_path / "report.json"
    said = run_bench(
        tmp_path,
        "pipeline_overhead.py",
        "--agreement-cost",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--every",
        "2",
        "--output",
        str(out),
    )
    rows = [line for line in said.splitlines() if line.startswith("hand, ")]
    assert [row.split("  ")[0] for row in rows] == [
        "hand, no agreement",
        "hand, late agreement",
        "hand, now agreement",
        "hand, late, every 2 steps",
    ]
    assert "ratio 1.000x" in rows[0] and "phalanx" not in said
    assert not out.exists()


def test_the_pipelines_opcode_census_counts_each_stage_alike_on_every_run(tmp_path):
    """--opcodes: each stage's Python opcodes a step in both loops, the same on two runs (a count,
    not a time), with the stage's own functions named; no report written."""
    out = tmp_path / "report.json"

    def census() -> list[str]:
        said = run_bench(
            tmp_path, "pipeline_overhead.py", "--opcodes", "2", "--top", "40", "--output", str(out)
        )
        return [line for line in said.splitlines() if line.startswith(("stage", "  "))]

    first = census()
    assert [line.split(":")[0] for line in first if line.startswith("stage")] == [
        "stage 0",
        "stage 1",
    ]
    assert any("strategies/stages.py: forward" in line for line in first)
    assert census() == first and not out.exists()


def test_the_targets_table_says_what_it_cannot_read_and_goes_on(tmp_path):
    """A results file that holds no figure, or no commit, is a row that says so; the table is
    printed whatever the files hold."""
    (tmp_path / "overhead.json").write_text(
        json.dumps({"target": {"phalanx_ratio": None, "phalanx_ratio_max": 1.05}})
    )
    (tmp_path / "ddp_overhead.json").write_text(
        json.dumps(
            {
                "target": {"phalanx_ratio": 1.2, "phalanx_ratio_max": 1.03},
                "source": None,
                "machine": {"processor": "Intel(R) Xeon(R) Processor", "cpu_count": 2},
            }
        )
    )
    rows = targets_table(tmp_path)
    assert "unreadable" in rows["overhead.json"]
    assert "1.200x" in rows["ddp_overhead.json"] and "NOT met" in rows["ddp_overhead.json"]
    assert rows["ddp_overhead.json"].rstrip().endswith("Intel Xeon, 2 CPUs  ?")
    assert "no such file" in rows["mesh_overhead.json"]
    # the rows make bench does not measure are marked, and their commands given at the foot
    assert "hand TP + FSDP2 loop *" in rows["mesh_overhead.json"]
    assert " *" not in rows["ddp_overhead.json"]
    said = rows["mesh_overhead.json:"]
    assert said.strip().endswith("bench/ddp_overhead.py --strategy mesh --rounds 20")
