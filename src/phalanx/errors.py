"""The errors phalanx raises on bad input. Each says what was received and how to fix it.

The CLI prints them as one line and exits 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class PhalanxError(Exception):
    """Base of every error that is the user's to fix, not a bug."""


class ConfigError(PhalanxError):
    """The config (or an override of it) is invalid."""


class DataError(PhalanxError):
    """The dataset or one of its streams does not keep the dataset protocol."""


class ModelError(PhalanxError):
    """The model does not keep the model protocol (inputs it names, the `loss` it returns)."""


class CheckpointError(PhalanxError):
    """A checkpoint is missing, truncated, altered, or belongs to another model."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run's model (saved from another model config)."""


class RunDirError(PhalanxError):
    """A path given as a run directory is not one."""


class StorageError(PhalanxError):
    """A file could not be written: the disk is full, the folder is read-only or not writable."""


def count(n: int, noun: str, plural: str = "s") -> str:
    """'1 worker', '2 workers' ('2 processes' with `plural` "es")."""
    return f"{n} {noun}{plural if n != 1 else ''}"


def first_line(error: BaseException, limit: int = 500, os_reason: bool = False) -> str:
    """What an error says, in one line: its first line of text, its spaces collapsed (its type's
    name where it says nothing), at most `limit` characters. With `os_reason`, an OSError's reason
    alone where it gives one ("No space left on device", without the number and the path)."""
    text = (getattr(error, "strerror", None) if os_reason else None) or str(error)
    line = next((" ".join(part.split()) for part in text.splitlines() if part.strip()), "")
    return (line or type(error).__name__)[:limit]


def named(error: BaseException, limit: int = 500) -> str:
    """An error with its type, in one line: "TypeName: first line", the name alone where the error
    says nothing (`first_line`'s `limit` on the text)."""
    name = type(error).__name__
    line = first_line(error, limit)
    return name if line == name else f"{name}: {line}"


def beyond_input(error: BaseException) -> bool:
    """Whether an error that user code raised is one no change to the input fixes (out of memory,
    not implemented, too deep a recursion): passed on as it is, not said as bad input."""
    return isinstance(error, NotImplementedError | RecursionError) or (
        "OutOfMemory" in type(error).__name__
    )


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' when a close match exists, else ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{match[0]}"?)' if match else ""


# What a rank records when another rank, or its machine, ended under it: a consequence, not a cause.
_LOST_PEER = re.compile(
    r"Connection (reset|closed) by peer|Connection was likely closed|Broken pipe|"
    r"Connection refused|"
    r"DistNetworkError|failed to recv|Socket closed|ncclRemoteError|communicator was aborted",
    re.IGNORECASE,
)


def lost_a_peer(text: str) -> bool:
    """Whether an error is a rank's lost connection to another one (which ended first)."""
    return bool(_LOST_PEER.search(text))


def in_your_code(error: BaseException) -> str | None:
    """`error` as the user's own code raised it (a model's forward, a dataset's `__getitem__`): the
    frames of that code alone, without phalanx's and the installed libraries' around them, and the
    error. None where no frame is the user's: a fault of phalanx or of a library, whose whole
    traceback is the report."""
    import sysconfig
    import traceback
    from pathlib import Path

    own = Path(__file__).resolve().parent  # phalanx's
    libraries = [Path(p).resolve() for k, p in sysconfig.get_paths().items() if "lib" in k]

    def where(frame: traceback.FrameSummary) -> str:
        if frame.filename.startswith("<"):  # <frozen ...>, <string>
            return "library"
        path = Path(frame.filename).resolve()
        if path.is_relative_to(own):
            return "phalanx"
        return "library" if any(path.is_relative_to(p) for p in libraries) else "yours"

    # raised in a DataLoader worker: its traceback is text in the error's message
    worker = _in_worker(str(error))
    if worker is not None:
        place, found, said = worker
    else:
        place, found = "", traceback.extract_tb(error.__traceback__)
        said = "".join(traceback.format_exception_only(error))
    stack = [(frame, where(frame)) for frame in found]
    frames = [frame for frame, kind in stack if kind == "yours"]
    # raised by phalanx's own code that the user's called (a fault of phalanx's): said whole
    last = max((i for i, (_, kind) in enumerate(stack) if kind == "yours"), default=None)
    if last is None or any(kind == "phalanx" for _, kind in stack[last + 1 :]):
        return None
    return (
        f"phalanx: error: your code raised this{place} (--debug shows the whole traceback):\n"
        + "".join(traceback.format_list(frames))
        + said
    ).rstrip()


# torch's message for an error raised in a DataLoader worker: where, then the worker's traceback
_WORKER = re.compile(
    r"Caught \w+ (in DataLoader worker process \d+)\.\nOriginal (Traceback \(most recent call "
    r"last\):\n.*)",
    re.DOTALL,
)
_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (.+)$')


def _in_worker(message: str) -> tuple[str, list, str] | None:
    """(" in DataLoader worker process N", the frames, the error's own lines) of the traceback that
    torch puts in the message of an error a DataLoader worker raised; the last of a chain of them.
    None for any other message."""
    import traceback

    found = _WORKER.search(message)
    if found is None:
        return None
    lines = found.group(2).splitlines()
    at = max(i for i, line in enumerate(lines) if line == "Traceback (most recent call last):") + 1
    frames: list[traceback.FrameSummary] = []
    # each frame: its line, its code beneath (indented), pointers (^^^) or notes, all indented;
    # then the error's own lines, which are not
    while at < len(lines) and lines[at].startswith(" "):
        frame = _FRAME.match(lines[at])
        at += 1
        if frame is None:
            continue
        code = ""
        if at < len(lines) and lines[at].startswith("    ") and not _FRAME.match(lines[at]):
            code, at = lines[at].strip(), at + 1
        file, number, name = frame.groups()
        frames.append(traceback.FrameSummary(file, int(number), name, line=code))
    if not frames or at >= len(lines):
        return None
    return f" {found.group(1)}", frames, "\n".join(lines[at:]) + "\n"
