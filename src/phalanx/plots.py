"""Learning curves drawn in a process of their own, so that drawing never holds up training.

`Painter` starts `python -m phalanx.plots` once and sends it each new history as a JSON line; the
child draws the newest one it has, at most once every INTERVAL_S seconds (older ones are skipped),
and the last one as soon as training ends; it answers a line per drawing, `ok` or the error. A fresh interpreter, not a fork or a multiprocessing spawn: those copy
the trainer's threads or run the user's script again. The child ignores SIGINT and SIGTERM (the
trainer handles them and closes it) and exits when its input ends, also when the trainer dies.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from phalanx.errors import StorageError
from phalanx.files import write_atomic, writing

log = logging.getLogger("phalanx")
CLOSE_TIMEOUT_S = 60
INTERVAL_S = 2.0  # the plots are for people watching: a fresher picture than every 2 s is CPU taken from training


def draw(folder: Path, history: dict[str, list[list[float]]], dpi: int = 80) -> None:
    """A PNG per variable in `folder`, one line per stream (`stream.variable` keys of `history`,
    each a list of [epoch, value]); each file replaced atomically."""
    # matplotlib's object API on the Agg canvas: no pyplot figure manager, no global state
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with writing(folder):
        folder.mkdir(exist_ok=True)
    by_variable: dict[str, list[str]] = {}
    for name in history:
        by_variable.setdefault(name.split(".", 1)[1], []).append(name)
    for var, names in by_variable.items():
        fig = Figure(figsize=(6, 4))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.14, right=0.97, top=0.91, bottom=0.13)  # tight_layout's cost is half the plot's
        ax = fig.add_subplot()
        for name in names:
            epochs, values = zip(*history[name])
            ax.plot(epochs, values, marker="o", label=name.split(".", 1)[0])
        ax.set(xlabel="epoch", ylabel=var, title=var)
        ax.grid(alpha=0.3)
        ax.legend()
        write_atomic(folder / f"{var}.png", lambda f, figure=fig: figure.savefig(f, format="png", dpi=dpi))


class _Lines:
    """Complete lines from a pipe, as they come."""

    def __init__(self, fd: int):
        self.fd, self._buffer = fd, b""

    def ready(self, timeout: float | None = 0) -> list[str] | None:
        """The lines there now, after waiting up to `timeout` seconds for one (None: until one comes
        or the pipe ends); None once the pipe has ended and no line is left."""
        ended = False
        while True:
            wait = 0 if b"\n" in self._buffer else timeout
            if not select.select([self.fd], [], [], wait)[0]:
                break
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                ended = True
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        if ended and not lines:
            return None
        return [line.decode() for line in lines]


class Painter:
    """The drawing process of one run's PlotLines: `submit` a history, `close` at the end (which
    waits for the newest to be drawn and raises the first error the child reported)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None
        self._answers: _Lines | None = None
        self._inline = False  # the child could not start: draw here

    def submit(self, folder: Path, history: dict[str, list[list[float]]]) -> None:
        self._raise_reported(self._answers.ready(0) if self._answers else [])
        if self._child is None and not self._inline:
            self._start()
        if self._inline:
            draw(folder, history)
            return
        try:
            self._child.stdin.write((json.dumps({"folder": str(folder), "history": history}) + "\n").encode())
            self._child.stdin.flush()
        except OSError:  # the child ended: what it said, or that it ended
            self.close()
            raise StorageError(f"PlotLines: the process drawing {folder} ended unexpectedly") from None

    def close(self) -> None:
        """Wait for the last drawing; an error the child reported is raised here."""
        child, answers, self._child, self._answers = self._child, self._answers, None, None
        if child is None:
            return
        try:
            child.stdin.close()
        except OSError:
            pass
        said = []
        try:
            while (lines := answers.ready(None)) is not None:
                said += lines
            child.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            log.warning("PlotLines: drawing took over %d s; the plots may miss the last epochs", CLOSE_TIMEOUT_S)
        finally:
            child.stdout.close()
        self._raise_reported(said)

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        try:
            self._child = subprocess.Popen([sys.executable, "-m", "phalanx.plots"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, env=env)
        except OSError as e:
            log.warning("PlotLines: cannot start a drawing process (%s); drawing in the training process", e)
            self._inline = True
            return
        self._answers = _Lines(self._child.stdout.fileno())

    @staticmethod
    def _raise_reported(lines: list[str] | None) -> None:
        for line in lines or []:
            answer = json.loads(line)
            if answer.get("error"):
                raise StorageError(f"PlotLines: {answer['error']}")


def _serve() -> None:
    """The child: draw the newest request, at most once every INTERVAL_S seconds while more come,
    and at once when the input ends; answer each drawing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # training comes first: this process runs on cores that training leaves idle
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        try:
            os.nice(19)
        except OSError:
            pass
    requests, newest, ended, last = _Lines(sys.stdin.fileno()), None, False, -INTERVAL_S
    while not ended or newest is not None:
        if not ended:
            lines = requests.ready(None if newest is None else max(0.0, last + INTERVAL_S - time.monotonic()))
            if lines is None:
                ended = True
            elif lines:
                newest = lines[-1]  # older ones waiting would be drawn over anyway
        if newest is not None and (ended or time.monotonic() >= last + INTERVAL_S):
            request, newest = json.loads(newest), None
            try:
                draw(Path(request["folder"]), request["history"])
                answer = {"ok": True}
            except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
                answer = {"error": str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"}
            last = time.monotonic()
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    _serve()
