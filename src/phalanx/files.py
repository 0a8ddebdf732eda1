"""Writing files so that a crash leaves either the old file or the new one, never half of one."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str, sync: bool = False) -> None:
    """Write `text` to `path` through a temporary file and a rename; `sync` also fsyncs it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
