"""The console and the run's log: messages go to the terminal and to `log.txt`."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

console = Console(stderr=True)   # progress and logs
out = Console()                  # a command's results (eval tables, ls, info), on standard output
if not out.is_terminal:
    out.width = 160              # a file or a pipe: no terminal width to fit, so do not squeeze tables
log = logging.getLogger("phalanx")


def setup(run_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Console logging, plus `run_dir/log.txt` when a run directory is given."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(level)
    log.propagate = False
    if console.is_terminal:
        log.addHandler(RichHandler(console=console, show_path=False, show_time=False, markup=False))
    else:  # a file or a pipe: plain lines, never wrapped
        plain = logging.StreamHandler(sys.stderr)
        plain.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        log.addHandler(plain)
    if run_dir is not None:
        file = logging.FileHandler(run_dir / "log.txt", encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file)
