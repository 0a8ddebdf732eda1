"""Which rank did not arrive: when a collective times out, the rank that waited names the ranks that
never reached it, and the step they were in.

Each rank counts the collectives it enters (an attribute write, no communication), and keeps the
name of the last one with where the run was when it entered it. A background thread publishes these
and where the run is now to the process group's store whenever they change, at most ten times a
second and off the training thread, so that no step pays for it. A rank whose collective times out
compares its own count with the others' last reports: a rank with a smaller count never arrived.
The collective it waited in is named with the step it was entered in, not the step the run reads
once the error has unwound it. A wait that is not a collective (a param_server worker's for the
servers' answer) explains itself when it times out (`Late`), from the same reports.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

KEY = "phalanx/progress/{rank}"
# why ranks meet in different places, most often
_DIFFERENT = (
    "every rank calls save_checkpoint and any_rank at the same step (a hook that calls them on "
    "some ranks only, or a rank held in a hook, ends this way)"
)
PUBLISH_INTERVAL_S = 0.1
_current: Progress | None = None
_runs = 0  # the runs this process has started (`start`)


class Late(TimeoutError):
    """A wait that timed out, its message the explanation: who did not come, and where they were."""


class Progress:
    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: Any = None,
        interval_s: float = PUBLISH_INTERVAL_S,
        run: int = 0,
    ):
        """`run`: this process's count of runs so far, the same in each of its group (its
        meetings' names are the run's: the group and its store may outlive a run)."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.run = run
        # collectives this rank has entered, the last of them, and where the run was then
        self.entered = 0
        self.what = "start-up"
        self.entered_at: tuple[int, bool] | None = None
        # (steps done, training) of the run, now
        self.where: Callable[[], tuple[int, bool]] | None = None
        # the ranks that enter the counted collectives (all; a param_server run's workers alone)
        self.peers: Sequence[int] = range(world_size)
        self._met: dict[str, tuple[int, int]] = {}  # each name's meetings, and the last one's step
        self._store = store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._publish()
            self._thread = threading.Thread(
                target=self._loop, args=(interval_s,), name="phalanx-progress", daemon=True
            )
            self._thread.start()

    def enter(self, what: str, times: int = 1) -> None:
        """This rank enters a collective (`times` of them)."""
        self.entered += times
        self.what = what
        self.entered_at = self.where() if self.where is not None else None

    def again(self, what: str, times: int = 1) -> None:
        """`enter`, where the run is still where the last `enter` found it (a pipeline schedule's
        transfers, all within the step whose schedule `enter` counted): `where()` is not asked."""
        self.entered += times
        self.what = what

    def position(self) -> str:
        """Where the run is: 'step N' (the step being trained), 'evaluation after step N' or
        'start-up'."""
        return _position(self.where() if self.where is not None else None)

    def report(self) -> dict[str, Any]:
        return {
            "entered": self.entered,
            "what": self.what,
            "entered_in": _position(self.entered_at),
            "position": self.position(),
            "at": list(self.where()) if self.where is not None else None,
            "time": time.time(),
        }

    def _publish(self) -> tuple:
        report = self.report()
        self._store.set(KEY.format(rank=self.rank), json.dumps(report))
        return report["entered"], report["what"], report["position"]

    def _loop(self, interval_s: float) -> None:
        last = None
        while not self._stop.wait(interval_s):
            try:
                if (self.entered, self.what, self.position()) != last:
                    last = self._publish()
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing to report to
                return

    def reports(self) -> dict[int, dict | None]:
        """Every other peer's last report (None where it never reported)."""
        out: dict[int, dict | None] = {}
        for rank in self.peers:
            if rank == self.rank:
                continue
            key = KEY.format(rank=rank)
            try:
                out[rank] = json.loads(self._store.get(key)) if self._store.check([key]) else None
            except Exception:  # noqa: BLE001
                out[rank] = None
        return out

    def explain(self, error: BaseException) -> str | None:
        """A message naming the ranks that did not reach the collective this rank timed out in,
        and where they were; None if `error` is not a collective's timeout or no rank is found
        behind. A `Late` wait's own message."""
        if isinstance(error, Late):
            return str(error)
        if not is_timeout(error) or self._store is None:
            return None
        me = self.report()
        behind = {
            rank: info
            for rank, info in self.reports().items()
            if info is None or info["entered"] < me["entered"]
        }
        if not behind:
            return self._elsewhere(me, error)
        names = ", ".join(str(r) for r in behind)
        lines = [
            f"rank{'s' if len(behind) > 1 else ''} {names} did not reach {me['what']} "
            f"of {me['entered_in']} within the collective timeout "
            f"(parallel.timeout_s={self.timeout_s:g}); rank {self.rank} "
            "waited for it there. Every rank was stopped."
        ]
        for rank, info in behind.items():
            line = seen(rank, info, me["time"])
            if info is not None:
                line += f"; the last collective it entered: {info['what']} of {info['entered_in']}"
            lines.append(line)
        lines.append(_cause(error))
        return "\n".join(lines)

    def _elsewhere(self, me: dict, error: BaseException) -> str | None:
        """Where no rank is behind this one's count: the ranks as far as this one in another
        collective (an any_rank that this one skipped), else None (a rank ahead went on past a
        wait that timed out for another cause)."""
        elsewhere = {
            rank: info
            for rank, info in self.reports().items()
            if info is not None
            and info["entered"] == me["entered"]
            and (info["what"], info["entered_in"]) != (me["what"], me["entered_in"])
        }
        if not elsewhere:
            return None
        lines = [
            f"rank {self.rank} timed out in {me['what']} of {me['entered_in']} "
            f"(parallel.timeout_s={self.timeout_s:g}) while the others were in other "
            f"collectives: {_DIFFERENT}. Every rank was stopped."
        ]
        for rank, info in elsewhere.items():
            line = seen(rank, info, me["time"])
            lines.append(f"{line}; in {info['what']} of {info['entered_in']}")
        lines.append(_cause(error))
        return "\n".join(lines)

    def meet(self, what: str, step: int) -> None:
        """Every peer at its next `what` (save_checkpoint), at the same step, met through the store
        before any collective of it: a rank that does not come (a hook that saves on some ranks
        only) is then a `Late` that says so after the timeout, not a collective of another kind
        that gloo aborts or a timeout in torch's words. Counted as a collective entered."""
        self.enter(what)
        if self._store is None or len(self.peers) < 2:
            return
        n, last = self._met.get(what, (0, -1))
        n += 1
        self._met[what] = n, step
        base = f"phalanx/meet/{self.run}/{what}/{n}"
        # each rank its step (read where the meeting fails), and two counts: who came, and who
        # came at this step (every rank polls one key, not each other's)
        self._store.set(f"{base}/rank/{self.rank}", str(step))
        self._store.add(f"{base}/at/{step}", 1)
        came = self._store.add(base, 1)
        # polled: the store's own wait logs its timeout in C++ words on the way out. It gives up
        # a little before the others' collectives time out: this rank knows why, and says it first
        deadline, pause = time.monotonic() + 0.9 * self.timeout_s, 0.001
        while came < len(self.peers):
            if time.monotonic() > deadline:
                raise self._not_met(what, step, base)
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            came = self._store.add(base, 0)
        if self._store.add(f"{base}/at/{step}", 0) < came:
            steps = {r: int(self._store.get(f"{base}/rank/{r}")) for r in self.peers}
            r = next(r for r, at in steps.items() if at != step)
            raise Late(
                f"rank {r} called {what} at step {steps[r]} where rank {self.rank} called it at "
                f"step {step}: {_DIFFERENT}. Every rank was stopped."
            )
        # every rank is past the last meeting's reads (each came to this one after them): its keys
        # go, each rank's by itself, the counts by the first
        if n > 1:
            done = f"phalanx/meet/{self.run}/{what}/{n - 1}"
            self._store.delete_key(f"{done}/rank/{self.rank}")
            if self.rank == self.peers[0]:
                self._store.delete_key(done)
                self._store.delete_key(f"{done}/at/{last}")

    def _not_met(self, what: str, step: int, base: str) -> Late:
        keys = {r: f"{base}/rank/{r}" for r in self.peers if r != self.rank}
        missing = [r for r, key in keys.items() if not self._store.check([key])]
        me = self.report()
        reports = self.reports()
        names = ", ".join(str(r) for r in missing)
        lines = [
            f"rank{'s' if len(missing) > 1 else ''} {names} did not call {what} at step {step} "
            f"within the timeout (parallel.timeout_s={self.timeout_s:g}), where rank "
            f"{self.rank} did: {_DIFFERENT}. Every rank was stopped."
        ]
        lines += [seen(r, reports.get(r), me["time"]) for r in missing]
        return Late("\n".join(lines))

    def late(self, steps: int, what: str) -> Late:
        """A wait of this rank for `what`, which needs every peer's part of the first `steps`
        steps, timed out: the error names the peers whose last report shows fewer steps done, and
        where they were."""
        me = self.report()
        reports = self.reports()
        behind = {
            rank: info
            for rank, info in reports.items()
            if info is None or info["at"] is None or info["at"][0] < steps
        }
        waited = (
            f"rank {self.rank} waited for {what} after that step "
            f"(parallel.timeout_s={self.timeout_s:g})"
        )
        if behind:
            names = ", ".join(str(r) for r in behind)
            ranks, parts = ("ranks", "their parts") if len(behind) > 1 else ("rank", "its part")
            head = f"{ranks} {names} did not finish {parts} of step {steps} within the timeout"
            head += f": {waited}."
        else:  # each reported its part done, or none could be read
            head = f"no rank was seen behind step {steps}, yet {waited} in vain."
            behind = reports
        lines = [head + " Every rank was stopped."]
        lines += [seen(rank, info, me["time"]) for rank, info in behind.items()]
        return Late("\n".join(lines))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


def seen(rank: int, info: dict | None, now: float) -> str:
    """Where `rank` was last seen, from its report `info`; `now`: when the wait ended."""
    if info is None:
        return f"  rank {rank}: no report (it had not finished starting)"
    ago = max(0.0, now - info["time"])
    return f"  rank {rank}: last seen in {info['position']} ({ago:.0f} s earlier)"


def _cause(error: BaseException) -> str:
    """The timed-out wait's own error, its last line, under an explanation."""
    return f"  ({type(error).__name__}: {str(error).strip().splitlines()[-1][:300]})"


def _position(where: tuple[int, bool] | None) -> str:
    """'step N' (the step being trained), 'evaluation after step N' or 'start-up'."""
    if where is None:
        return "start-up"
    done, training = where
    return f"step {done + 1}" if training else f"evaluation after step {done}"


def is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, (RuntimeError, TimeoutError)) and (
        "timed out" in text or "timeout" in text
    )


def start(rank: int, world_size: int, timeout_s: float, store: Any) -> Progress:
    """This process's progress, published to `store`; `explain` reads it."""
    global _current, _runs
    stop()
    _runs += 1  # every process of the group starts its runs in the same order
    _current = Progress(rank, world_size, timeout_s, store, run=_runs)
    return _current


@atexit.register  # before the interpreter finalizes, with the publishing thread inside a store call
def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def explain(error: BaseException) -> str | None:
    """See `Progress.explain`; None where this process runs no collectives."""
    return _current.explain(error) if _current is not None else None
