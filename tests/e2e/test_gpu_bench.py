"""bench/gpu.py --smoke end to end on the CPU, in a real process: every loop trains, the table has a
row per loop, and the JSON holds the settings, each loop's figures, the skipped loops and the
issue's target checks, with figures that agree with one another (tokens/s = samples/s x sequence
length, MFU = FLOPs x samples/s / peak, FLOPs as phalanx's own LogThroughput counted them)."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt.model import GPT  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "bench" / "gpu.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
OPTIONAL = {
    "Lightning": "lightning.pytorch",
    "Accelerate": "accelerate",
}  # loop -> what it imports (the bench extra)
PEAK = 1e12  # a made-up peak, so that the CPU run computes an MFU


def importable(module: str) -> bool:
    """As the benchmark decides: by importing (a package can be found and still fail to import)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def smoke(tmp_path: Path, workload: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"gpu-{workload}.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--workload", workload, "--out", str(out), *extra],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def table_rows(stdout: str) -> list[str]:
    """The loop names of the printed table: the lines between its header's rule and its footnote."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("loop ")) + 2
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("ms/step"))
    return [line[:12].strip() for line in lines[start:end]]


def check_loops(report: dict, stdout: str) -> None:
    """The hand loop and phalanx ran every measured chunk and learned nothing absurd; Lightning and
    Accelerate ran too where installed, and are listed as skipped where not."""
    s, results = report["settings"], report["results"]
    rows = table_rows(stdout)
    for name in ("hand loop", "phalanx"):
        r = results[name]
        assert r["samples_per_s"]["median"] > 0 and r["ms_per_step"]["median"] > 0
        assert len(r["per_chunk_ms_per_step"]) == s["rounds"] * s["steps"] // s["chunk"]
        assert math.isfinite(r["final_epoch_loss"]), r["final_epoch_loss"]
        assert name in rows
    assert results["hand loop"]["throughput_ratio_vs_hand"]["median"] == 1.0
    hand_ms = results["hand loop"]["per_chunk_ms_per_step"]
    phalanx = results["phalanx"]
    assert phalanx["ratio_of_totals"] == pytest.approx(
        sum(hand_ms) / sum(phalanx["per_chunk_ms_per_step"]), rel=1e-3
    )
    for name, package in OPTIONAL.items():
        if not importable(package):
            assert name not in results
            assert "not importable" in report["skipped"][name]
        else:
            assert name not in report["skipped"], report["skipped"]
            assert results[name]["samples_per_s"]["median"] > 0
            assert math.isfinite(results[name]["final_epoch_loss"])
            assert name in rows
    hooks = report["phalanx_hooks"]
    assert hooks[-1] == "Driver" and "ShowProgress" not in hooks and "ComputeStats" in hooks


def test_gpt2_small_smoke_reports_tokens_mfu_and_the_targets(tmp_path):
    report, stdout = smoke(tmp_path, "gpt2-small", "--peak-flops", str(PEAK))
    s = report["settings"]
    assert (s["workload"], s["smoke"], s["device"], s["precision"], s["compile"]) == (
        "gpt2-small",
        True,
        "cpu",
        "fp32",
        False,
    )
    assert s["model"]["class"] == "examples.gpt.model.GPT"
    assert (
        s["model"]["n_layer"],
        s["model"]["n_embd"],
        s["model"]["block_size"],
        s["seq_len"],
    ) == (2, 64, 32, 32)
    check_loops(report, stdout)

    flops = report["flops_per_sample"]
    assert flops == pytest.approx(report["flops_per_sample_phalanx_logthroughput"], rel=1e-9)
    model = GPT(**{k: v for k, v in s["model"].items() if k != "class"})
    assert flops == pytest.approx(
        model.flops_per_token() * s["seq_len"], rel=0.05
    )  # 6N + attention
    for r in report["results"].values():
        rate = r["samples_per_s"]["median"]
        assert r["tokens_per_s"]["median"] == pytest.approx(rate * s["seq_len"])
        assert r["mfu"]["median"] == pytest.approx(flops * rate / PEAK)
    assert report["peak_flops"] == PEAK and report["peak_flops_from"] == "--peak-flops"

    phalanx, target = report["results"]["phalanx"], report["target"]
    ratio = phalanx["throughput_ratio_vs_hand"]["median"]
    assert target["checks"]["phalanx_throughput_ratio"] == {
        "min": 0.98,
        "value": ratio,
        "met": ratio >= 0.98,
    }
    mfu = phalanx["mfu"]["median"]
    assert target["checks"]["phalanx_mfu"] == {"min": 0.40, "value": mfu, "met": mfu >= 0.40}
    assert target["valid"] is False  # a smoke run on the CPU says nothing of the target
    assert "target: phalanx MFU" in stdout and "tokens/s" in stdout


def test_launch_bound_smoke_runs_the_mlp_in_fp32_and_has_no_target(tmp_path):
    report, stdout = smoke(tmp_path, "launch-bound")
    s = report["settings"]
    assert (s["workload"], s["batch_size"], s["precision"], s["compile"], s["workers"]) == (
        "launch-bound",
        64,
        "fp32",
        False,
        0,
    )
    assert s["model"] == {"class": "bench.common.MLP", "features": 32, "hidden": 128, "classes": 10}
    check_loops(report, stdout)
    phalanx = report["results"]["phalanx"]
    assert "tokens_per_s" not in phalanx
    assert phalanx["mfu"] is None and report["peak_flops"] is None  # no peak for a CPU
    assert report["target"]["checks"] == {} and report["target"]["met"] is None
    assert report["machine"]["torch"] == __import__("torch").__version__
    assert set(report["phalanx_source"]) == {"commit", "src_modified", "src_sha256"}


def test_resnet50_smoke_is_skipped_with_the_reason_where_torchvision_is_missing(tmp_path):
    report, stdout = smoke(tmp_path, "resnet50")
    checks = report["target"]["checks"]
    if not importable("torchvision"):
        assert report["results"] == {}
        assert "torchvision" in report["skipped"]["all loops"]
        assert "skipped all loops" in stdout
        assert checks["phalanx_throughput_ratio"]["met"] is None
    else:  # on the CPU the smoke run trains a resnet18, and says so
        assert report["settings"]["model"]["class"] == "torchvision.models.resnet18"
        assert "resnet18 instead of resnet50" in stdout
        check_loops(report, stdout)
        assert (
            checks["phalanx_throughput_ratio"]["value"]
            == report["results"]["phalanx"]["throughput_ratio_vs_hand"]["median"]
        )
    assert "phalanx_mfu" not in checks


def test_the_trace_of_a_launch_bound_step_shows_both_loops_and_phalanx_python(tmp_path):
    """bench/gpu_trace.py --smoke on the CPU: both loops are timed and profiled per step (the
    same forward's operators in each), and phalanx's Python functions under cProfile include its
    training step."""
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_trace.py"), "--device", "cpu", "--smoke"],
        cwd=REPO,
        env={**ENV, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    hand, phalanx = result.stdout.split("=== [")[1:]
    for section in hand, phalanx:
        assert "us/step unprofiled" in section
        assert "aten::addmm" in section  # the MLP's layers, counted per step
    assert "Python functions under cProfile" in phalanx and "train_step" in phalanx
    assert "cProfile" not in hand


def _sources(tree: Path, cwd: Path) -> tuple[dict, dict]:
    """`measured_source()` with `tree`'s phalanx first on PYTHONPATH, and the repository's own."""
    said = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from bench import common; print(json.dumps([common.measured_source(),"
            f" common.source_state(common.Path({str(REPO)!r}))]))",
        ],
        env={**ENV, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{REPO}"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert said.returncode == 0, said.stderr
    measured, own = json.loads(said.stdout)
    return measured, own


def test_a_report_names_the_source_of_the_phalanx_it_imports(tmp_path):
    """A benchmark run with another checkout's phalanx first on PYTHONPATH (how a session compares
    commits) records that checkout's commit and digest, not those of the benchmark's own; a tree
    unpacked inside a checkout (no git of its own) names no commit rather than the checkout's."""
    other = tmp_path / "other"
    (other / "src").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(REPO / "src" / "phalanx"), str(other / "src")], check=True)
    (other / "src" / "phalanx" / "marker.py").write_text("ANOTHER = True\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(other)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "another"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    measured, own = _sources(other, tmp_path)
    assert measured["commit"] == head.stdout.strip() != own["commit"]
    assert measured["src_sha256"] != own["src_sha256"] and not measured["src_modified"]

    unpacked = other / ".old" / "abc1234"
    (unpacked / "src").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(other / "src" / "phalanx"), str(unpacked / "src")], check=True)
    inside, _ = _sources(unpacked, tmp_path)
    assert inside["commit"] is None and inside["src_modified"] is None
    assert inside["src_sha256"] == measured["src_sha256"]
