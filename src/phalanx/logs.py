"""The console and the run's log: messages go to the terminal and to `log.txt`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from phalanx.files import storage_error

console = Console(stderr=True)  # progress and logs
# a command's results (eval tables, ls, info), on standard output
out = Console()
if not out.is_terminal:
    # a file or a pipe: no terminal width to fit, so do not squeeze tables
    out.width = 160
log = logging.getLogger("phalanx")


class RunLog(logging.FileHandler):
    """`log.txt`. A write the system refuses (a full disk) is said once, in one line, and the log
    continues on the console only: logging's default prints a traceback for every record."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8")
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed = True
        print(
            f"phalanx: warning: {storage_error(Path(self.baseFilename), error)}; the log "
            "continues on the console only",
            file=sys.stderr,
        )


def setup(run_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Console logging, plus `run_dir/log.txt` when a run directory is given."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(level)
    log.propagate = False
    if console.is_terminal:
        log.addHandler(RichHandler(console=console, show_path=False, show_time=False, markup=False))
    else:
        # a file or a pipe: plain lines, never wrapped
        plain = logging.StreamHandler(sys.stderr)
        plain.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        log.addHandler(plain)
    if run_dir is not None:
        file = RunLog(run_dir / "log.txt")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file)


def in_run_log_only(level: int, message: str, exc_info: Any = None) -> None:
    """A record for `log.txt` alone, not the console (where the command says it its own way)."""
    if exc_info is True:
        exc_info = sys.exc_info()
    record = log.makeRecord(log.name, level, __file__, 0, message, (), exc_info)
    for handler in log.handlers:
        if isinstance(handler, RunLog):
            handler.handle(record)


def close_run_log() -> None:
    """Stop writing to a run's `log.txt`; the console goes on."""
    for handler in list(log.handlers):
        if isinstance(handler, RunLog):
            log.removeHandler(handler)
            handler.close()
