"""Writing files so that a crash leaves either the old file or the new one, never half of one, and a
write the system refuses (a full disk, a read-only folder, no permission) is one `StorageError`
naming the path and the fix, with nothing partial left behind; and reading a run's JSON files so
that a damaged or crafted one is a ValueError, never a crash."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from phalanx.errors import PhalanxError, StorageError

_FULL = {errno.ENOSPC, errno.EDQUOT}
_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}
# Rust's std::io::Error, as safetensors reports it: "... No space left on device (os error 28)"
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")
WHERE = "output_root in the config, or --output"


def os_error(error: BaseException) -> OSError | None:
    """The operating system's refusal behind `error`: the error itself, or one that a library
    (safetensors' writer) reports only in its message; None for any other failure."""
    if isinstance(error, OSError):
        return error
    found = _OS_ERROR_IN_TEXT.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def storage_error(path: Path, error: OSError, where: str = WHERE) -> StorageError:
    """A one-line error for a write to `path` that the system refused; `where` says how to choose
    another place."""
    reason = error.strerror or str(error)
    if error.errno in _FULL:
        return StorageError(
            f"cannot write {path}: the disk is full ({reason}); free space on it, "
            f"or choose another disk ({where})"
        )
    if error.errno in _REFUSED:
        return StorageError(
            f"cannot write {path}: {reason}; make it writable, or choose another folder ({where})"
        )
    return StorageError(f"cannot write {path}: {reason}; choose another path ({where})")


def check_output(
    output: str, example: str, endings: tuple[str, ...] = (), run_dir: Path | None = None
) -> None:
    """One error where `output` cannot be the file to write: a directory, a missing folder, a path
    the system refuses to look at (a name too long), a name without one of `endings` (where
    given: what the name's ending chooses to write), or a file that `run_dir` holds (a command
    that reads a run changes nothing in it: a new file beside its own is fine, but not in its
    checkpoints)."""
    try:
        is_dir, parent = Path(output).is_dir(), Path(output).resolve().parent.is_dir()
    except OSError as e:
        raise storage_error(Path(output), e, "--output") from None
    if is_dir:
        raise PhalanxError(
            f"--output {output!r} is a directory; give the file to write, such as "
            f"{Path(output) / example}"
        )
    if not parent:
        raise PhalanxError(
            f"--output {output!r}: folder {str(Path(output).parent)!r} does not exist; create it "
            "first"
        )
    if run_dir is not None:
        _check_not_the_runs(Path(output), run_dir)
    if endings and not output.endswith(endings):
        raise PhalanxError(
            f"--output {output!r}: the name's ending says what to write, and this one is not "
            f"{' or '.join(endings)}; name the file such as "
            f"{Path(output).parent / example}"
        )


def _check_not_the_runs(output: Path, run_dir: Path) -> None:
    """An error where `output` is a file `run_dir` holds, or lies in its checkpoints."""
    target, run = output.resolve(), run_dir.resolve()
    if run not in target.parents:
        return
    if (run / "checkpoints") in target.parents or target.exists():
        raise PhalanxError(
            f"--output {str(output)!r} would write over what run {run.name} holds "
            f"({target.relative_to(run)}); name a new file, or one outside the run directory"
        )


@contextmanager
def writing(path: Path, partial: Path | None = None, where: str = WHERE) -> Iterator[None]:
    """Writes to `path` inside: a refused one becomes a StorageError naming it; on any failure
    `partial` (a temporary file or folder) is removed first."""
    try:
        yield
    except BaseException as e:
        if partial is not None:
            remove(partial)
        refused = os_error(e)
        if refused is None:
            raise
        raise storage_error(path, refused, where) from e


def remove(path: Path) -> None:
    """Delete a file or a folder, if there is one; never fails."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def write_atomic(
    path: Path, write: Callable[[BinaryIO], object], sync: bool = False, where: str = WHERE
) -> None:
    """Write `path` through `write(file)` into a temporary file and a rename; `sync` also fsyncs it.
    A failure leaves the previous file as it was and no temporary file; its error says `where`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, partial=tmp, where=where):
        with open(tmp, "wb") as f:
            write(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)


def write_text_atomic(path: Path, text: str, sync: bool = False, where: str = WHERE) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename; `sync` fsyncs it."""
    data = text.encode("utf-8")
    write_atomic(path, lambda f: f.write(data), sync, where)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The deepest nesting a run's JSON files may have. phalanx writes a few levels; json's parser, and
# whatever walks a value later (the next save's json.dumps), recurse once a level, so a file nested
# thousands deep would raise RecursionError there instead of being refused here.
JSON_DEPTH = 100


def parse_json(text: str | bytes) -> Any:
    """The value of JSON text; ValueError where it is not JSON (or not UTF-8) or nests deeper than
    JSON_DEPTH levels."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        deepest = JSON_DEPTH + 1
    else:
        deepest = _depth(value)
    if deepest > JSON_DEPTH:
        raise ValueError(f"it nests deeper than {JSON_DEPTH} levels")
    return value


def read_json(path: Path) -> Any:
    """A JSON file's value: OSError where it cannot be read, ValueError as `parse_json`."""
    return parse_json(Path(path).read_bytes())


def _depth(value: Any) -> int:
    """How many lists and mappings `value` nests, counted without recursion; past JSON_DEPTH, the
    first count over it."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if deepest > JSON_DEPTH:
            break
        pending.extend((child, depth + 1) for child in item)
    return deepest
