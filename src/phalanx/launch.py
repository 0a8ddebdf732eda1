"""Starting worker processes: torch.distributed's elastic launcher, rendezvous on loopback.

`phalanx train` with several devices starts one worker per device here; under `torchrun` (its
environment present) the processes already exist and nothing is relaunched. A worker that fails
records its traceback; the launcher prints the first failing rank's traceback once and ends every
rank within a bounded time.

Stopping: the first SIGINT or SIGTERM to the launcher asks the workers to finish their step and
save (through a request file they watch, so that a terminal's Ctrl-C, which reaches them directly
too, counts once); a second one ends them at once.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

from phalanx.errors import PhalanxError

log = logging.getLogger("phalanx")
STOP_FILE = ".stop-requested"
SHUTDOWN_TIMEOUT_S = 5


class RankFailure(PhalanxError):
    """A worker process failed; the message holds its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, devices: int, resume: bool, overrides: list[str] = ()) -> int:
    """Run the training in `run_dir` on `devices` local worker processes; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=devices, run_id=f"phalanx-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", local_addr="127.0.0.1",
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
        signals_to_handle="SIGHUP,SIGQUIT", shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    stop_file = run_dir / STOP_FILE
    stop_file.unlink(missing_ok=True)
    previous = {sig: signal.signal(sig, _request_stop(stop_file)) for sig in (signal.SIGINT, signal.SIGTERM)}
    for name in ("torch.distributed.elastic", "torch.distributed.elastic.multiprocessing.api",
                 "torch.multiprocessing.spawn"):  # the launcher reports failures itself, once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, worker)(str(run_dir), resume, list(overrides))
    except ChildFailedError as e:
        raise _explain(e) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_file.unlink(missing_ok=True)
    return int(results.get(0, 1))


def _request_stop(stop_file: Path):
    def handle(signum: int, frame: object) -> None:
        if stop_file.exists():
            raise KeyboardInterrupt  # the second signal: the launcher ends the workers now
        stop_file.write_text(str(signum))
        log.warning("%s received: the workers finish their step and save; send it again to stop at once",
                    signal.Signals(signum).name)
    return handle


def worker(run_dir: str, resume: bool, overrides: list[str]) -> int:
    """Entry point of each worker process (picklable, module level)."""
    try:
        from phalanx import commands

        return commands.run_worker(Path(run_dir), resume, overrides)
    except BaseException as e:  # noqa: BLE001 - every failure is recorded for the launcher, once
        _record(e)
        sys.stdout.flush()
        os._exit(2 if isinstance(e, PhalanxError) else 1)


def _record(e: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(e).__name__}: {e}",
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}},
            "phalanx": {"time": time.time(), "user_error": isinstance(e, PhalanxError), "text": str(e),
                        "rank": int(os.environ.get("RANK", 0))}}
    with open(path, "w") as f:
        json.dump(data, f)


def _explain(error) -> PhalanxError:
    """The first failing rank's error: one line for a user error, else its traceback."""
    recorded = sorted(_recorded(error), key=lambda info: info["time"])
    if not recorded:
        rank, failure = min(error.failures.items(), key=lambda item: item[1].timestamp)
        return RankFailure(f"rank {rank} ended with exit code {failure.exitcode} ({failure.message}); "
                           "no traceback was recorded")
    first = recorded[0]
    if first["user_error"]:
        return PhalanxError(first["text"])
    return RankFailure(f"rank {first['rank']} failed first; every rank was stopped. Its traceback:\n"
                       f"{first['callstack'].rstrip()}")


def _recorded(error) -> list[dict]:
    """What every worker recorded. The launcher reports the first exit it notices, which need not be
    the first failure, so the error files of all local ranks (siblings of the reported one) are read."""
    folders = {Path(f.error_file).parent.parent for f in error.failures.values() if f.error_file}
    out = []
    for file in sorted(p for folder in folders for p in folder.glob("*/error.json")):
        try:
            data = json.loads(file.read_text())
            info = data["phalanx"]
            info["callstack"] = data["message"]["extraInfo"]["py_callstack"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(info)
    return out
