"""One process trains in a run directory at a time.

`phalanx train` and `phalanx resume` hold an OS advisory lock (`flock`) on `.lock` in the run
directory for the whole run: the launcher where it starts workers (they do not lock), rank 0 under
torchrun. The OS releases it when the holder ends, however it ends, so a killed run never leaves a
stale lock. The holder writes its pid, host and command in the file, for the error a second process
gets, and removes the file when it is done: a command that fails leaves the run directory as it was.

A lock file that no process holds is a holder that ended without removing it: killed (a SIGKILL,
the out-of-memory killer, a crash in native code, a machine that went down). `phalanx ls` tells
such a run from one that trains (`state`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType

from phalanx.errors import RunDirError

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

LOCK = ".lock"
# a second process's tries for a lock another holds an instant (`state`'s look) before it is refused
_TRIES, _PAUSE_S = 10, 0.02


class Lock:
    """A held lock on a run directory, until `release()` or the end of this process."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        # removed while held: the run directory was discarded
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)  # releases the lock
        self.fd = None


@contextlib.contextmanager
def hold(run_dir: Path, command: str) -> Iterator[Lock]:
    """Hold the run directory's lock while the block runs; a RunDirError naming the holder if
    another process holds it."""
    lock = acquire(run_dir, command)
    try:
        yield lock
    finally:
        lock.release()


def acquire(run_dir: Path, command: str) -> Lock:
    """Lock `run_dir` for this process, or raise a RunDirError naming the process that holds it."""
    path = Path(run_dir) / LOCK
    if fcntl is None:
        return Lock(path, None)
    tries = _TRIES
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise RunDirError(
                f"cannot write in {str(run_dir)!r} ({e.strerror or e}): training writes its lock, "
                "logs and checkpoints there; make it writable, or copy the run to a folder you can "
                "write and resume the copy"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            tries -= 1
            if tries > 0:  # held for a look (`state`), or by a holder about to end
                time.sleep(_PAUSE_S)
                continue
            raise RunDirError(
                f"{str(run_dir)!r} is in use: {holder(path)} is training in it; wait for it to "
                "end, or stop it, and try again"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        # the holder before removed the file between its opening and its locking: again
        os.close(fd)
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "since": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return Lock(path, fd)


def state(run_dir: Path) -> str | None:
    """Whether a process trains in `run_dir` now ("held"), or the last one to lock it ended without
    a word ("left": its lock file stays, unheld); None where neither is known (no lock file, or a
    system without locks). Looks for an instant, with a shared lock, and never creates the file."""
    path = Path(run_dir) / LOCK
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # not there: no holder, or one that ended as it should
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        except OSError:
            return None
        # a holder writes who it is at once: an empty file is one still starting
        return "left" if os.fstat(fd).st_size else None
    finally:
        os.close(fd)  # releases the look


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def holder(path: Path) -> str:
    """Who holds the lock, as its file says."""
    try:
        info = json.loads(path.read_text())
        since = datetime.fromtimestamp(info["since"]).strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"`phalanx {info['command']}` (pid {info['pid']} on host {info['host']}, since {since})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "another phalanx process"
