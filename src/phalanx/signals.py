"""Graceful stop: the first SIGINT or SIGTERM finishes the current step, saves and exits with
128 + the signal number (130 for SIGINT, 143 for SIGTERM); a second one exits at once, removing any
half-written checkpoint."""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from phalanx import checkpoint

log = logging.getLogger("phalanx")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._request_file: Path | None = None
        self._checked = 0.0

    @property
    def requested(self) -> bool:
        if self.signum is None and self._request_file is not None and time.monotonic() - self._checked > 0.2:
            self._checked = time.monotonic()
            if self._request_file.exists():  # the launcher asks on behalf of a signal it received
                self.signum = int(self._request_file.read_text() or signal.SIGTERM)
        return self.signum is not None

    def watch(self, request_file: Path) -> None:
        """Also count a stop as requested once `request_file` exists (written by the launcher)."""
        self._request_file = request_file

    def exit_code(self) -> int:
        """128 + the signal's number; SIGTERM's where another rank received it."""
        return 128 + (self.signum or signal.SIGTERM)

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            checkpoint.abort_in_progress()
            os._exit(128 + signum)
        self.signum = signum
        log.warning("%s received: finishing the current step and saving; send it again to exit at once",
                    signal.Signals(signum).name)
