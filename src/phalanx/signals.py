"""Signals: SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (a cluster's notice of preemption).

Before training starts (start-up: imports, the run directory, the model, the data), a signal raises
`Interrupted`: the command removes the run directory it created and exits with 128 + the signal's
number, printing `phalanx: interrupted`.

Once training runs, the first signal finishes the current step, saves and exits with 128 + the
signal number (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1); a second one exits at once,
removing any half-written checkpoint.

phalanx's launcher relays the signals it receives to its workers through files in the run
directory. A signal sent to one worker directly (a scheduler preempting it) is that worker's stop
request once training runs: the ranks agree on stop flags at every step, so every rank finishes
the same step and the checkpoint is saved once. Before training runs, and after, a signal ends a
worker at once (the launcher ending it). A data loader's worker, forked with the training process's
handlers, leaves SIGINT (a terminal's Ctrl-C, sent to the whole process group) to that process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TypeAlias

log = logging.getLogger("phalanx")
# what signal.signal takes and returns: a function, SIG_DFL or SIG_IGN, or None (a handler not set
# from Python)
Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
SIGNALS = (signal.SIGINT, signal.SIGTERM, *([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []))
_worker = False  # set in a worker of phalanx's launcher
# in such a worker, while it is not training: every signal ends the process at once
_at_once = False
# the process whose half-written checkpoints a signal removes (not a forked child's)
_pid = os.getpid()
# in a worker: what it leaves in the run before a signal ends it at once (see `before_exit`)
_last_words: Callable[[], None] | None = None


class Interrupted(KeyboardInterrupt):
    """A signal arrived before training started (or, in the launcher, a second one): stop now."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum: int, frame: object = None) -> None:
    """A signal handler: raise `Interrupted` (SIGTERM too, whose default would kill the process
    without any clean-up)."""
    raise Interrupted(signum)


def install_startup_handlers() -> dict[int, Handler]:
    """Until training starts, SIGINT and SIGTERM raise `Interrupted`. Returns the handlers
    replaced."""
    return {sig: signal.signal(sig, raise_interrupted) for sig in SIGNALS}


def restore(handlers: dict[int, Handler]) -> None:
    for sig, handler in handlers.items():
        # None: a handler not set from Python, which cannot be put back
        if handler is not None:
            signal.signal(sig, handler)


def exit_at_once(signum: int, frame: object = None) -> None:
    """A signal handler: remove any half-written checkpoint and exit with 128 + the signal
    number."""
    # a forked child (a data loader's worker) owns no checkpoint in progress, nor the run's records
    if os.getpid() == _pid:
        # first: the import below may have to load the module, in a process that saves none
        if _last_words is not None:
            with contextlib.suppress(Exception):  # the exit must come, whatever the record does
                _last_words()
        from phalanx import checkpoint

        checkpoint.abort_in_progress()
    os._exit(128 + signum)


def end_at_once_on_signals() -> None:
    """For a worker of phalanx's launcher: from now on, a signal ends this process at once, except
    while it trains (`GracefulStop` installed), when the first is a stop request."""
    global _worker, _at_once, _pid
    _worker, _at_once, _pid = True, True, os.getpid()
    for sig in SIGNALS:
        signal.signal(sig, exit_at_once)


def before_exit(last_words: Callable[[], None]) -> None:
    """In a worker: call `last_words()` before a signal ends this process at once (its records of
    an aborted job, which the launcher's SIGTERM may bring before the worker's own watch saw the
    abort)."""
    global _last_words
    _last_words = last_words


# A signal's handler runs in the main thread between two Python instructions: not while the main
# thread waits in a native call, such as a message from a peer that has died. Inside `waiting()`,
# a thread of its own sees each signal (through the interpreter's wakeup fd) and, where the wait
# has not ended `WAIT_GRACE_S` later, ends the process as `exit_at_once` would.
WAIT_GRACE_S = 2.0
_waits = 0  # the main thread's waits under way (nested)
# the read end of the wakeup fd's pipe, once made
_wakeup: int | None = None


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a wait in a native call that only a peer can end (a point-to-point message): a signal
    that arrives during it ends the process once the wait has outlasted `WAIT_GRACE_S` (a peer
    that died never answers; the launcher's SIGTERM must still end this process). Call it from the
    main thread."""
    global _waits
    _watch_signals()
    _waits += 1
    try:
        yield
    finally:
        _waits -= 1


def _watch_signals() -> None:
    global _wakeup
    if _wakeup is not None or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _wakeup = read
    threading.Thread(
        target=_signals_in_waits, args=(read,), name="phalanx-waits", daemon=True
    ).start()


def _signals_in_waits(read: int) -> None:
    while True:
        try:
            got = os.read(read, 16)
        except OSError:
            return
        if not got or not _waits:
            # the main thread runs Python: its own handler takes the signal
            continue
        deadline = time.monotonic() + WAIT_GRACE_S
        while _waits and time.monotonic() < deadline:
            time.sleep(0.05)
        if _waits:  # still waiting: a peer that will not answer
            exit_at_once(got[-1])


class GracefulStop:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Handler] = {}
        self._request_file: Path | None = None
        self._reform_file: Path | None = None
        # the hooks start: a signal ends the run before its first step
        self._starting = False
        self._checked = 0.0
        # the training process, whose handlers forked children inherit
        self._pid = os.getpid()

    @property
    def requested(self) -> bool:
        if (
            self.signum is None
            and self._request_file is not None
            and time.monotonic() - self._checked > 0.2
        ):
            self._checked = time.monotonic()
            self._read_request()
        return self.signum is not None

    def _read_request(self) -> None:
        """The signal the launcher asks on behalf of (it received it), where it has asked."""
        if self._request_file is not None and self._request_file.exists():
            self.signum = int(self._request_file.read_text() or signal.SIGTERM)

    def watch(self, request_file: Path, reform_file: Path | None = None) -> None:
        """Also count a stop as requested once `request_file` exists (written by the launcher). A
        signal that comes while `reform_file` exists is an elastic job's agent stopping the workers
        for a new round of machines: said as such."""
        self._request_file, self._reform_file = request_file, reform_file

    @property
    def reforming(self) -> bool:
        """Whether an elastic job's machines re-form now: its agent stops the workers (SIGTERM, to
        some ranks; the others stop with them) for a new round, not a user."""
        return self._reform_file is not None and self._reform_file.exists()

    def exit_code(self) -> int:
        """128 + the signal's number; SIGTERM's where another rank received it. A stop the launcher
        asked for (it received the signal) is read once more first: another rank may have read the
        request and stopped every rank before this one looked (it looks every 0.2 s)."""
        if self.signum is None:
            self._read_request()
        return 128 + (self.signum or signal.SIGTERM)

    def install(self) -> None:
        """Take SIGINT and SIGTERM until `restore`; Python lets only the main thread take signals,
        so a run started from another thread (phalanx.fit in a thread) keeps the handlers it
        found."""
        global _at_once
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _at_once = False

    def restore(self) -> None:
        global _at_once
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _at_once = _worker

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While the hooks start (a tracker that contacts its server), a signal raises
        `Interrupted` at once: there is no step to finish, and a wait on the network ends."""
        self._starting = True
        try:
            yield
        finally:
            self._starting = False

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and os.getpid() != self._pid:
            # a data loader's worker, forked with this handler: a terminal's Ctrl-C reaches the
            # whole process group, and the training process finishes its step and ends the workers
            return
        if self.signum is not None or _at_once:
            exit_at_once(signum)
        if self._starting:
            raise Interrupted(signum)
        self.signum = signum
        if self.reforming:
            log.info(
                "the job re-forms (a machine joins): finishing the current step and saving; the "
                "workers then start again on the machines there are"
            )
            return
        log.warning(
            "%s received: finishing the current step and saving; send it again to exit at once",
            signal.Signals(signum).name,
        )
