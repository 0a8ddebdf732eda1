"""Starting worker processes: torch.distributed's elastic launcher, on loopback unless the user
names an address.

`phalanx train` with several devices starts one worker per device here; under `torchrun` (its
environment present) the processes already exist and nothing is relaunched. On one machine the
rendezvous and the store the workers share listen on 127.0.0.1 only (torch's store would listen on
every interface), and gloo and NCCL connect the workers over the loopback interface. On several
machines (`Nodes`: `phalanx train --nnodes N --node-rank R --rdzv HOST:PORT` on each), node 0
serves the job's one store on HOST:PORT alone, the other nodes connect to it, and every node's
launcher starts its own workers; the workers use that store too. The run directory, which node 0
makes, must be on a file system every node shares.

A worker that fails records its traceback (or, when a collective timed out, which ranks did not
arrive) and tells the others to exit at once; the launcher prints the first failing rank's error once.

Signals: only the launcher takes them. Its workers leave the terminal's process group, so a Ctrl-C
reaches the launcher alone, which relays it through files in the run directory that the workers
watch: the first SIGINT or SIGTERM once training runs asks them to finish their step and save
(`STOP_FILE`); a second one, or one during start-up, ends them at once (`ABORT_FILE`). A worker
that finds its launcher gone (killed with SIGKILL, say) exits within a second.
"""

from __future__ import annotations

import _thread
import contextlib
import faulthandler
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from phalanx import environment, rundir, signals
from phalanx.errors import PhalanxError

log = logging.getLogger("phalanx")
STOP_FILE = ".stop-requested"  # the workers finish their step, save and exit
ABORT_FILE = ".stop-now"  # the workers exit at once; it holds their exit code
SHUTDOWN_TIMEOUT_S = 5
GUARD_INTERVAL_S = 0.1
RENDEZVOUS = "phalanx-loopback"
_listeners: dict[str, socket.socket] = {}  # run id -> the rendezvous store's listening socket


class RankFailure(PhalanxError):
    """A worker process failed; the message holds its rank and traceback."""


@dataclass(frozen=True)
class Nodes:
    """This machine's part in a job on several: `count` machines (between `least` and `count` where
    the job is elastic), this one's `rank` (0: the one that serves the job's store, on `host:port`)."""

    count: int
    rank: int
    host: str
    port: int
    least: int | None = None  # elastic: the job goes on with as few machines as this

    @property
    def elastic(self) -> bool:
        return self.least is not None and self.least < self.count

    @property
    def run_id(self) -> str:  # the same on every node
        return f"phalanx-{self.host}-{self.port}"


def join(nodes: Nodes, timeout_s: float = 600) -> Any:
    """The job's store: served on `nodes.host:port` by node 0 (that address alone), reached by the
    others, who wait up to `timeout_s` for it."""
    from torch.distributed import TCPStore

    if nodes.rank != 0:
        try:
            return TCPStore(
                nodes.host, nodes.port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        except (RuntimeError, OSError) as e:
            raise PhalanxError(
                f"node {nodes.rank} cannot reach node 0 at {nodes.host}:{nodes.port} within "
                f"{timeout_s:.0f} s ({' '.join(str(e).split())[:200]}); start node 0 with the same "
                "--rdzv, and check that this machine reaches that address"
            ) from None
    try:
        sock = socket.create_server((nodes.host, nodes.port))
    except OSError as e:
        raise PhalanxError(
            f"node 0 cannot serve the rendezvous on {nodes.host}:{nodes.port} ({e.strerror}); "
            "--rdzv must name an address of this machine and a free port"
        ) from None
    return TCPStore(
        nodes.host,
        nodes.port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        timeout=timedelta(seconds=timeout_s),
    )


RUN_DIR_KEY = "phalanx/run_dir"


def share_run_dir(store: Any, run_dir: Path | None) -> Path:
    """Node 0 gives the run directory it made; the others receive it, and check they see it."""
    if run_dir is not None:
        store.set(RUN_DIR_KEY, str(run_dir))
        return run_dir
    shared = Path(store.get(RUN_DIR_KEY).decode())
    if not (shared / rundir.CONFIG).is_file():
        raise PhalanxError(
            f"node 0's run directory {shared} is not visible on this machine; output_root must be "
            "on a file system every node shares"
        )
    return shared


def clear_requests(run_dir: Path) -> None:
    """Remove stop requests a launcher left behind (one killed before it could clean up)."""
    for name in (STOP_FILE, ABORT_FILE):
        (run_dir / name).unlink(missing_ok=True)


def launch(
    run_dir: Path,
    devices: int,
    run: Callable[..., int],
    *args: Any,
    nodes: Nodes | None = None,
    store: Any = None,
    restarts: int = 0,
) -> int:
    """`run(run_dir, *args)` on `devices` local worker processes (a module-level function: each
    worker imports it by name); returns the exit code of this machine's first worker. With `nodes`
    (and the `store` that `join` gave), this machine's workers are part of a job on several. When a
    worker fails, all of them are started again, up to `restarts` times (`run` then sees the attempt
    in `environment.here().attempt`); the error is the first failure's."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    records = Path(
        tempfile.mkdtemp(prefix="phalanx-workers-")
    )  # each worker's error.json, read on failure
    common = dict(
        nproc_per_node=devices,
        max_restarts=restarts,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle="SIGHUP,SIGQUIT",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=str(records)),
    )
    if nodes is None:
        run_id = f"phalanx-{uuid.uuid4().hex[:12]}"
        listener = _listen()
        _listeners[run_id] = listener
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            run_id=run_id,
            rdzv_backend=_registered(RENDEZVOUS, _rendezvous_handler),
            rdzv_endpoint=f"127.0.0.1:{listener.getsockname()[1]}",
            local_addr="127.0.0.1",
            **common,
        )
    else:
        run_id = nodes.run_id
        _stores[run_id] = store
        if (
            nodes.elastic
        ):  # rounds of torch's dynamic rendezvous: whoever is there, between least and count
            config = LaunchConfig(
                min_nodes=nodes.least,
                max_nodes=nodes.count,
                run_id=run_id,
                rdzv_backend=_registered(ELASTIC_RENDEZVOUS, _elastic_rendezvous_handler),
                rdzv_endpoint=f"{nodes.host}:{nodes.port}",
                rdzv_configs={"last_call_timeout": LAST_CALL_S, "join_timeout": 600},
                **common,
            )
        else:
            config = LaunchConfig(
                min_nodes=nodes.count,
                max_nodes=nodes.count,
                run_id=run_id,
                rdzv_backend=_registered(NODES_RENDEZVOUS, _nodes_rendezvous_handler),
                rdzv_endpoint=f"{nodes.host}:{nodes.port}",
                rdzv_configs={"rank": nodes.rank},
                **common,
            )
    clear_requests(run_dir)
    for name in (
        "torch.distributed.elastic",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.multiprocessing.spawn",
    ):  # the launcher reports failures itself, once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _Relay(run_dir), _environment(_workers_settings(run_dir, nodes)):
            results = elastic_launch(config, worker)(str(run_dir), os.getpid(), run, args)
    except ChildFailedError as e:
        raise _explain(e, records, run_dir / STACKS) from None
    finally:
        shutil.rmtree(records, ignore_errors=True)
        unused = _listeners.pop(run_id, None)
        if unused is not None:
            unused.close()
        _stores.pop(run_id, None)
        if nodes is None or nodes.rank == 0:
            clear_requests(run_dir)
    return int(results[min(results)]) if results else 1


# --- the launcher's signals ---------------------------------------------------------------------


class _Relay:
    """SIGINT and SIGTERM in the launcher, for the whole launch. The first once training runs writes
    STOP_FILE; a second one, or one before training started, writes ABORT_FILE and raises
    `signals.Interrupted` in the main thread (the elastic agent then ends the workers).

    The signals are blocked in the main thread and taken by a thread of this class, one by one
    (two in quick succession count twice) and at once (the main thread may be asleep). The workers,
    forked from the main thread, start with them blocked too, and unblock them only once their own
    handlers are in place: a Ctrl-C during their start-up never prints a KeyboardInterrupt traceback
    from their imports."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.requested = False
        self._started = _count_started(
            run_dir
        )  # "started" events before this launch (a resumed run)
        self._previous: dict[int, object] = {}
        self._interrupt: int | None = (
            None  # the signal the receiving thread passed on to the main thread
        )
        self._closed = threading.Event()
        self._receiver: threading.Thread | None = None

    def __enter__(self) -> _Relay:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals.SIGNALS}
        if hasattr(signal, "sigtimedwait"):
            from multiprocessing import resource_tracker

            # started now: started later, it would unblock the signals (it blocks them around its start)
            resource_tracker.ensure_running()
            self._receiver = threading.Thread(
                target=self._receive, name="phalanx-signals", daemon=True
            )
            self._receiver.start()
            signal.pthread_sigmask(signal.SIG_BLOCK, signals.SIGNALS)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._closed.set()
            self._receiver.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._receiver is not None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.SIGNALS)

    def training(self) -> bool:
        return _count_started(self.run_dir) > self._started

    def _receive(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals.SIGNALS)
        while not self._closed.is_set():
            info = signal.sigtimedwait(signals.SIGNALS, 0.1)
            if info is not None and self._relay(info.si_signo):
                self._interrupt = info.si_signo
                _thread.interrupt_main(info.si_signo)  # runs _handle in the main thread

    def _handle(self, signum: int, frame: object) -> None:
        """A signal in the main thread: one delivered there, or one the receiving thread passes on."""
        passed_on, self._interrupt = self._interrupt, None
        if passed_on is not None or self._relay(signum):
            raise signals.Interrupted(passed_on or signum)

    def _relay(self, signum: int) -> bool:
        """Tell the workers; whether the launch must end now."""
        if self.requested or not self.training():
            _write(self.run_dir / ABORT_FILE, str(128 + signum))  # the workers exit at once
            return True
        self.requested = True
        _write(self.run_dir / STOP_FILE, str(signum))
        log.warning(
            "%s received: the workers finish their step and save; send it again to stop at once",
            signal.Signals(signum).name,
        )
        return False


def _count_started(run_dir: Path) -> int:
    return sum(1 for event in rundir.read_trace(run_dir) if event.get("event") == "started")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:  # the run directory is gone: there is nothing left to stop
        pass


# --- everything on loopback ---------------------------------------------------------------------


def _listen() -> socket.socket:
    """A socket listening on 127.0.0.1, on a port of its own."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(socket.SOMAXCONN)
    return sock


def _store_on(sock: socket.socket):
    """A store server that listens on `sock` (which it takes over), instead of on every interface."""
    from torch.distributed import TCPStore

    port = sock.getsockname()[1]
    return TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        timeout=timedelta(seconds=60),
    )


def _rendezvous_handler(params):
    """torch's c10d rendezvous, with both of its store servers (the rendezvous' own, and the one the
    workers share) listening on 127.0.0.1 only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Backend(C10dRendezvousBackend):
        name = RENDEZVOUS  # the handler must answer to the name it was asked for

    store = _store_on(_listeners.pop(params.run_id))
    handler = create_handler(store, Backend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda addr, port: _store_on(_listen())
    return handler


def _registered(name: str, handler: Callable) -> str:
    """`name`, registered with torch's launcher as the rendezvous that `handler` makes."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, handler)
    return name


NODES_RENDEZVOUS = "phalanx-nodes"
_stores: dict[str, Any] = {}  # run id -> the job's store (`join`), for the rendezvous handler


def _nodes_rendezvous_handler(params):
    """A static rendezvous (each node's rank given, the node count fixed) over the store that `join`
    made, instead of one listening on every interface; the workers share that store."""
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    host, port = params.endpoint.rsplit(":", 1)
    store, rank, count, run_id = (
        _stores[params.run_id],
        int(params.config["rank"]),
        params.max_nodes,
        params.run_id,
    )

    class Static(RendezvousHandler):
        use_agent_store = True

        def get_backend(self) -> str:
            return NODES_RENDEZVOUS

        def next_rendezvous(self) -> RendezvousInfo:
            return RendezvousInfo(
                PrefixStore(run_id, store), rank, count, RendezvousStoreInfo(host, int(port))
            )

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return run_id

        def shutdown(self) -> bool:
            return True

    return Static()


ELASTIC_RENDEZVOUS = "phalanx-elastic"
LAST_CALL_S = 3  # after the least count has joined a round, how long it waits for more machines
ROUND_KEY = (
    "phalanx/round-of-node/"  # + a machine's rank in the round: the round's token, for its workers
)


def _elastic_rendezvous_handler(params):
    """torch's dynamic rendezvous over the store that `join` made. Its workers use that same store
    (no other one is served), under the round's own prefix: machines restart their workers a
    different number of times, so an attempt count would not agree among them, and keys of the
    previous round (its ranks' addresses) are stale. The round's token is drawn by its rank 0 and
    left for each machine's workers under `ROUND_KEY`."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Backend(C10dRendezvousBackend):
        name = ELASTIC_RENDEZVOUS

    host, port = params.endpoint.rsplit(":", 1)
    store = _stores[params.run_id]
    inner = create_handler(store, Backend(store, params.run_id), params)

    class Elastic(RendezvousHandler):
        use_agent_store = True

        def get_backend(self) -> str:
            return ELASTIC_RENDEZVOUS

        def next_rendezvous(self) -> RendezvousInfo:
            info = inner.next_rendezvous()
            if info.rank == 0:
                info.store.set("phalanx/round-token", uuid.uuid4().hex)
            token = info.store.get(
                "phalanx/round-token"
            )  # in the round's own keys: waits for rank 0's
            store.set(f"{ROUND_KEY}{info.rank}", token)
            return RendezvousInfo(
                info.store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port))
            )

        def is_closed(self) -> bool:
            return inner.is_closed()

        def set_closed(self) -> None:
            inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return inner.get_run_id()

        def shutdown(self) -> bool:
            return inner.shutdown()

    return Elastic()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _workers_settings(run_dir: Path, nodes: Nodes | None) -> dict[str, str]:
    """Variables the workers start with (where the user has not set them):
    - NCCL's flight recorder: on a collective's timeout each rank writes its last collectives to
      `stacks/nccl-trace-rank-<R>` (gloo ignores it);
    - on one machine, or a rendezvous on loopback, gloo and NCCL connect over the loopback interface
      (left to themselves, they listen on the address the host name resolves to);
    - in an elastic job, torch's dynamic rendezvous serves no store of its own for the workers (it
      would listen on every interface): the elastic handler gives them the job's store."""
    settings = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / STACKS / "nccl-trace-rank-"),
    }
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    loopback = next((n for n in names if n in ("lo", "lo0")), None)
    if loopback and (nodes is None or _is_loopback(nodes.host)):
        settings |= {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    if nodes is not None and nodes.elastic:
        settings["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return settings


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    """`settings` in this process's environment, which the workers inherit, while the launch lasts;
    a variable the user set is left as it is."""
    added = [key for key in settings if key not in os.environ]
    for key in added:
        os.environ[key] = settings[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


# --- the workers --------------------------------------------------------------------------------


def worker(run_dir: str, launcher_pid: int, run: Callable[..., int], args: tuple) -> int:
    """Entry point of each worker process (picklable, module level): `run(run_dir, *args)`."""
    _detach_from_terminal()
    _Guard(Path(run_dir), launcher_pid).start()
    try:
        return run(Path(run_dir), *args)
    except BaseException as e:  # noqa: BLE001 - every failure is recorded for the launcher, once
        from phalanx.strategies import progress

        dump_stacks(Path(run_dir))
        _record(e, progress.explain(e))
        # the other workers of this attempt need not wait for their timeout (the next attempt's ignore it)
        _write(Path(run_dir) / ABORT_FILE, f"1 {environment.here().attempt}")
        sys.stdout.flush()
        os._exit(2 if isinstance(e, PhalanxError) else 1)


def _detach_from_terminal() -> None:
    """Leave the terminal's process group, so that a Ctrl-C reaches the launcher alone; from now on a
    signal (the launcher ending this worker) ends it at once. The launcher started this process with
    SIGINT and SIGTERM blocked: one that arrived during its start-up is handled now."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpgrp()
    signals.end_at_once_on_signals()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.SIGNALS)


class _Guard(threading.Thread):
    """Ends this worker at once when its launcher is gone, or has written ABORT_FILE."""

    def __init__(self, run_dir: Path, launcher_pid: int):
        super().__init__(name="phalanx-guard", daemon=True)
        self.run_dir, self.abort, self.launcher_pid = run_dir, run_dir / ABORT_FILE, launcher_pid
        self.attempt = str(environment.here().attempt)

    def run(self) -> None:
        while True:
            if os.getppid() != self.launcher_pid:
                _stderr(
                    f"phalanx: the launcher (pid {self.launcher_pid}) has ended; "
                    f"worker rank {environment.here().rank} stops"
                )
                _end(1)
            try:  # "CODE" from the launcher (a signal), "CODE ATTEMPT" from a worker that failed
                code, *attempt = self.abort.read_text().split() or ["1"]
                code = int(code) if attempt in ([], [self.attempt]) else None
            except (OSError, ValueError):
                code = None
            if code is not None:
                dump_stacks(self.run_dir)  # where this rank was (stuck, perhaps) when the job ended
                _end(code)
            time.sleep(GUARD_INTERVAL_S)


STACKS = "stacks"  # in the run directory: each rank's Python stack when the job ended abnormally


def dump_stacks(run_dir: Path) -> None:
    """Every thread's Python stack of this worker into `stacks/rank-<R>.txt` (`-attempt-<A>` after a
    restart), by faulthandler: it works while the main thread is stuck in a native call."""
    place = environment.here()
    name = f"rank-{place.rank}" + (f"-attempt-{place.attempt}" if place.attempt else "") + ".txt"
    with contextlib.suppress(OSError):
        (run_dir / STACKS).mkdir(exist_ok=True)
        with open(run_dir / STACKS / name, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)


def _end(code: int) -> None:
    from phalanx import checkpoint

    checkpoint.abort_in_progress()
    os._exit(code)


def _stderr(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _record(e: BaseException, explained: str | None = None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        },
        "phalanx": {
            "time": time.time(),
            "user_error": isinstance(e, PhalanxError),
            "text": explained or str(e),
            "explained": explained is not None,
            "rank": environment.here().rank,
        },
    }
    with open(path, "w") as f:
        json.dump(data, f)


def _explain(error, records: Path, stacks: Path | None = None) -> PhalanxError:
    """The first failing rank's error: one line for a user error, the ranks that did not arrive for a
    collective's timeout (and where every rank's stack was written), else its traceback."""
    recorded = sorted(_recorded(records), key=lambda info: info["time"])
    if not recorded:
        rank, failure = min(error.failures.items(), key=lambda item: item[1].timestamp)
        return RankFailure(
            f"rank {rank} ended with exit code {failure.exitcode} ({failure.message}); "
            "no traceback was recorded"
        )
    first = recorded[0]
    if first["user_error"]:
        return PhalanxError(first["text"])
    if first.get("explained"):
        where = (
            f"; every rank's stack when the job ended: {stacks}"
            if stacks is not None and stacks.is_dir()
            else ""
        )
        return RankFailure(first["text"] + where)
    return RankFailure(
        f"rank {first['rank']} failed first; every rank was stopped. Its traceback:\n"
        f"{first['callstack'].rstrip()}"
    )


def _recorded(records: Path) -> list[dict]:
    """What every worker recorded under `records`. The launcher reports the first exit it notices,
    which need not be the first failure (a worker that ended at once because another failed may be
    noticed first), so every rank's error file is read."""
    files = sorted(records.glob("*/attempt_*/*/error.json"))
    out = []
    for file in files:
        try:
            data = json.loads(file.read_text())
            info = data["phalanx"]
            info["callstack"] = data["message"]["extraInfo"]["py_callstack"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(info)
    return out
