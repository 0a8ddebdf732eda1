"""Learning curves drawn in a process of their own, so that drawing never holds up training.

`Painter` starts `python -m phalanx.plots` once and sends it each epoch's new points as a JSON
line; the child keeps the history and draws it at most once every INTERVAL_S seconds, and at once
when training ends (or, where it has not within CLOSE_WAIT_S, the trainer draws the last picture
itself); it answers a line per drawing, `ok` or the error. A fresh interpreter, not a fork or a
multiprocessing spawn: those copy the trainer's threads or run the user's script again. The child
runs in a process group of its own, so that a terminal's Ctrl-C (sent to the trainer's group) never
reaches it, even while it starts; it ignores SIGINT and SIGTERM too (the trainer handles them and
closes it) and exits when told, or when its input ends (the trainer died: it draws what it was
given first, so that the plots are whole).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import IO, NamedTuple

from phalanx.errors import StorageError
from phalanx.files import remove, write_atomic, writing

log = logging.getLogger("phalanx")
# at the end of training, for the child's last drawing, before the trainer draws it itself
CLOSE_WAIT_S = 5.0
# the plots are for people watching: a fresher picture than every 2 s is CPU taken from training
INTERVAL_S = 2.0


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
        # tight_layout's cost is half the plot's
        fig.subplots_adjust(left=0.14, right=0.97, top=0.91, bottom=0.13)
        ax = fig.add_subplot()
        for name in names:
            epochs, values = zip(*history[name], strict=True)
            ax.plot(epochs, values, marker="o", label=name.split(".", 1)[0])
        ax.set(xlabel="epoch", ylabel=var, title=var)
        ax.grid(alpha=0.3)
        ax.legend()
        write_atomic(folder / f"{var}.png", partial(fig.savefig, format="png", dpi=dpi))


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


class _Link(NamedTuple):
    """A running child's pipes: its requests, written without blocking, and its answers."""

    requests: IO[bytes]
    replies: IO[bytes]
    answers: _Lines


class Painter:
    """The drawing process of one run's PlotLines: `submit` the history after each epoch, `close`
    at the end, which waits for the last drawing and raises the first error the child reported.

    Only the points the child has not had are sent, and without waiting: what the pipe does not
    take now waits here for the next epoch. The end is a message, not the pipe's end: DataLoader
    workers forked meanwhile hold copies of the pipe, which would keep it open.
    """

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._link: _Link | None = None
        # points of each curve the child has been given
        self._sent: dict[str, int] = {}
        self._unsent = b""
        self._inline = False  # the child could not start: draw here

    def submit(self, folder: Path, history: dict[str, list[list[float]]]) -> None:
        if self._child is None and not self._inline:
            self._start()
        link = self._link
        if link is None:  # the child could not start
            draw(folder, history)
            return
        self._raise_reported(link.answers.ready(0))
        new = {
            name: points[self._sent.get(name, 0) :]
            for name, points in history.items()
            if len(points) > self._sent.get(name, 0)
        }
        self._sent = {name: len(points) for name, points in history.items()}
        self._unsent += (json.dumps({"folder": str(folder), "add": new}) + "\n").encode()
        self._send(link, deadline=None)

    def close(
        self,
        folder: Path | None = None,
        history: dict[str, list[list[float]]] | None = None,
        wait_s: float | None = None,
    ) -> None:
        """Wait `wait_s` (CLOSE_WAIT_S) at most for the last drawing; an error the child reported is
        raised here. A child that has not drawn it by then (on a machine whose cores are all busy, a
        child at idle priority waits) is ended, the picture it was writing removed, and `history`,
        where given with its `folder`, is drawn here instead."""
        child, link = self._child, self._link
        if child is None or link is None:
            return
        self._child, self._link = None, None
        wait_s = CLOSE_WAIT_S if wait_s is None else wait_s
        said: list[str] = []
        deadline = time.monotonic() + wait_s
        try:
            self._unsent += b'{"end": true}\n'
            ended = self._send(link, deadline) and self._drain(link.answers, said, deadline)
            reported = any('"error"' in line for line in said)
            if not ended and not reported and folder is not None and history is not None:
                _end(child, folder)
                log.info(
                    "PlotLines: the drawing process had not drawn the last epochs after %.0f s; "
                    "drawn here",
                    wait_s,
                )
                try:
                    draw(folder, history)
                except StorageError as e:  # said as the child says it
                    raise StorageError(f"PlotLines: {e}") from None
        finally:
            _end(child, folder)
            for pipe in (link.requests, link.replies):
                try:
                    pipe.close()
                except OSError:
                    pass
        self._raise_reported(said)
        if child.returncode not in (0, -signal.SIGKILL) and not any(
            '"error"' in line for line in said
        ):
            raise StorageError(
                f"PlotLines: the drawing process ended with exit code {child.returncode}"
            )

    def _send(self, link: _Link, deadline: float | None) -> bool:
        """Write what the pipe takes: now (no deadline), or all of it by `deadline`. Whether all
        went."""
        fd = link.requests.fileno()
        while self._unsent:
            wait = 0 if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([], [fd], [], wait)[1]:
                return False
            try:
                written = os.write(fd, self._unsent[: select.PIPE_BUF])
            except BlockingIOError:
                continue
            except OSError:
                # the child ended: close says what it said, or how it ended
                if deadline is None:
                    self.close()
                    raise StorageError(
                        "PlotLines: the drawing process ended unexpectedly"
                    ) from None
                return False
            self._unsent = self._unsent[written:]
        return True

    @staticmethod
    def _drain(answers: _Lines, said: list[str], deadline: float) -> bool:
        """The child's answers up to its last; whether it ended by `deadline`."""
        while (lines := answers.ready(max(0.0, deadline - time.monotonic()))) is not None:
            said += lines
            if '{"ended": true}' in lines:
                return True
            if time.monotonic() >= deadline:
                return False
        return False

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (package_root, os.environ.get("PYTHONPATH")) if p
            ),
        }
        try:
            self._child = child = subprocess.Popen(
                [sys.executable, "-m", "phalanx.plots"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                process_group=0,
            )
        except OSError as e:
            log.warning(
                "PlotLines: cannot start a drawing process (%s); drawing in the training process", e
            )
            self._inline = True
            return
        # both are pipes, as asked above; typeshed's Popen cannot tie them to the PIPE arguments
        assert child.stdin is not None and child.stdout is not None
        os.set_blocking(child.stdin.fileno(), False)
        self._link = _Link(child.stdin, child.stdout, _Lines(child.stdout.fileno()))

    @staticmethod
    def _raise_reported(lines: list[str] | None) -> None:
        for line in lines or []:
            answer = json.loads(line)
            if answer.get("error"):
                raise StorageError(f"PlotLines: {answer['error']}")


def _end(child: subprocess.Popen[bytes], folder: Path | None) -> None:
    """End the drawing process, and remove the temporary file of a picture it was writing."""
    if child.poll() is None:
        child.kill()
    child.wait()
    if child.returncode == -signal.SIGKILL and folder is not None:
        for partial in folder.glob(".*.png.tmp"):
            remove(partial)


def _serve() -> None:
    """The child: keep the history the trainer sends; draw it at most once every INTERVAL_S
    seconds while points come, and at once at the end; answer each drawing, and the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # training comes first: this process runs on cores that training leaves idle
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        try:
            os.nice(19)
        except OSError:
            pass
    requests = _Lines(sys.stdin.fileno())
    history: dict[str, list[list[float]]] = {}
    undrawn: Path | None = None  # the folder of points not drawn yet
    ended, last = False, -INTERVAL_S
    while not ended:
        wait = None if undrawn is None else max(0.0, last + INTERVAL_S - time.monotonic())
        lines = requests.ready(wait)
        # the trainer is gone: what it sent is drawn, no one hears the answer
        if lines is None:
            if undrawn is not None:
                # an orphan's error has no one to tell: the next run's drawing reports it
                with contextlib.suppress(Exception):
                    draw(undrawn, history)
            return
        for line in lines:
            request = json.loads(line)
            if request.get("end"):
                ended = True
                break
            undrawn = Path(request["folder"])
            for name, points in request["add"].items():
                history.setdefault(name, []).extend(points)
        if undrawn is not None and (ended or time.monotonic() >= last + INTERVAL_S):
            answer: dict[str, object]
            try:
                draw(undrawn, history)
                answer = {"ok": True}
            except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
                answer = {
                    "error": str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
                }
            undrawn, last = None, time.monotonic()
            _answer(answer)
    _answer({"ended": True})


def _answer(answer: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve()
