"""Writing files: atomic replacement, and writes the system refuses (a full disk, a folder that is
not one) as one StorageError naming the path, with no temporary file left behind; the run's log file
on a full disk says so once.

A full disk is simulated by a seam, a write function that raises ENOSPC after writing part of its
bytes, never by filling the real disk."""

from __future__ import annotations

import errno
import io
import logging

import pytest
from safetensors import SafetensorError

from phalanx import logs
from phalanx.errors import StorageError
from phalanx.files import os_error, write_atomic, write_text_atomic

pytestmark = pytest.mark.timeout(30)


def _fills_the_disk(f) -> None:
    f.write(b"half of it")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_error_naming_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("old\n")
    with pytest.raises(StorageError) as info:
        write_atomic(path, _fills_the_disk)
    message = str(info.value)
    assert str(path) in message and "the disk is full" in message and "output_root" in message
    assert "\n" not in message
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # no temporary file


def test_writing_over_a_directory_is_an_error_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "predictions"
    target.mkdir()
    with pytest.raises(StorageError, match="predictions"):
        write_text_atomic(target, "index\n0\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions"]
    assert list(target.iterdir()) == []


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path):
    def interrupted(f) -> None:
        f.write(b"part")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "a.json", interrupted)
    assert list(tmp_path.iterdir()) == []


def test_a_library_that_reports_the_os_error_in_its_message_counts_as_refused():
    """safetensors' writer raises SafetensorError('... (os error 28)'), not an OSError."""
    error = os_error(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    )
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert os_error(RuntimeError("shapes do not match")) is None


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_log_file_on_a_full_disk_says_so_once_in_one_line(tmp_path, capsys):
    """logging's default prints a traceback for every record the file refuses."""
    logs.setup(tmp_path)
    [run_log] = [h for h in logging.getLogger("phalanx").handlers if isinstance(h, logs.RunLog)]
    run_log.stream = _FullDisk()  # the seam: the file's writes fail as on a full disk
    for i in range(3):
        logging.getLogger("phalanx").info("epoch %d", i)
    err = capsys.readouterr().err
    logs.setup(None)
    assert "Logging error" not in err and "Traceback" not in err, err
    warnings = [line for line in err.splitlines() if line.startswith("phalanx:")]
    assert warnings == [
        f"phalanx: warning: cannot write {tmp_path / 'log.txt'}: the disk is full (No space left "
        "on device); free space on it, or choose another disk (output_root in the config, or "
        "--output); the log continues on the console only"
    ]
    assert [line for line in err.splitlines() if line.startswith("INFO")] == [
        "INFO epoch 0",
        "INFO epoch 1",
        "INFO epoch 2",
    ]
