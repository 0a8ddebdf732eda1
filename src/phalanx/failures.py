"""Which worker failed first, and how: each worker records its error (or that it was told to
stop) in the file torch's launcher gives it, and the launcher reads every rank's record of every
attempt to name the first failure, not the first error it happened to notice; the line also goes
into the run's log.txt and trace.jsonl, where a machine that died has no word of its own."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from phalanx import environment, rundir
from phalanx.errors import PhalanxError, first_line, in_your_code, lost_a_peer


class RankFailure(PhalanxError):
    """A worker process failed; the message holds its rank and traceback (or, where the user's own
    code raised, that code's frames alone: `whole` keeps the traceback for the run's log)."""

    def __init__(self, message: str, whole: str | None = None):
        super().__init__(message)
        self.whole = whole or message


FATAL = "fatal.txt"  # beside a worker's record: its threads' stacks, where a fatal signal ended it
_fatal: Any = None  # the open file faulthandler writes them to


def keep_fatal_stacks() -> None:
    """Where a fatal signal ends this worker (gloo's abort on collectives that do not match, a
    crash in native code), its threads' stacks go to a file beside its record, which the launcher
    moves into the run's stacks/ (`explain`), not into the terminal, where torch's launcher sends
    them."""
    global _fatal
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        _fatal = open(Path(path).with_name(FATAL), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.enable(file=_fatal, all_threads=True)
        if not _forks_watched:
            _watch_forks()


_forks_watched = False


def _watch_forks() -> None:
    """A process forked from the worker (a data loader's) writes a fatal signal's stacks to its
    stderr, not into the worker's file, where they would read as the worker's own end."""
    global _forks_watched
    _forks_watched = True

    def in_the_child() -> None:
        global _fatal
        if _fatal is None:
            return
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (AttributeError, OSError, RuntimeError, ValueError):  # no stderr to write to
            faulthandler.disable()
        with contextlib.suppress(OSError):
            _fatal.close()
        _fatal = None

    os.register_at_fork(after_in_child=in_the_child)


def record(e: BaseException, explained: str | None = None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        },
        "phalanx": {
            "time": time.time(),
            "user_error": isinstance(e, PhalanxError),
            "text": explained or str(e),
            "explained": explained is not None,
            "rank": environment.here().rank,
            "yours": None if explained is not None else _yours(e),
        },
    }
    _write(path, data)


def _yours(e: BaseException) -> str | None:
    """`in_your_code(e)`; None where that fails: the record must be written whatever the error."""
    try:
        return in_your_code(e)
    except Exception:  # noqa: BLE001 - the whole traceback is said instead
        return None


def record_stop() -> None:
    """Say, in this worker's error file, that it was told to stop: a worker that ends with no file
    at all ended without a word (a signal from outside, a crash in native code). Where the worker
    has recorded an error, that stays (even one recorded while this runs)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    rank = environment.here().rank
    stop = {
        "message": {  # in the form torch's launcher reads
            "message": f"rank {rank} was told to stop: another worker ended",
            "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))},
        },
        "phalanx": {"time": time.time(), "rank": rank, "stopped": True},
    }
    _write(path, stop, replace=False)


def _write(path: str, data: dict, replace: bool = True) -> None:
    """Whole or not at all: a worker's guard thread, told to stop, records that and ends the process
    while its main thread may be recording its own error in the same file; a file cut short there
    is one torch's launcher fails to parse (a JSONDecodeError traceback in place of the error).
    Each thread writes its own temporary file and renames it over the record (`replace`), or links
    it where there is none yet (a stop must not replace an error)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except OSError:  # FileExistsError: a record is there
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def explain(
    error: Any, records: Path, stacks: Path | None = None, first_rank: int | None = 0
) -> PhalanxError:
    """The first failure, and how. In this order: a rank's own error (one line for a user error;
    the ranks that did not arrive, for a collective's timeout; else its traceback); a rank killed
    by a signal; a rank of this machine that ended without a word (no error file: killed from
    outside, or crashed in native code). A rank's lost connection to another is a consequence:
    named only where nothing of this machine failed (another machine, or its rank, ended first)."""
    recorded, silent, fatal = _read_records(records, first_rank)
    errors = [info for info in recorded if not info.get("stopped")]
    causes = [
        info
        for info in errors
        if info["user_error"] or info.get("explained") or not lost_a_peer(info["callstack"])
    ]
    if causes:
        return _said(min(causes, key=lambda info: info["time"]), stacks, records, first_rank)
    signalled = [
        (rank, failure) for rank, failure in error.failures.items() if failure.exitcode < 0
    ]
    if signalled:
        rank, failure = min(signalled, key=lambda item: item[1].timestamp)
        # gloo aborts a process whose ranks call different collectives
        why = _ABORTED if failure.signal_name() == "SIGABRT" else _FROM_OUTSIDE
        return RankFailure(
            f"rank {rank} was killed by {failure.signal_name()} (exit code {failure.exitcode}) and "
            f"recorded no error: {why}{_moved(f'rank {rank}', fatal, stacks)}"
        )
    if silent and silent[0] in fatal:  # a fatal signal of its own, which faulthandler saw
        crashed = silent[0]
        with contextlib.suppress(OSError):
            lines = [line.strip() for line in fatal[crashed].read_text().splitlines()]
            said = next((line for line in lines if line), "a fatal signal")
            why = _ABORTED if "Aborted" in said else "native code crashed it"
            return RankFailure(
                f"{crashed} ended by a fatal error and recorded no other ({said}): "
                f"{why}{_moved(crashed, fatal, stacks)}"
            )
    if silent:
        return RankFailure(
            f"{silent[0]} ended without recording an error (killed by a signal, or crashed "
            f"in native code): {_FROM_OUTSIDE}"
        )
    if errors:
        first = min(errors, key=lambda info: info["time"])
        line = (first["text"].strip().splitlines() or [""])[-1][:300]
        return RankFailure(
            f"rank {first['rank']} lost its connection to the other ranks ({line}), and no rank "
            "of this machine failed before it: a rank of another machine, or that machine, ended "
            "first; its log says why"
        )
    rank, failure = min(error.failures.items(), key=lambda item: item[1].timestamp)
    return RankFailure(
        f"rank {rank} ended with exit code {failure.exitcode} ({failure.message}); "
        "no traceback was recorded"
    )


_ABORTED = (
    "the ranks may have called different collectives (a hook that calls save_checkpoint or "
    "any_rank on some ranks only: every rank calls them at the same step), or native code aborted "
    "it; every other rank was stopped"
)
_FROM_OUTSIDE = (
    "something outside it ended it (the operating system out of memory, a scheduler, kill -9); "
    "every other rank was stopped"
)


def _said(first: dict, stacks: Path | None, records: Path, first_rank: int | None) -> PhalanxError:
    if first["user_error"]:
        return PhalanxError(first["text"])
    if first.get("explained"):
        where = ""
        if stacks is not None and stacks.is_dir():
            missing = _without_stacks(stacks, records, first_rank)
            where = (
                f"; the ranks' stacks when the job ended: {stacks} (none from rank "
                f"{', '.join(map(str, missing))}: it ended before it could write one)"
                if missing
                else f"; every rank's stack when the job ended: {stacks}"
            )
        return RankFailure(first["text"] + where)
    whole = (
        f"rank {first['rank']} failed first; every rank was stopped. Its traceback:\n"
        f"{first['callstack'].rstrip()}"
    )
    yours = first.get("yours")
    if yours:  # the user's code raised it: its frames, and the whole traceback in the log
        said = yours.removeprefix("phalanx: error: ").replace(
            "(--debug shows the whole traceback)", "(the run's log.txt has the whole traceback)", 1
        )
        said = said[:1].upper() + said[1:]
        return RankFailure(
            f"rank {first['rank']} failed first; every rank was stopped. {said}", whole
        )
    return RankFailure(whole)


def in_the_run(run_dir: Path, failure: PhalanxError, node: int | None) -> PhalanxError:
    """`failure`, also written into the run: a `failed` event in trace.jsonl (one line, the error
    that ended a traceback with it) and the whole message in log.txt, as the terminal shows it (a
    machine that died writes nothing of its own: another machine's launcher says it). `node`: the
    rank of this launcher's machine in a job of several, None in a job of one."""
    who = "the launcher" if node is None else f"node {node}'s launcher"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with contextlib.suppress(OSError, PhalanxError):  # the run directory may be gone with it
        last = (rundir.read_trace(run_dir) or [{}])[-1]
        if last.get("event") != "failed" or "cause" in last:  # not the failing rank's own
            rundir.trace(run_dir, "failed", error=summary_line(failure), by=who)
        with open(run_dir / "log.txt", "a", encoding="utf-8") as f:
            said = getattr(failure, "whole", str(failure)).rstrip()
            f.write(f"{stamp} ERROR {who}: {said or type(failure).__name__}\n")
    return failure


def summary_line(error: BaseException) -> str:
    """The error in one line: its first, and where it goes on over several (a traceback), its last
    (the exception that ended it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = first_line(error)
    if len(lines) < 2:
        return first
    return f"{first} ... {' '.join(lines[-1].split())[:500]}"


def _moved(label: str, fatal: dict[str, Path], stacks: Path | None) -> str:
    """The stacks the fatal signal that ended worker `label` made it write, moved into `stacks`
    (`rank-1-fatal.txt`, `rank-1-attempt-2-fatal.txt` in a restarted attempt, as its other stacks
    are named), said as a clause; nothing where it wrote none."""
    source = fatal.get(label)
    if source is None or stacks is None:
        return ""
    number = _number(source.parent.parent)  # .../attempt_<N>/<local rank>/fatal.txt
    suffix = f"-attempt-{number}" if number else ""
    target = stacks / f"{label.replace(' ', '-')}{suffix}-fatal.txt"
    with contextlib.suppress(OSError):
        stacks.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
        return f"; its stacks as it ended: {target}"
    return ""


def _attempts(records: Path) -> list[Path]:
    """The elastic agent's folders of each attempt under `records`, first to last."""
    return sorted(records.glob("*/attempt_*"), key=_number)


def _number(attempt: Path) -> int:
    return int(attempt.name.split("_")[-1])


def _without_stacks(stacks: Path, records: Path, first_rank: int | None) -> list[int]:
    """This machine's ranks of the last attempt whose stack is not in `stacks` (none where the
    ranks are not known: an elastic job's)."""
    attempts = _attempts(records)
    if first_rank is None or not attempts:
        return []
    number = _number(attempts[-1])
    suffix = f"-attempt-{number}" if number else ""
    ranks = sorted(first_rank + int(p.name) for p in attempts[-1].iterdir() if p.name.isdigit())
    return [r for r in ranks if not (stacks / f"rank-{r}{suffix}.txt").is_file()]


def _read_records(
    records: Path, first_rank: int | None = 0
) -> tuple[list[dict], list[str], dict[str, Path]]:
    """What every worker of every attempt recorded under `records`, the workers of the last
    attempt that recorded nothing (`rank R`, this machine's first worker being rank `first_rank`;
    where that is not known, in an elastic job, `local rank L of this machine`), and the stacks
    those a fatal signal ended wrote (`keep_fatal_stacks`), by the same names. The launcher
    reports the first exit it notices, which need not be the first failure (a worker that ended at
    once because another failed may be noticed first), so every rank's error file is read."""
    attempts = _attempts(records)
    out, silent, fatal = [], [], {}
    for attempt in attempts:
        for folder in sorted(p for p in attempt.iterdir() if p.is_dir() and p.name.isdigit()):
            local = int(folder.name)
            label = (
                f"rank {first_rank + local}"
                if first_rank is not None
                else f"local rank {local} of this machine"
            )
            with contextlib.suppress(OSError):
                if attempt == attempts[-1] and (folder / FATAL).stat().st_size:
                    fatal[label] = folder / FATAL
            try:
                data = json.loads((folder / "error.json").read_text())
                info = data["phalanx"]
                if not info.get("stopped"):
                    info["callstack"] = data["message"]["extraInfo"]["py_callstack"]
            except OSError:
                if attempt == attempts[-1]:
                    silent.append(label)
                continue
            except (ValueError, KeyError, TypeError):
                continue
            out.append(info)
    return out, silent, fatal
