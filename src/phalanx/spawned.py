"""What runs in each worker process that phalanx's launcher starts (`launch`), around the
training: its entry point (`worker`), which leaves the terminal's process group and records a
failure for the launcher; the supervisor of a rank that rejoins, which trains in a child and starts
another where one dies; and the guard thread that ends the worker when its launcher is gone or an
abort is asked for, writing where this rank was (its stack) first.

It imports nothing of the launcher's side: the workers and the launcher share the files below.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from phalanx import environment, failures, signals
from phalanx.errors import PhalanxError

# in the run directory: the workers exit at once; it holds their exit code
ABORT_FILE = ".stop-now"
# a worker ran out of device memory; it holds the worker's rank
OOM_FILE = ".out-of-memory"
# in the run directory: each rank's Python stack when the job ended abnormally
STACKS = "stacks"
# in the run directory while an elastic job's machines re-form: its agent stops the workers
REFORM_FILE = ".re-forming"
GUARD_INTERVAL_S = 0.1


def worker(run_dir: str, launcher_pid: int, run: Callable[..., int], args: tuple) -> int:
    """Entry point of each worker process (picklable, module level): `run(run_dir, *args)`."""
    _detach_from_terminal()
    _start_children_as_the_launcher()
    failures.keep_fatal_stacks()
    rejoins = _rejoins(environment.here().rank)
    supervising = bool(rejoins) and environment.INCARNATION not in os.environ
    # the stack of a rank that rejoins is its child's, which trains: not this process's wait
    guard = _Guard(Path(run_dir), launcher_pid, stacks=not supervising)
    guard.start()
    signals.before_exit(guard.last_words)
    if supervising:
        code = _supervise(run_dir, run, args, rejoins)
    else:
        code = _trained(run_dir, run, args)
    if (Path(run_dir) / REFORM_FILE).exists():
        # torch's agent is stopping this round's workers for the next one: it reads no worker's
        # result, and its wrapper would hold this process, its result given, until the agent's
        # grace for stopping ends in SIGKILL (30 s for every change of the machines)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _trained(run_dir: str, run: Callable[..., int], args: tuple) -> int:
    """`run(run_dir, *args)`'s exit code; a failure is recorded for the launcher, and ends this
    process."""
    try:
        return run(Path(run_dir), *args)
    except BaseException as e:  # noqa: BLE001 - every failure is recorded for the launcher, once
        from phalanx.strategies import progress

        dump_stacks(Path(run_dir))
        failures.record(e, progress.explain(e))
        # the launcher may go on with more micro-batches a step
        if _out_of_memory(e):
            write_whole(Path(run_dir) / OOM_FILE, str(environment.here().rank))
        # the other workers of this attempt need not wait for their timeout (the next attempt's
        # ignore it)
        write_whole(Path(run_dir) / ABORT_FILE, f"1 {environment.here().attempt}")
        sys.stdout.flush()
        os._exit(2 if isinstance(e, PhalanxError) else 1)


def _rejoins(rank: int) -> int:
    """How often this rank's worker is started again alone when it dies (0: it is not)."""
    ranks, _, times = os.environ.get(environment.REJOINS, "").partition(":")
    return int(times) if str(rank) in ranks.split(",") else 0


def _supervise(run_dir: str, run: Callable[..., int], args: tuple, rejoins: int) -> int:
    """A worker that rejoins: this process trains in a child, and starts another in its place when
    one dies by a signal (killed, or out of host memory), `rejoins` times at most; the launcher
    sees this process, which goes on, and the other workers go on too. A child that fails with an
    error has recorded it (as a worker does); this process ends with its code."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rank = environment.here().rank
    for incarnation in range(rejoins + 1):
        child = context.Process(
            target=_incarnation, args=(run_dir, os.getpid(), run, args, incarnation)
        )
        child.start()
        child.join()
        code = child.exitcode if child.exitcode is not None else 1
        if code == 0:
            return 0
        # as the worker would have ended (see `worker`)
        if code > 0 or incarnation == rejoins:
            sys.stdout.flush()
            os._exit(code if code > 0 else 128 - code)
        _stderr(
            f"phalanx: worker rank {rank} ended by signal {-code}; a new one takes its place "
            f"while the others go on ({incarnation + 1} of {rejoins})"
        )
    # not reached: the last incarnation returns above
    return 1


def _incarnation(
    run_dir: str, parent_pid: int, run: Callable[..., int], args: tuple, incarnation: int
) -> None:
    os.environ[environment.INCARNATION] = str(incarnation)
    sys.exit(worker(run_dir, parent_pid, run, args))


def _out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError)


def _detach_from_terminal() -> None:
    """Leave the terminal's process group, so that a Ctrl-C reaches the launcher alone; from now on
    a signal (the launcher ending this worker) ends it at once. The launcher started this process
    with SIGINT and SIGTERM blocked: one that arrived during its start-up is handled now."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpgrp()
    _no_signal_on_launcher_death()
    signals.end_at_once_on_signals()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.SIGNALS)


def _start_children_as_the_launcher() -> None:
    """This worker's own children (its DataLoader workers) start as they would in the launcher's
    process, not as this worker did. A worker forked from the launcher's server inherits the
    server's start method, forkserver: its DataLoader workers would be children of a server of its
    own, which they keep alive, so that neither notices when this worker ends (killed, or ended at
    once after a failure) and both outlive the job, holding its terminal's output open."""
    import multiprocessing

    method = os.environ.get(environment.START_METHOD)
    if method == "":  # none chosen there: the platform's default, chosen at the first use
        multiprocessing.set_start_method(None, force=True)
    elif method in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method(method, force=True)


def _no_signal_on_launcher_death() -> None:
    """torch's spawn asks Linux for SIGINT when the launcher's thread that started this worker ends
    (PR_SET_PDEATHSIG). A worker that is training takes a SIGINT for a user's stop request: it would
    save and end the whole job gracefully, as if asked to, when its machine's launcher was killed.
    No signal, then: `_Guard` sees the launcher gone and ends this worker, saying so."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such request was made
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Watch:
    """Whether a process has ended, asked without waiting. Through a pidfd on Linux: it tells that
    process's end (a zombie counts as ended), never a later process's that took its pid, and the
    process need not be this one's parent (a worker forked from the launcher's server is the
    server's child). Where there is no pidfd, whether the process is still this one's parent (the
    launcher then spawns its workers: see `launch.start_method`)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._poll: select.poll | None = None
        self._ended = False
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            self._ended = True
        except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
            pass
        else:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    def ended(self) -> bool:
        if self._ended or self._poll is None:
            return self._ended or os.getppid() != self.pid
        self._ended = bool(self._poll.poll(0))
        return self._ended


class _Guard(threading.Thread):
    """Ends this worker at once when its launcher is gone (a rejoining rank's trainer: its
    supervisor), or has written ABORT_FILE."""

    def __init__(self, run_dir: Path, launcher_pid: int, stacks: bool = True):
        super().__init__(name="phalanx-guard", daemon=True)
        self.run_dir, self.abort, self.launcher_pid = run_dir, run_dir / ABORT_FILE, launcher_pid
        self.launcher = Watch(launcher_pid)
        # the process this one was started from: the launcher, or the server it forked from, whose
        # end (killed: the launcher no longer knows of this worker) ends this worker too
        self.parent = os.getppid()
        self.attempt = str(environment.here().attempt)
        self.stacks = stacks  # whether this process's stack is its rank's

    def run(self) -> None:
        while True:
            launcher_gone = self.launcher.ended()  # read first: an abort is written before
            # (a spawned worker's parent is the launcher: `Watch` has asked already)
            gone = launcher_gone or (
                self.parent != self.launcher_pid and os.getppid() != self.parent
            )
            code = self._aborted()
            # (with the launcher gone too: a rejoining rank's supervisor, ended as the job aborts)
            if code is not None:
                self._record_stop()
                _end(code)
            if gone:
                # a rejoining rank's trainer runs in a child of the process the launcher started
                parent = (
                    f"rank {environment.here().rank}'s supervisor"
                    if environment.INCARNATION in os.environ
                    else "the launcher"
                )
                pid = self.launcher_pid
                if not launcher_gone:
                    parent, pid = "the server this worker forked from", self.parent
                _stderr(
                    f"phalanx: {parent} (pid {pid}) has ended; "
                    f"worker rank {environment.here().rank} stops"
                )
                _end(1)
            time.sleep(GUARD_INTERVAL_S)

    def last_words(self) -> None:
        """Before a signal ends this worker at once: where the job is aborting, what this thread
        would have recorded. The launcher ends the others with SIGTERM once a worker has failed,
        which can come before this thread's next look at ABORT_FILE (a rank that is not training,
        such as a parameter server, ends at the signal)."""
        if self._aborted() is not None:
            self._record_stop()

    def _aborted(self) -> int | None:
        try:
            return abort_code(self.abort.read_text(), self.attempt)
        except OSError:
            return None

    def _record_stop(self) -> None:
        # where this rank was (stuck, perhaps) when the job ended
        if self.stacks:
            dump_stacks(self.run_dir)
        failures.record_stop()


def abort_code(text: str, attempt: str) -> int | None:
    """The exit code that ABORT_FILE's `text` asks of a worker of `attempt`: "CODE" from the
    launcher (a signal) ends every attempt's workers, "CODE ATTEMPT" from a worker that failed only
    its own attempt's. None where it asks nothing of this attempt, or is not (yet) a request."""
    try:
        code, *of = text.split()
        return int(code) if of in ([], [attempt]) else None
    except ValueError:  # empty, or not a number
        return None


def dump_stacks(run_dir: Path) -> None:
    """Every thread's Python stack of this worker into `stacks/rank-<R>.txt` (`-attempt-<A>` after a
    restart), by faulthandler: it works while the main thread is stuck in a native call."""
    place = environment.here()
    name = f"rank-{place.rank}" + (f"-attempt-{place.attempt}" if place.attempt else "") + ".txt"
    with contextlib.suppress(OSError):
        (run_dir / STACKS).mkdir(exist_ok=True)
        with open(run_dir / STACKS / name, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)


def _end(code: int) -> None:
    from phalanx import checkpoint

    checkpoint.abort_in_progress()
    os._exit(code)


def _stderr(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def write_whole(path: Path, text: str) -> None:
    """Whole or not at all: a worker the launcher ends while it writes ABORT_FILE must not leave an
    empty file, which would end the next attempt's workers too. Each writer renames its own
    temporary file (two workers of one attempt may fail at once)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        # the run directory is gone: there is nothing left to stop
        pass
