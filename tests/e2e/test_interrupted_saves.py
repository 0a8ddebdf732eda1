"""A run interrupted while it saves: what it says is what it did. Also what an interrupted write
leaves is removed at the next start, and a step folder that is not what its name says is damaged."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import toy
from procs import finish, start, wait_until

import phalanx

pytestmark = pytest.mark.timeout(240)


def _events(run: Path) -> list[dict]:
    try:
        lines = (run / "trace.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_a_second_signal_during_a_ddp_save_does_not_say_saved(tmp_path):
    """Rank 0 reads the weights for 3 s (toy.SlowSave); rank 1, which writes nothing, returned at
    once and said 'saved' for a step that the second signal then removed."""
    toy.write_config(
        tmp_path,
        toy.regression_config(
            model={"class": "toy.SlowSave", "save_delay": 3.0},
            dataset={"class": "toy.Regression", "batch_size": 4, "n_train": 400},
            parallel={"accelerator": "cpu", "devices": 2},
            main_loop={"epochs": 1000},
            hooks=["SaveLatest"],
        ),
    )
    proc = start("train", "config.yaml", cwd=tmp_path)
    runs = tmp_path / "runs"
    wait_until(
        lambda: (
            runs.is_dir()
            and any(e["event"] == "checkpoint" for r in runs.iterdir() for e in _events(r))
        ),
        proc,
        what="the first checkpoint",
    )
    [run] = runs.iterdir()
    saved = {int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")}
    proc.send_signal(signal.SIGINT)  # finish the step, save: rank 0 reads its weights for 3 s
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)  # at once
    result = finish(proc, timeout=180)
    assert result.returncode == 130, result.stderr[-2000:]
    assert "saved. Continue with" not in result.stderr, result.stderr[-2000:]
    assert {int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")} == saved
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_what_an_interrupted_write_left_is_removed_at_the_next_start_and_said(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    raw = toy.regression_config(hooks=["SaveLatest"], main_loop={"epochs": 1})
    run = phalanx.fit(raw).run_dir
    left = run / "checkpoints" / ".tmp-step-7-4242"  # as a kill -9 during an async write leaves it
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    assert phalanx.resume(run, overrides="main_loop.epochs=2").code == 0
    assert not left.exists()
    said = (run / "log.txt").read_text()
    assert "removed what an interrupted checkpoint write left: .tmp-step-7-4242 (3.0 MiB)" in said


def test_a_step_folder_whose_state_says_another_step_is_damaged_and_skipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = toy.regression_config(hooks=["SaveLatest"], checkpoints={"keep_last": 5})
    run = phalanx.fit(raw).run_dir  # 2 epochs of 5 steps
    folder = run / "checkpoints"
    shutil.move(folder / "step-5", folder / "step-60")  # as if renamed by hand
    again = phalanx.resume(run, overrides="main_loop.epochs=3")
    assert again.code == 0
    said = (run / "log.txt").read_text()
    assert (
        "skipping checkpoint step-60: " in said and "says step 5, but the folder is step 60" in said
    )
    assert f"resuming {run} from step 10" in said


def _read_only(folder: Path) -> None:
    """Make `folder` refuse new entries, for root too (chattr +i), or skip saying why."""
    import subprocess

    folder.chmod(0o555)
    try:
        (folder / ".probe").touch()
    except OSError:
        return
    (folder / ".probe").unlink()
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a folder read-only here (chattr: {made.stderr.decode().strip()})")


def _writable(folder: Path) -> None:
    import subprocess

    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_a_read_only_checkpoints_folder_or_run_directory_is_one_line(tmp_path):
    from procs import run as phalanx_cli

    toy.write_config(tmp_path, toy.regression_config(hooks=["SaveLatest"], main_loop={"epochs": 1}))
    first = phalanx_cli("train", "config.yaml", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    [run] = (tmp_path / "runs").iterdir()
    checkpoints = run / "checkpoints"
    _read_only(checkpoints)
    try:
        saving = phalanx_cli("resume", str(run), "main_loop.epochs=2", cwd=tmp_path)
    finally:
        _writable(checkpoints)
    lines = [
        line for line in saving.stderr.splitlines() if not line.startswith(("INFO", "WARNING"))
    ]
    assert saving.returncode != 0 and "Traceback" not in saving.stderr, saving.stderr
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: cannot write "), saving.stderr
    assert "step-10" in lines[0] and "make it writable" in lines[0]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-5"]  # nothing half-written

    _read_only(run)
    try:
        locking = phalanx_cli("resume", str(run), "main_loop.epochs=2", cwd=tmp_path)
    finally:
        _writable(run)
    assert locking.returncode == 2 and "Traceback" not in locking.stderr, locking.stderr
    assert f"phalanx: error: cannot write in {str(run)!r}" in locking.stderr
    assert "make it writable" in locking.stderr
