"""The launcher's report of a failed job: the first failing rank's own error, whichever exit the
elastic agent happened to notice first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from phalanx import failures

pytestmark = pytest.mark.timeout(120)


def _fail_on_rank(records, monkeypatch, rank: int, error: BaseException) -> None:
    """Record `error` as rank `rank`'s worker does, where the elastic agent puts its error file."""
    folder = records / "phalanx-run_x" / "attempt_0" / str(rank)
    folder.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(folder / "error.json"))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - recorded as a worker records it
        failures.record(e)


def test_the_failing_rank_is_reported_when_the_agent_noticed_a_rank_that_ended_because_of_it(
    tmp_path, monkeypatch
):
    """Rank 1 fails and tells the others to end; rank 0 ends too (exit code 1, nothing recorded),
    and the agent may notice rank 0's exit first: its failure then names no error file."""
    _fail_on_rank(tmp_path, monkeypatch, 1, RuntimeError("injected failure on rank 1 at step 3"))
    noticed = ProcessFailure(
        local_rank=0, pid=4242, exitcode=1, error_file=str(tmp_path / "absent.json")
    )
    message = str(failures.explain(ChildFailedError("worker", {0: noticed}), tmp_path))
    assert message.startswith("rank 1 failed first")
    assert message.count("injected failure on rank 1 at step 3") == 1


def _said_and_kept(tmp_path, monkeypatch, error: BaseException | None = None):
    """Rank 1 fails with `error` (None: a fault inside phalanx's own code); what the terminal shows,
    what log.txt keeps, and trace.jsonl's `failed` event."""
    from phalanx.rundir import read_trace

    if error is None:
        from phalanx import rundir

        try:
            rundir.read_trace(4242)  # type: ignore[arg-type]  # a TypeError raised in phalanx
        except TypeError as e:
            error = e
    _fail_on_rank(tmp_path, monkeypatch, 1, error)
    noticed = ProcessFailure(
        local_rank=1, pid=4242, exitcode=1, error_file=str(tmp_path / "absent.json")
    )
    run = tmp_path / "run"
    run.mkdir()
    failure = failures.in_the_run(
        run, failures.explain(ChildFailedError("worker", {1: noticed}), tmp_path), None
    )
    [failed] = [e for e in read_trace(run) if e["event"] == "failed"]
    return str(failure), (run / "log.txt").read_text(), failed["error"]


def test_an_error_of_the_users_code_shows_its_frames_and_the_run_keeps_the_whole_traceback(
    tmp_path, monkeypatch
):
    """Raised in the user's code (this test's, outside phalanx and the libraries): the terminal
    shows that code's frames and the error; log.txt holds the whole traceback and error; the trace's
    one line ends with the error."""
    shown, logged, line = _said_and_kept(
        tmp_path, monkeypatch, ValueError("injected failure on rank 1 at step 3")
    )
    assert shown.startswith(
        "rank 1 failed first; every rank was stopped. Your code raised this (the run's log.txt "
        "has the whole traceback):\n"
    )
    assert "in _fail_on_rank\n    raise error\n" in shown and "Traceback" not in shown
    assert shown.rstrip().endswith("ValueError: injected failure on rank 1 at step 3")
    assert (
        " ERROR the launcher: rank 1 failed first; every rank was stopped. Its traceback:\n"
        "Traceback (most recent call last):\n"
    ) in logged
    assert logged.endswith("ValueError: injected failure on rank 1 at step 3\n")
    assert line.startswith("rank 1 failed first; every rank was stopped. Your code raised this")
    assert line.endswith(" ... ValueError: injected failure on rank 1 at step 3")


def test_a_fault_inside_phalanx_shows_the_whole_traceback_on_the_terminal_and_in_the_run(
    tmp_path, monkeypatch
):
    shown, logged, line = _said_and_kept(tmp_path, monkeypatch)
    assert shown.startswith("rank 1 failed first; every rank was stopped. Its traceback:\n")
    assert "phalanx/rundir.py" in shown and shown.rstrip().splitlines()[-1].startswith("TypeError")
    assert logged.endswith(f" ERROR the launcher: {shown.rstrip()}\n")
    assert line.startswith("rank 1 failed first; every rank was stopped. Its traceback: ... ")


def test_with_no_record_the_noticed_exit_is_reported(tmp_path):
    noticed = ProcessFailure(
        local_rank=0, pid=4242, exitcode=-9, error_file=str(tmp_path / "absent.json")
    )
    message = str(failures.explain(ChildFailedError("worker", {0: noticed}), tmp_path))
    assert message.startswith("rank 0 was killed by SIGKILL (exit code -9) and recorded no error")
    assert "out of memory" in message
    aborted = ProcessFailure(
        local_rank=0, pid=4242, exitcode=-6, error_file=str(tmp_path / "absent.json")
    )
    message = str(failures.explain(ChildFailedError("worker", {0: aborted}), tmp_path))
    assert message.startswith("rank 0 was killed by SIGABRT (exit code -6) and recorded no error")
    assert "called different collectives (a hook that calls save_checkpoint" in message


@pytest.mark.parametrize("attempt", [0, 2])
def test_a_fatal_signal_leaves_its_stacks_in_the_run_not_in_the_terminal(tmp_path, attempt):
    """A worker that a fatal signal ends (gloo aborts a rank whose collectives do not match the
    others') writes its threads' stacks beside its record, where torch's launcher would have
    printed them to the terminal; the launcher moves them into the run's stacks/ and says where,
    named as the attempt's other stacks are."""
    record = tmp_path / "records" / "run" / f"attempt_{attempt}" / "1"
    record.mkdir(parents=True)
    aborting = (  # faulthandler on, as torch's launcher leaves it for the worker
        "import faulthandler, os\nfrom phalanx import failures\nfaulthandler.enable()\n"
        "failures.keep_fatal_stacks()\nos.abort()"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(record / "error.json")}
    done = subprocess.run(
        [sys.executable, "-c", aborting], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGABRT
    assert "Fatal Python error" not in done.stderr, done.stderr
    aborted = ProcessFailure(
        local_rank=1, pid=4242, exitcode=-6, error_file=str(record / "error.json")
    )
    stacks = tmp_path / "run" / "stacks"
    failure = ChildFailedError("worker", {1: aborted})
    message = str(failures.explain(failure, tmp_path / "records", stacks))
    assert message.startswith("rank 1 was killed by SIGABRT (exit code -6) and recorded no error")
    moved = stacks / ("rank-1-fatal.txt" if not attempt else "rank-1-attempt-2-fatal.txt")
    assert message.endswith(f"; its stacks as it ended: {moved}")
    assert "Fatal Python error: Aborted" in moved.read_text()
    # noticed as a worker that ended without a record (the launcher saw another exit first)
    noticed = ProcessFailure(
        local_rank=0, pid=4243, exitcode=1, error_file=str(tmp_path / "absent.json")
    )
    message = str(
        failures.explain(ChildFailedError("worker", {0: noticed}), tmp_path / "records", stacks)
    )
    assert message.startswith(
        "rank 1 ended by a fatal error and recorded no other (Fatal Python error: Aborted): the "
        "ranks may have called different collectives"
    ), message
    assert "outside" not in message


def test_a_process_forked_from_a_worker_writes_its_fatal_stacks_to_its_own_stderr(tmp_path):
    """A data loader's process, forked from the worker, that a fatal signal ends: its stacks go to
    its stderr, not into the worker's file, where the launcher would read them as the worker's
    own end. The worker's own still go to the file."""
    record = tmp_path / "records" / "run" / "attempt_0" / "0"
    record.mkdir(parents=True)
    forking = (
        "import os\nfrom phalanx import failures\nfailures.keep_fatal_stacks()\n"
        "pid = os.fork()\nif not pid:\n    os.abort()\n"
        "_, status = os.waitpid(pid, 0)\nprint(os.WTERMSIG(status), flush=True)\nos.abort()"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(record / "error.json")}
    done = subprocess.run(
        [sys.executable, "-c", forking], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGABRT
    assert done.stdout.strip() == str(int(signal.SIGABRT))  # the child was ended by it too
    assert done.stderr.count("Fatal Python error: Aborted") == 1, done.stderr  # the child's
    assert (record / failures.FATAL).read_text().count("Fatal Python error: Aborted") == 1


@pytest.mark.parametrize(
    ("text", "attempt", "code"),
    [
        ("143", "2", 143),  # the launcher's, after a signal: every attempt's workers end
        ("1 1", "1", 1),  # a failed worker's: its own attempt's workers end
        ("1 1", "2", None),  # a failed worker of the previous attempt: not this one's business
        ("", "2", None),  # nothing written yet
        ("1 x y", "2", None),
    ],
)
def test_the_abort_file_ends_only_the_attempts_it_names(text, attempt, code):
    from phalanx.spawned import abort_code

    assert abort_code(text, attempt) == code


def test_a_writer_ended_before_its_rename_leaves_no_request_and_its_file_is_cleared(
    tmp_path, monkeypatch
):
    """A failed worker that the launcher ends while it writes the abort file must not leave an empty
    one: read as a request of every attempt, it ended the next attempt's workers at their start."""
    import os

    from phalanx import launch
    from phalanx.spawned import ABORT_FILE, write_whole

    def ended(*args):
        raise OSError("ended before the rename")

    monkeypatch.setattr(os, "replace", ended)
    write_whole(tmp_path / ABORT_FILE, "1 0")
    assert not (tmp_path / ABORT_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{ABORT_FILE}.{os.getpid()}.tmp"]
    monkeypatch.undo()
    launch.clear_requests(tmp_path)
    assert list(tmp_path.iterdir()) == []
    write_whole(tmp_path / ABORT_FILE, "1 0")
    assert (tmp_path / ABORT_FILE).read_text() == "1 0"


def test_an_error_file_cut_short_by_the_process_ending_keeps_the_whole_record_before_it(
    tmp_path, monkeypatch
):
    """A worker told to stop records that from its guard thread and ends the process, while its main
    thread may be recording its own error in the same file: the process can end in the middle of
    that write. The file must hold one whole record still, which torch's launcher reads (a file cut
    short made it fail with a JSONDecodeError traceback in place of the run's error)."""
    import json

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    failures.record_stop()

    def cut_short(data, f, **kwargs):
        f.write('{"message": ')
        f.flush()
        raise SystemExit(1)  # the guard's os._exit, as far as the file can tell

    monkeypatch.setattr(json, "dump", cut_short)
    with pytest.raises(SystemExit):
        try:
            raise RuntimeError("the gloo connection closed")
        except RuntimeError as e:
            failures.record(e)
    monkeypatch.undo()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "rank 0 was told to stop: another worker ended"


def test_a_stop_recorded_as_the_error_is_being_recorded_leaves_the_error(tmp_path, monkeypatch):
    """The guard thread looks for a record, finds none, and records its stop; the main thread's own
    error may land in between. The error is the one to keep."""
    import os

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        raise RuntimeError("the gloo connection closed")
    except RuntimeError as e:
        failures.record(e)
    # as if the guard had looked before the error was recorded
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    failures.record_stop()
    monkeypatch.undo()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: the gloo connection closed"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_a_rank_another_stopped_exits_with_the_signal_the_launcher_received(tmp_path):
    """The launcher passes a signal on as a request file, which each rank looks for every 0.2 s;
    the rank that reads it first stops every rank through the step's agreement. A rank stopped so
    before it looked still exits with the launcher's signal (138 for SIGUSR1), not SIGTERM's: the
    launcher's exit code is its first worker's. Without a request, another rank's own signal gives
    SIGTERM's code."""
    from phalanx.signals import GracefulStop

    request = tmp_path / "stop-requested"
    late = GracefulStop()
    late.watch(request)
    assert not late.requested  # it looked: nothing asked yet
    request.write_text(str(int(signal.SIGUSR1)))  # then the launcher asks, and another rank reads
    assert late.exit_code() == 128 + signal.SIGUSR1

    other = GracefulStop()
    other.watch(tmp_path / "never-written")
    assert other.exit_code() == 128 + signal.SIGTERM


# A worker that serves (no training: the launcher's SIGTERM ends it at once), its guard thread not
# started, so that only the signal's path can leave a record.
_SERVING = """
import os, sys, time
from pathlib import Path
from phalanx import signals, spawned
signals.end_at_once_on_signals()
guard = spawned._Guard(Path(sys.argv[1]), os.getppid())
signals.before_exit(guard.last_words)
def serving():
    print("serving", flush=True)
    time.sleep(120)
serving()
"""


@pytest.mark.parametrize("aborted", [True, False])
def test_a_worker_the_launcher_ends_before_its_guard_looked_still_leaves_its_stack(
    tmp_path, aborted
):
    """Once a worker has failed (and written ABORT_FILE), the launcher ends the others with SIGTERM,
    which can come before a worker's guard thread looks at ABORT_FILE again; a rank that is not
    training (a parameter server) ends at the signal. It leaves its stack and the record that it
    was told to stop all the same, for the error's "every rank's stack when the job ended". A
    SIGTERM with no abort under way (an elastic job's re-forming) leaves neither."""
    from phalanx.spawned import ABORT_FILE, STACKS

    record = tmp_path / "error.json"
    proc = _as_worker(_SERVING, 2, 3, record, str(tmp_path))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
        if aborted:  # rank 0 failed in attempt 0
            (tmp_path / ABORT_FILE).write_text("1 0")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    stack = tmp_path / STACKS / "rank-2.txt"
    if aborted:
        # in `serving`: its print or its sleep, wherever the signal found it
        assert "in serving" in stack.read_text(), stack.read_text()
        assert "rank 2 was told to stop" in record.read_text()
    else:
        assert not stack.exists() and not record.exists()


# The worker of rank 1, which rejoins when it dies (as a param_server worker with restarts): the
# process the launcher starts supervises a child that trains, here `procs.hang`.
_SUPERVISED = """
import os, sys
sys.path.insert(0, sys.argv[2])
import procs
from phalanx import spawned
spawned.worker(sys.argv[1], os.getppid(), procs.hang, ())
"""


def test_a_rejoining_ranks_stack_is_where_its_trainer_hung_not_its_supervisors_wait(tmp_path):
    """A rank that rejoins trains in a child of the process the launcher started, which waits for
    it. When the job aborts, the launcher ends that process with SIGTERM: the rank's stack is still
    the child's, where it hung, not the wait; and the child ends with it."""
    from phalanx.spawned import ABORT_FILE, STACKS

    tests = str(Path(__file__).parents[1])
    proc = _as_worker(
        _SUPERVISED, 1, 3, tmp_path / "error.json", str(tmp_path), tests, PHALANX_REJOINS="1:1"
    )
    hanging, stack = tmp_path / "hanging", tmp_path / STACKS / "rank-1.txt"
    try:
        _wait_for(lambda: hanging.is_file() or proc.poll() is not None)
        assert hanging.is_file(), proc.communicate(timeout=60)
        (tmp_path / ABORT_FILE).write_text("1 0")  # rank 0 failed in attempt 0
        proc.send_signal(signal.SIGTERM)  # and the launcher ends the others
        proc.communicate(timeout=60)
        child = int(hanging.read_text())
        _wait_for(lambda: not _alive(child))
    finally:
        proc.kill()
    text = stack.read_text()
    assert "in hang" in text, text
    assert "_supervise" not in text, text


# A worker as torch's agent runs it: after the entry point returns, its wrapper hands the result on
# and waits until the agent has read it.
_WRAPPED = """
import os, sys, threading
from phalanx import spawned
def interrupted(run_dir):
    return 143  # the run finished its step on the agent's SIGTERM, saved and ended
code = spawned.worker(sys.argv[1], os.getppid(), interrupted, ())
print("returned", code, flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("reforming", [True, False])
def test_a_worker_stopped_for_a_new_round_of_machines_ends_without_handing_on_its_result(
    tmp_path, reforming
):
    """When an elastic job's machines change, torch's agent stops the workers with SIGTERM and
    reads none of their results: a worker that finished its step and saved ends its process itself,
    where torch's wrapper would hold it until the agent's grace ran out (30 s, then SIGKILL, at
    every change). Outside a re-forming the result goes back to the wrapper, as torch expects."""
    from phalanx.spawned import REFORM_FILE

    if reforming:
        (tmp_path / REFORM_FILE).write_text("1")  # the agent's mark, before its SIGTERM
    proc = _as_worker(_WRAPPED, 0, 2, tmp_path / "error.json", str(tmp_path))
    try:
        if reforming:
            out, err = proc.communicate(timeout=60)  # a hang guard: it ends at once
            assert proc.returncode == 143 and "returned" not in out, (out, err)
        else:
            assert proc.stdout is not None and proc.stdout.readline() == "returned 143\n"
            assert proc.poll() is None  # in the wrapper's wait
    finally:
        proc.kill()
        proc.communicate()


def _as_worker(
    script: str, rank: int, world: int, record: Path, *args: str, **env: str
) -> subprocess.Popen:
    """`python -c script *args` in the environment torch's launcher gives worker `rank` of `world`
    in its first attempt (its error record at `record`), with `env` added; its output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env={
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_ERROR_FILE": str(record),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (one that ended and was not yet reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize("attempt", [0, 2])
def test_a_timeout_names_the_ranks_whose_stack_is_not_in_the_run(tmp_path, monkeypatch, attempt):
    """A timeout's error points to every rank's stack; where a rank ended before it wrote one, the
    error says which, instead of claiming all (the ranks of the failing attempt: its stacks carry
    the attempt's number after a restart)."""
    stacks = tmp_path / "run" / "stacks"
    stacks.mkdir(parents=True)
    suffix = f"-attempt-{attempt}" if attempt else ""
    for rank in range(3):
        (tmp_path / "records" / "run_x" / f"attempt_{attempt}" / str(rank)).mkdir(parents=True)
    record = tmp_path / "records" / "run_x" / f"attempt_{attempt}" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(record))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    failures.record(TimeoutError(), "rank 1 did not reach the all-reduce of step 3 in time")
    noticed = ProcessFailure(local_rank=0, pid=4242, exitcode=1, error_file=str(record))
    failure = ChildFailedError("worker", {0: noticed})

    def said() -> str:
        return str(failures.explain(failure, tmp_path / "records", stacks))

    for rank in (0, 1):
        (stacks / f"rank-{rank}{suffix}.txt").write_text("Thread 0x1 (most recent call first):")
    assert said() == (
        "rank 1 did not reach the all-reduce of step 3 in time; the ranks' stacks when the job "
        f"ended: {stacks} (none from rank 2: it ended before it could write one)"
    )
    (stacks / f"rank-2{suffix}.txt").write_text("Thread 0x1 (most recent call first):")
    assert said() == (
        "rank 1 did not reach the all-reduce of step 3 in time; every rank's stack when the job "
        f"ended: {stacks}"
    )


def test_a_rank_whose_peers_do_not_join_in_time_says_so_and_names_the_setting(monkeypatch):
    """Joining the process group waits parallel.timeout_s for every process: where one starts
    slower (or never), the error names the wait, the count and the setting, not torch's store
    traceback. Rank 0 of two, its peer never started, a real store on loopback."""
    import socket

    import torch.distributed as dist

    from phalanx.errors import ConfigError
    from phalanx.strategies.distributed import ProcessGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as told:
        ProcessGroup("cpu", timeout_s=1)
    said = str(told.value)
    assert said.startswith("rank 0 waited 1 s (parallel.timeout_s) for the job's 2 processes")
    assert said.endswith("raise parallel.timeout_s, which also bounds every collective")
    assert not dist.is_initialized()


# A worker's guard whose launcher (the pid given) is not its parent: it ends the worker at once.
_ORPHAN = """
import os, sys, time
from pathlib import Path
from phalanx import spawned
spawned._Guard(Path(sys.argv[1]), os.getppid() + 1000000).start()
time.sleep(60)
"""


@pytest.mark.parametrize("incarnation", [None, "1"])
def test_a_worker_whose_parent_has_gone_says_which_parent_it_was(tmp_path, incarnation):
    """A rank that rejoins trains in a child of the process the launcher started: when that
    process is gone, the child names it as its supervisor, not as the launcher."""
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_INCARNATION"}
    env.update(RANK="2", WORLD_SIZE="3")
    if incarnation is not None:
        env["PHALANX_INCARNATION"] = incarnation
    ended = subprocess.run(
        [sys.executable, "-c", _ORPHAN, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.returncode == 1
    parent = "rank 2's supervisor" if incarnation else "the launcher"
    assert f"phalanx: {parent} (pid " in ended.stderr
    assert ended.stderr.rstrip().endswith("has ended; worker rank 2 stops")


def test_the_workers_of_each_launch_fork_from_a_server_started_in_that_launchs_environment(
    tmp_path, monkeypatch
):
    """Each launch's workers fork from a server that imported torch once for them (their parent, not
    the launcher), started with the launch and ended with it: a second launch in the same process
    sees the environment as it is then, not as the first saw it, with the launcher's settings."""
    import json
    from multiprocessing import forkserver

    import procs

    from phalanx import launch

    if launch.start_method() != "forkserver":
        pytest.skip("no forkserver or no pidfd here: the workers are spawned")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    # this process's own server (a user's), set aside for each launch and given back after it
    forkserver.ensure_running()
    users = forkserver._forkserver._forkserver_pid
    servers = set()
    for mark in ("first", "second"):
        monkeypatch.setenv("PHALANX_TEST_MARK", mark)
        assert launch.launch(tmp_path, 2, procs.report) == 0
        seen = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in (0, 1)]
        assert [s["mark"] for s in seen] == [mark, mark]
        assert [s["world"] for s in seen] == ["2", "2"]
        assert {s["gloo"] for s in seen} <= {"lo", "lo0"} and seen[0]["gloo"]
        [server] = {s["parent"] for s in seen}
        assert server != os.getpid()
        assert not Path(f"/proc/{server}").exists(), "the server outlived its launch"
        servers.add(server)
        assert forkserver._forkserver._forkserver_pid == users and server != users
    assert len(servers) == 2
    assert Path(f"/proc/{users}").exists()


def test_a_launchs_server_is_ended_with_the_launch_even_one_that_would_not_end():
    """Each worker holds the server's pipe, and a server asked to end tears down an interpreter that
    imported torch: one stuck, or merely slow, would keep the launcher waiting. The launch's end
    kills it and reaps it."""
    from phalanx import launch

    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        launch._stop_server(stuck.pid, None)
        assert not Path(f"/proc/{stuck.pid}").exists()  # killed and reaped
    finally:
        stuck.kill()


# A worker forked from a server that is killed while the launcher (this test's process) lives: the
# launcher's agent no longer knows of it, and it ends.
_FORKED = """
import os, sys, time
from pathlib import Path
from phalanx import spawned
child = os.fork()
if child == 0:
    spawned._Guard(Path(sys.argv[1]), int(sys.argv[2])).start()
    time.sleep(60)
    os._exit(0)
Path(sys.argv[1], "worker").write_text(str(child))
time.sleep(60)
"""


def test_a_worker_whose_server_is_killed_ends_and_names_it(tmp_path):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    with open(tmp_path / "stderr", "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-c", _FORKED, str(tmp_path), str(os.getpid())], env=env, stderr=err
        )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "worker").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int((tmp_path / "worker").read_text())
        time.sleep(0.5)  # its guard running
        server.kill()
        server.wait()
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists()
    finally:
        server.kill()
    said = (tmp_path / "stderr").read_text()
    assert f"the server this worker forked from (pid {server.pid}) has ended" in said, said
    assert "worker rank 1 stops" in said


def test_a_watched_process_that_is_not_the_watchers_parent_is_seen_to_end():
    """A worker forked from the server watches its launcher, which is not its parent; an ended
    process counts before anyone reaps it."""
    from phalanx.spawned import Watch

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = Watch(sleeper.pid)
        assert not watch.ended()
        sleeper.kill()
        deadline = time.monotonic() + 30
        while not watch.ended() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.ended()
        assert sleeper.poll() == -signal.SIGKILL  # reaped only now
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_workers_own_children_start_as_the_launchers_would(tmp_path, monkeypatch):
    """A worker forked from the launcher's server has the server's start method (forkserver); its
    DataLoader workers start with the launcher's instead, or with none chosen where the launcher
    chose none (asking the launcher for its method does not choose one for it)."""
    import multiprocessing

    from phalanx import environment, launch, spawned

    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method(None, force=True)
        settings = launch._workers_settings(tmp_path, None)
        assert settings[environment.START_METHOD] == ""
        assert multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("forkserver", force=True)  # as in a forked worker
        monkeypatch.setenv(environment.START_METHOD, "")
        spawned._start_children_as_the_launcher()
        assert multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("spawn", force=True)
        assert launch._workers_settings(tmp_path, None)[environment.START_METHOD] == "spawn"
        multiprocessing.set_start_method("forkserver", force=True)
        monkeypatch.setenv(environment.START_METHOD, "spawn")
        spawned._start_children_as_the_launcher()
        assert multiprocessing.get_start_method(allow_none=True) == "spawn"
    finally:
        multiprocessing.set_start_method(before, force=True)
