"""Two commands at once: run directories created in the same instant, and the lock that keeps a
second process from training in a run directory in use."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import toy

from phalanx import commands, config, rundir, runlock
from phalanx.errors import RunDirError
from phalanx.strategies.progress import Late, Progress

pytestmark = pytest.mark.timeout(180)


def test_two_runs_created_in_the_same_instant_get_a_directory_each(tmp_path, monkeypatch):
    """Another process creates the very directory this one chose, between its choice and mkdir."""
    cfg = config.validate({**toy.regression_config(), "output_root": str(tmp_path / "runs")})
    real_mkdir = Path.mkdir
    raced: list[Path] = []

    def racing_mkdir(self, *args, **kwargs):
        if self.name.startswith("toy-") and not raced:
            raced.append(self)
            real_mkdir(self, parents=True)  # the other process, first
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    run = rundir.create(cfg, tmp_path / "config.yaml")
    assert raced and run != raced[0] and run.name == f"{raced[0].name}-2"
    assert (run / rundir.CONFIG).is_file() and not any(raced[0].iterdir())


def test_a_locked_run_directory_is_refused_naming_its_holder(tmp_path):
    with runlock.hold(tmp_path, "train"):
        with pytest.raises(RunDirError) as caught:
            runlock.acquire(tmp_path, "resume")
        message = str(caught.value)
        assert "in use" in message and "`phalanx train`" in message
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "\n" not in message
    runlock.acquire(tmp_path, "resume").release()  # released with the block
    assert not (tmp_path / runlock.LOCK).exists()  # nothing left in the run directory


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that locks `run_dir` as training does, and waits."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from phalanx import runlock; runlock.acquire(Path(sys.argv[1]), 'train'); "
            "print('locked', flush=True); time.sleep(600)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_ls_tells_a_run_that_trains_from_one_whose_process_was_killed(tmp_path):
    """The trace of a run whose process was killed ends on an event that a live run also writes
    (started, epoch): the lock it held, and left, says which is which."""
    run = tmp_path / "toy-20260101-120000"
    run.mkdir()
    (run / rundir.CONFIG).write_text("name: toy\nseed: 0\n")
    (run / rundir.META).write_text(json.dumps({"config_dir": str(tmp_path), "cwd": str(tmp_path)}))
    rundir.trace(run, "started", epoch=0, step=0)
    rundir.trace(run, "epoch", epoch=1, step=5)

    def status() -> tuple:
        (row,) = commands.list_runs(str(tmp_path))
        return row["status"], row["epoch"], row["step"]

    assert status() == ("epoch", 1, 5)  # no lock file: the trace alone
    holder = _hold_lock(run)
    try:
        assert status() == ("training", 1, 5)
        assert runlock.state(run) == "held"
        # the look does not keep a second process from learning who holds the run
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            runlock.acquire(run, "resume")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
    assert status() == ("killed", 1, 5)
    # a run that recorded its end keeps it, whatever became of its lock
    rundir.trace(run, "failed", step=5, error="RuntimeError: boom")
    assert status()[0] == "failed"
    # resumed: the lock is taken over, and given back with the file removed at the end
    with runlock.hold(run, "resume"):
        assert status()[0] == "training"
    assert runlock.state(run) is None
    assert status()[0] == "failed"


def test_a_lock_taken_for_an_instant_by_a_look_does_not_refuse_a_run(tmp_path, monkeypatch):
    """`phalanx ls` takes a shared lock for an instant: a run starting then tries again, and only a
    lock held throughout refuses it."""
    real_flock = runlock.fcntl.flock
    refusals = {"left": 3}

    def busy_for_a_moment(fd, operation):
        if operation & runlock.fcntl.LOCK_EX and refusals["left"] > 0:
            refusals["left"] -= 1
            raise BlockingIOError
        return real_flock(fd, operation)

    monkeypatch.setattr(runlock, "_PAUSE_S", 0.0)
    monkeypatch.setattr(runlock.fcntl, "flock", busy_for_a_moment)
    runlock.acquire(tmp_path, "train").release()
    assert refusals["left"] == 0
    refusals["left"] = runlock._TRIES
    with pytest.raises(RunDirError, match="is in use"):
        runlock.acquire(tmp_path, "train")
    assert runlock.state(tmp_path) is None  # an empty file: no holder wrote who it is


def test_a_killed_holder_leaves_no_lock(tmp_path):
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            runlock.acquire(tmp_path, "resume")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        runlock.acquire(tmp_path, "resume").release()
    finally:
        holder.kill()


def _published(progress: Progress, store, entered: int) -> None:
    """Wait until `progress`'s publishing thread has put a report of `entered` collectives in
    `store` (no fixed sleep: the thread is slower on a busy machine)."""
    key = f"phalanx/progress/{progress.rank}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if store.check([key]) and json.loads(store.get(key))["entered"] == entered:
            return
        time.sleep(0.01)
    raise AssertionError(f"rank {progress.rank} published no report of {entered} collectives")


def test_a_timed_out_collective_names_the_ranks_that_did_not_arrive_and_their_step():
    """Three ranks trained 2 steps; ranks 0 and 2 entered step 3's all-reduce, rank 1 never did."""
    store = dist.HashStore()
    ranks = [Progress(r, 3, 4.0, store, interval_s=0.02) for r in range(3)]
    try:
        for progress in ranks:
            progress.where = lambda: (2, True)  # 2 steps done, training
            for _ in range(2):
                progress.enter("the gradient all-reduce")
        ranks[0].enter("the gradient all-reduce")
        ranks[2].enter("the gradient all-reduce")
        for progress, entered in zip(ranks, (3, 2, 3), strict=True):
            _published(progress, store, entered)
        message = ranks[0].explain(
            RuntimeError("[gloo] Timed out waiting 4000ms for recv operation to complete")
        )
        assert message.startswith(
            "rank 1 did not reach the gradient all-reduce of step 3 within the collective "
            "timeout (parallel.timeout_s=4); rank 0 waited for it there."
        )
        assert "rank 1: last seen in step 3" in message and "rank 2:" not in message
        assert "the last collective it entered: the gradient all-reduce of step 3" in message
        assert ranks[0].explain(RuntimeError("Connection closed by peer")) is None  # not a timeout
    finally:
        for progress in ranks:
            progress.close()


def test_ranks_outside_the_collectives_are_never_named_and_a_late_wait_says_its_own_words():
    """A param_server run: ranks 0 and 1 (the workers) enter the collectives, rank 2 (a server)
    never does. A worker's timed-out collective names the other worker alone; a wait that explains
    itself (`Late`) keeps its message."""
    store = dist.HashStore()
    ranks = [Progress(r, 3, 4.0, store, interval_s=0.02) for r in range(3)]
    try:
        for progress in ranks:
            progress.peers = range(2)
            progress.where = lambda: (2, True)
        ranks[0].enter("an all-reduce")
        _published(ranks[0], store, 1)
        _published(ranks[2], store, 0)
        message = ranks[0].explain(RuntimeError("[gloo] Timed out waiting 4000ms for recv"))
        assert message.startswith("rank 1 did not reach an all-reduce of step 3"), message
        assert "rank 2" not in message
        assert ranks[0].explain(Late("rank 1 did not finish its part")) == (
            "rank 1 did not finish its part"
        )
    finally:
        for progress in ranks:
            progress.close()


def test_ranks_meet_to_save_at_one_step_and_one_that_does_not_come_is_named():
    """`meet` before a checkpoint's save: both ranks at step 3 go on; then rank 1 saves at step 5
    and rank 0 never does (a hook that saves on one rank), which fails after the timeout naming
    rank 0; two ranks that save at different steps are named with both."""
    store = dist.HashStore()
    ranks = [Progress(r, 2, 0.3, store, interval_s=0.02) for r in range(2)]
    try:
        for progress in ranks:
            progress.where = lambda: (4, True)
        both = [threading.Thread(target=p.meet, args=("save_checkpoint", 3)) for p in ranks]
        for thread in both:
            thread.start()
        for thread in both:
            thread.join(timeout=30)
        assert ranks[0].entered == ranks[1].entered == 1  # a meeting counts as a collective
        with pytest.raises(Late) as alone:
            ranks[1].meet("save_checkpoint", 5)
        message = str(alone.value)
        assert message.startswith(
            "rank 0 did not call save_checkpoint at step 5 within the timeout "
            "(parallel.timeout_s=0.3), where rank 1 did: every rank calls save_checkpoint"
        ), message
        assert "rank 0: last seen in step 5" in message
        with pytest.raises(Late, match="rank 1 called save_checkpoint at step 5 where rank 0"):
            ranks[0].meet("save_checkpoint", 6)  # rank 1's second meeting is there, at step 5
    finally:
        for progress in ranks:
            progress.close()


def test_a_later_run_on_the_same_store_does_not_take_an_earlier_runs_meetings():
    """A store that outlives a run (a group a script keeps): run 1's ranks met once at step 5,
    then rank 1 alone at step 7 (its key of meeting 1 is never cleared); run 2's first meeting, at
    step 10, waits for run 2's rank 1 instead of reading run 1's step 5."""
    store = dist.HashStore()
    first = [Progress(r, 2, 0.3, store, interval_s=0.02, run=1) for r in range(2)]
    second = [Progress(r, 2, 5.0, store, interval_s=0.02, run=2) for r in range(2)]
    try:
        met = [threading.Thread(target=p.meet, args=("save_checkpoint", 5)) for p in first]
        for thread in met:
            thread.start()
        for thread in met:
            thread.join(timeout=30)
        with pytest.raises(Late):
            first[1].meet("save_checkpoint", 7)
        errors = []

        def meet(progress: Progress) -> None:
            try:
                progress.meet("save_checkpoint", 10)
            except Late as e:
                errors.append(str(e))

        met = [threading.Thread(target=meet, args=(p,)) for p in second]
        for thread in met:
            thread.start()
        for thread in met:
            thread.join(timeout=30)
        assert errors == []
    finally:
        for progress in first + second:
            progress.close()


def test_a_timeout_where_no_rank_is_behind_names_the_ranks_in_another_collective():
    """Rank 1 entered an all-reduce in a hook on its own (any_rank on one rank), rank 0 the next
    step's all-gather: both have entered as many collectives, and rank 0's timeout names rank 1
    with the collective it is in."""
    store = dist.HashStore()
    ranks = [Progress(r, 2, 4.0, store, interval_s=0.02) for r in range(2)]
    try:
        ranks[0].where, ranks[1].where = (lambda: (3, True)), (lambda: (2, True))
        ranks[0].enter("the all-gather of net's parameters")
        ranks[1].enter("an all-reduce")
        _published(ranks[1], store, 1)
        message = ranks[0].explain(RuntimeError("[gloo] Timed out waiting 4000ms for send"))
        assert message.startswith(
            "rank 0 timed out in the all-gather of net's parameters of step 4 "
            "(parallel.timeout_s=4) while the others were in other collectives"
        ), message
        assert (
            "rank 1: last seen in step 3 (" in message and "in an all-reduce of step 3" in message
        )
    finally:
        for progress in ranks:
            progress.close()


def test_the_collective_is_named_with_the_step_it_was_entered_in_not_the_unwound_one():
    """The timeout's error unwinds the step (the run reads 'not training' again) before the message
    is made, and the publishing thread may report that meanwhile: the message still names the
    step whose collective rank 0 waited in, and the collective a rank entered with its own step."""
    store = dist.HashStore()
    ranks = [Progress(r, 2, 4.0, store, interval_s=0.02) for r in range(2)]
    where = {0: (2, True), 1: (2, True)}
    try:
        for rank, progress in enumerate(ranks):
            progress.where = lambda rank=rank: where[rank]
        ranks[1].enter("the gradient all-reduce")  # rank 1: step 3's, then hangs
        ranks[0].enter("the gradient all-reduce")
        ranks[0].enter("the gradient all-reduce")  # rank 0 waits in step 3's second
        where[0] = (2, False)  # unwound: evaluation after step 2, as the loop's `finally` leaves it
        _published(ranks[0], store, 2)
        _published(ranks[1], store, 1)
        deadline = time.monotonic() + 30
        while "evaluation" not in json.loads(store.get("phalanx/progress/0"))["position"]:
            assert time.monotonic() < deadline, "rank 0 never published its unwound position"
            time.sleep(0.01)
        message = ranks[0].explain(RuntimeError("[gloo] Timed out waiting 4000ms for recv"))
        assert message.startswith("rank 1 did not reach the gradient all-reduce of step 3 within")
        assert "evaluation" not in message, message
    finally:
        for progress in ranks:
            progress.close()
