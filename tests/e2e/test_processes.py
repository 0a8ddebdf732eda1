"""The launcher and its workers under hostile use, in real processes: a launcher killed with
SIGKILL, the sockets a run listens on, a second signal, a hung rank, signals during start-up, and
two commands in one run directory."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import toy
from procs import alive, finish, start, wait_until

from phalanx import launch

pytestmark = pytest.mark.timeout(240)

TWO = ["parallel.accelerator=cpu", "parallel.devices=2"]

PARTS = '''
import os
import time
from pathlib import Path

import toy
from phalanx.hooks import Hook


class HangAt(toy.Linear):
    """Blocks for an hour in forward on rank `rank` at training step `step` (its first of `calls`
    forwards a step: a pipeline's micro-batches), after writing `hung`."""

    def __init__(self, features=3, rank=1, step=3, hidden=0, calls=1):
        super().__init__(features, hidden)
        self.hang_rank, self.hang_call, self.calls = rank, (step - 1) * calls + 1, 0

    def forward(self, x, y):
        if self.training:
            self.calls += 1
            if int(os.environ.get("RANK", 0)) == self.hang_rank and self.calls == self.hang_call:
                Path("hung").write_text(str(time.time()))
                time.sleep(3600)
        return super().forward(x, y)


class StuckAt(toy.Linear):
    """On rank `rank` at training step `step`, blocks SIGINT and SIGTERM and sleeps for an hour,
    after writing `stuck`: a main thread inside a long native call, where no Python signal handler
    runs."""

    def __init__(self, features=3, rank=1, step=3):
        super().__init__(features)
        self.stuck_rank, self.stuck_step, self.calls = rank, step, 0

    def forward(self, x, y):
        import signal

        if self.training:
            self.calls += 1
            if int(os.environ.get("RANK", 0)) == self.stuck_rank and self.calls == self.stuck_step:
                signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
                Path("stuck").write_text(str(time.time()))
                time.sleep(3600)
        return super().forward(x, y)


class SaveOnOneRank(Hook):
    """Saves a checkpoint after training step `step` on rank `rank` alone (a hook's mistake)."""

    def __init__(self, rank=1, step=3):
        self.rank, self.at = rank, step

    def after_batch(self, stream, batch):
        here = int(os.environ.get("RANK", 0))
        if stream == "train" and self.trainer.step == self.at and here == self.rank:
            self.trainer.save_checkpoint()
'''


def experiment(folder: Path, **sections) -> Path:
    cfg = toy.regression_config(
        **{
            "dataset": {"class": "toy.SlowRegression", "batch_size": 4, "delay": 0.02},
            "main_loop": {"epochs": 100},
            "hooks": ["SaveLatest"],
            **sections,
        }
    )
    path = toy.write_config(folder, cfg)
    (folder / "parts.py").write_text(PARTS)
    return path


def events(root: Path) -> list[str]:
    out = []
    for trace in root.glob("*/trace.jsonl"):
        out += [
            json.loads(line)["event"]
            for line in trace.read_text().splitlines()
            if line.endswith("}")
        ]
    return out


def the_run(root: Path) -> Path:
    [run] = [p for p in root.iterdir() if p.is_dir()]
    return run


def processes() -> dict[int, tuple[int, bytes]]:
    """Every process's parent and command line, read from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return out


def servers_of(pid: int) -> list[int]:
    """The launcher `pid`'s server, from which its workers fork (its child running
    multiprocessing's forkserver)."""
    return [p for p, (ppid, cmd) in processes().items() if ppid == pid and b"forkserver" in cmd]


def workers_of(pid: int) -> list[int]:
    """The worker processes the launcher `pid` started: its server's children, or, where the
    workers are spawned, its children running multiprocessing's spawn."""
    servers = servers_of(pid)
    return [
        p
        for p, (ppid, cmd) in processes().items()
        if ppid in servers or (ppid == pid and b"spawn_main" in cmd)
    ]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def listening_sockets(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes `pids` hold, read from
    /proc."""
    inodes = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, raw), int(hex_port, 16), inodes[fields[9]]))
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A 2-process run: its listening sockets once training runs; then its launcher killed with
    SIGKILL while rank 1 is stuck in a long call and rank 0 waits for it in the all-reduce."""
    exp = tmp_path_factory.mktemp("killed")
    path = experiment(exp, model={"class": "parts.StuckAt", "rank": 1, "step": 13})
    proc = start("train", str(path), *TWO, cwd=exp)
    workers: list[int] = []
    try:
        wait_until(
            lambda: (exp / "stuck").is_file(), proc, what="rank 1 being stuck in its second epoch"
        )
        workers = workers_of(proc.pid) + servers_of(proc.pid)
        sockets = listening_sockets([proc.pid, *workers])
        proc.kill()
        proc.wait()
        killed_at = time.monotonic()
        while any(alive(p) for p in workers) and time.monotonic() - killed_at < 30:
            time.sleep(0.05)
        return SimpleNamespace(
            workers=workers,
            sockets=sockets,
            survived=time.monotonic() - killed_at,
            left=[p for p in workers if alive(p)],
        )
    finally:
        proc.kill()
        kill_all(workers)


def test_killing_the_launcher_ends_its_workers_within_seconds(killed):
    """Its workers and, where they fork from one, their server."""
    assert len(killed.workers) == 2 + (launch.start_method() == "forkserver")
    assert not killed.left, f"workers {killed.left} outlived their launcher"
    assert killed.survived < 5


def test_a_run_listens_on_loopback_only(killed):
    assert killed.sockets, "the run listens on no socket at all?"
    public = [s for s in killed.sockets if s[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not public, f"listening beyond loopback (address, port, pid): {public}"


def test_a_second_signal_ends_every_worker_at_once(tmp_path):
    # every checkpoint takes 10 minutes to write, so both signals arrive while one is half written,
    # and a job that waited for the save could not end within `finish`'s bound
    path = experiment(
        tmp_path,
        model={"class": "toy.SlowSave", "save_delay": 600.0, "fast_calls": 1},
        dataset={"class": "toy.Regression", "batch_size": 8},
        main_loop={"epochs": 3},
    )
    proc = start("train", str(path), *TWO, cwd=tmp_path)
    workers: list[int] = []
    try:
        wait_until(
            lambda: any((tmp_path / "runs").glob("*/checkpoints/.tmp-*")),
            proc,
            what="a checkpoint being written",
        )
        workers = workers_of(proc.pid) + servers_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        # the second once the launcher has taken the first (two sent while it waits for the CPU
        # would be one pending signal)
        wait_until(
            lambda: any((tmp_path / "runs").glob("*/.stop-requested")),
            proc,
            what="the launcher relaying the first signal",
        )
        proc.send_signal(signal.SIGINT)
        result = finish(proc, timeout=180)
    finally:
        proc.kill()
        kill_all(workers)
    assert result.returncode == 130, result.stderr
    assert not [p for p in workers if alive(p)]
    folder = the_run(tmp_path / "runs") / "checkpoints"
    assert not list(folder.glob(".tmp-*"))
    assert "Traceback" not in result.stderr


HUNG = {
    "ddp": ({}, {}),
    "fsdp": ({}, {}),
    # the last stage hangs in its first micro-batch's forward: the first waits in a receive
    "pipeline": (
        {"hidden": 4, "calls": 2},
        {"pipeline": {"split": ["net.2"], "microbatches": 2}},
    ),
    # worker 1 hangs in its third chunk: worker 0 waits for the servers' answer after that step
    "param_server": ({}, {"devices": 3, "param_server": {"servers": 1}}),
}


@pytest.mark.parametrize("strategy", list(HUNG))
def test_a_hung_rank_is_named_with_its_step_and_the_job_ends_soon_after_the_timeout(
    tmp_path, strategy
):
    """Under fsdp the others wait in the parameters' all-gather of the forward, not in phalanx's
    all-reduce, under the pipeline in a receive from the hung stage, and under param_server for
    the servers' answer, which waits for the hung worker's part: the hung rank is named all the
    same, not the rank whose wait timed out (nor a server)."""
    timeout = 3
    model, parallel = HUNG[strategy]
    path = experiment(
        tmp_path,
        model={"class": "parts.HangAt", "rank": 1, "step": 3, **model},
        dataset={"class": "toy.Regression", "batch_size": 8},
        parallel={
            "accelerator": "cpu",
            "devices": 2,
            "timeout_s": timeout,
            "strategy": strategy,
            **parallel,
        },
    )
    proc = start("train", str(path), cwd=tmp_path)
    try:
        wait_until(lambda: (tmp_path / "hung").is_file(), proc, what="rank 1 hanging")
        # ends by the 3 s collective timeout: torch's own default would keep it 10 minutes or more
        # (no tighter bound on how soon: a busy machine slows every process)
        result = finish(proc, timeout=240)
    finally:
        proc.kill()
    assert result.returncode == 1, result.stderr
    error = result.stderr[result.stderr.index("phalanx: error:") :]
    if strategy == "param_server":  # no collective: a wait for the servers' answer
        # the workers take a step's chunks as they become free: worker 1's third chunk is in
        # step 3 where they alternate, later where worker 0 took more of them
        late = re.search(
            r"rank 1 did not finish its part of step (\d+) within the timeout: rank 0 waited for "
            r"(the servers' parameters|its loss, from server 0) after that step",
            error,
        )
        assert late, error
        step = int(late.group(1))
    else:
        assert re.search(r"rank 1 did not reach the .+ of step 3 within", error), error
        step = 3
    assert f"parallel.timeout_s={timeout}" in error
    assert f"rank 1: last seen in step {step}" in error
    assert "rank 0:" not in error and "rank 2:" not in error  # neither behind: not named
    assert "Traceback" not in result.stderr
    stacks = the_run(tmp_path / "runs") / "stacks"
    # every rank's stack, or the error names the ranks whose stack is not there
    processes = parallel.get("devices", 2)
    written = sorted(int(p.stem.split("-")[1]) for p in stacks.glob("rank-*.txt"))
    if written == list(range(processes)):
        assert f"every rank's stack when the job ended: {stacks}" in error
    else:
        missing = ", ".join(str(r) for r in range(processes) if r not in written)
        assert f"the ranks' stacks when the job ended: {stacks} (none from rank {missing}:" in error
    stuck = (stacks / "rank-1.txt").read_text()  # where rank 1 was: asleep in the model's forward
    assert "Current thread" in stuck or "Thread" in stuck
    assert re.search(r'parts\.py", line \d+ in forward', stuck), stuck


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_saved_on_one_rank_only_is_named_not_an_abort_or_a_raw_timeout(
    tmp_path, strategy
):
    """Every rank calls save_checkpoint at the same step: where a hook calls it on rank 1 alone,
    the ranks meet through the store first, so the job fails saying so, after the timeout, where
    ddp's gloo aborted rank 1 (its all-reduce against the other's gradients) and fsdp's ended in
    gloo's own timeout traceback."""
    path = experiment(
        tmp_path,
        dataset={"class": "toy.Regression", "batch_size": 8},
        hooks=[{"parts.SaveOnOneRank": {"rank": 1, "step": 3}}],
        parallel={"accelerator": "cpu", "devices": 2, "timeout_s": 3, "strategy": strategy},
    )
    result = finish(start("train", str(path), cwd=tmp_path), timeout=200)
    assert result.returncode == 1, result.stderr
    error = result.stderr[result.stderr.index("phalanx: error:") :]
    # rank 1's meeting gives up first, as a rule; should rank 0's collective time out before it on
    # a loaded machine, rank 0 names rank 1 in save_checkpoint
    said = (
        "phalanx: error: rank 0 did not call save_checkpoint at step 3 within the timeout "
        "(parallel.timeout_s=3), where rank 1 did: every rank calls save_checkpoint",
        "rank 1: last seen in step 4",
    )
    if not error.startswith(said[0]):
        assert "while the others were in other collectives: every rank calls" in error, error
        assert f"{said[1]} (" in error and "in save_checkpoint of step 4" in error, error
    assert "Traceback" not in result.stderr and "SIGABRT" not in result.stderr


def test_sigterm_during_start_up_of_one_process_leaves_nothing(tmp_path):
    path = experiment(
        tmp_path, dataset={"class": "toy.SlowRegression", "batch_size": 4, "init_s": 60}
    )
    proc = start("train", str(path), cwd=tmp_path)
    wait_until(lambda: (tmp_path / "ready-0").is_file(), proc, what="the data set being built")
    assert (tmp_path / "runs").is_dir() and list(
        (tmp_path / "runs").iterdir()
    )  # the run directory exists
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, timeout=120)
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "phalanx: interrupted"
    assert "Traceback" not in result.stderr
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("when", ["importing", "building"])
def test_ctrl_c_while_two_processes_start_leaves_nothing(tmp_path, when):
    """A terminal's Ctrl-C reaches the whole foreground process group: the launcher and the workers
    it started, here while they import torch or while they build the data set."""
    path = experiment(
        tmp_path, dataset={"class": "toy.SlowRegression", "batch_size": 4, "init_s": 60}
    )
    proc = start(
        "train", str(path), *TWO, cwd=tmp_path, new_session=True
    )  # its own group, as a terminal's job
    workers: list[int] = []
    try:
        if when == "importing":
            wait_until(
                lambda: len(workers_of(proc.pid)) == 2, proc, what="the workers being started"
            )
        else:
            wait_until(
                lambda: all((tmp_path / f"ready-{r}").is_file() for r in (0, 1)),
                proc,
                what="the workers building the data set",
            )
        workers = workers_of(proc.pid) + servers_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        result = finish(proc, timeout=120)
    finally:
        proc.kill()
        kill_all(workers)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "phalanx: interrupted", result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    time.sleep(0.5)
    assert not [p for p in workers if alive(p)]


def test_sigterm_to_the_launcher_during_start_up_leaves_nothing(tmp_path):
    path = experiment(
        tmp_path, dataset={"class": "toy.SlowRegression", "batch_size": 4, "init_s": 60}
    )
    proc = start("train", str(path), *TWO, cwd=tmp_path)
    workers: list[int] = []
    try:
        wait_until(
            lambda: all((tmp_path / f"ready-{r}").is_file() for r in (0, 1)),
            proc,
            what="the workers building the data set",
        )
        workers = workers_of(proc.pid) + servers_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        result = finish(proc, timeout=120)
    finally:
        proc.kill()
        kill_all(workers)
    assert result.returncode == 143, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "phalanx: interrupted", result.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    # the directory it announced is said to be gone
    announced = re.search(r"run directory: (\S+); starting 2 workers", result.stderr)
    assert announced is not None, result.stderr
    assert f"removed the run directory {announced[1]}: it holds no checkpoint" in result.stderr
    time.sleep(0.5)
    assert not [p for p in workers if alive(p)]


def test_a_run_directory_in_use_is_refused_naming_its_holder_and_a_killed_holder_leaves_no_lock(
    tmp_path,
):
    path = experiment(tmp_path, hooks=[{"SaveEvery": {"steps": 2}}])
    proc = start("train", str(path), *TWO, cwd=tmp_path)
    workers: list[int] = []
    try:
        wait_until(lambda: "checkpoint" in events(tmp_path / "runs"), proc, what="a checkpoint")
        run = the_run(tmp_path / "runs")
        second = finish(start("resume", str(run), cwd=tmp_path))
        assert second.returncode == 2, second.stderr
        [line] = second.stderr.strip().splitlines()
        assert line.startswith("phalanx: error:") and "in use" in line
        assert f"pid {proc.pid} on host {socket.gethostname()}" in line and "phalanx train" in line
        assert proc.poll() is None  # the first run goes on, its workers untroubled by the lock
        workers = workers_of(proc.pid)
        proc.kill()  # SIGKILL: no clean-up at all
        proc.wait()
        before = events(tmp_path / "runs").count("started")
        third = start("resume", str(run), cwd=tmp_path)
        wait_until(
            lambda: events(tmp_path / "runs").count("started") > before,
            third,
            what="the resume to start training",
        )
        third.send_signal(signal.SIGTERM)
        result = finish(third)
        assert result.returncode == 143, result.stderr
    finally:
        proc.kill()
        kill_all(workers)
