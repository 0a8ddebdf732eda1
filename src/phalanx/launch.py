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

The workers fork from a server process that the launch starts and that has imported torch and
phalanx once for all of them (`start_method`, `phalanx.preloaded`); where the platform cannot,
they are spawned.

A worker that fails records its traceback (or, when a collective timed out, which ranks did not
arrive) and tells the others to exit at once; the launcher prints the first failing rank's error
once.

Signals: only the launcher takes them. Its workers leave the terminal's process group, so a Ctrl-C
reaches the launcher alone, which relays it through files in the run directory that the workers
watch: the first SIGINT or SIGTERM once training runs asks them to finish their step and save
(`STOP_FILE`); a second one, or one during start-up, ends them at once (`ABORT_FILE`). A worker
that finds its launcher gone (killed with SIGKILL, say) exits within a second. What runs in the
workers around the training (their entry point, the guard) is `spawned`.
"""

from __future__ import annotations

import _thread
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from phalanx import environment, failures, rundir, signals
from phalanx.errors import PhalanxError, first_line
from phalanx.failures import RankFailure
from phalanx.nodes import (
    ELASTIC_RENDEZVOUS,
    LAST_CALL_S,
    NODES_RENDEZVOUS,
    Nodes,
    elastic_rendezvous_handler,
    nodes_rendezvous_handler,
    registered,
    run_dirs,
    stores,
)
from phalanx.spawned import ABORT_FILE, OOM_FILE, REFORM_FILE, STACKS, worker, write_whole

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import LogsSpecs

log = logging.getLogger("phalanx")
# the workers finish their step, save and exit
STOP_FILE = ".stop-requested"
# the grace torch's agent gives workers still running when its run ends, before it kills them
SHUTDOWN_TIMEOUT_S = 5
RENDEZVOUS = "phalanx-loopback"
# run id -> the rendezvous store's listening socket
_listeners: dict[str, socket.socket] = {}


class _Common(TypedDict):
    """The LaunchConfig settings of every launch, on one machine or several."""

    nproc_per_node: int
    max_restarts: int
    monitor_interval: float
    start_method: str
    signals_to_handle: str
    shutdown_timeout: int
    logs_specs: LogsSpecs


def clear_requests(run_dir: Path) -> None:
    """Remove stop requests a launcher left behind (one killed before it could clean up)."""
    for name in (STOP_FILE, ABORT_FILE, REFORM_FILE):
        (run_dir / name).unlink(missing_ok=True)
        for unfinished in run_dir.glob(f"{name}.*.tmp"):  # a writer ended before its rename
            unfinished.unlink(missing_ok=True)


def launch(
    run_dir: Path,
    devices: int,
    run: Callable[..., int],
    *args: Any,
    nodes: Nodes | None = None,
    store: Any = None,
    restarts: int = 0,
    rejoin: Sequence[int] = (),
) -> int:
    """`run(run_dir, *args)` on `devices` local worker processes (a module-level function: each
    worker imports it by name); returns the exit code of this machine's first worker. With `nodes`
    (and the `store` that `join` gave), this machine's workers are part of a job on several. When a
    worker fails, all of them are started again, up to `restarts` times (`run` then sees the attempt
    in `environment.here().attempt`); the error is the first failure's. A worker of a rank in
    `rejoin` that dies by a signal is started again alone, up to `restarts` times, while the others
    go on (param_server's workers: see `_supervise`)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_main_importable(devices)
    # each worker's error.json, read on failure
    records = Path(tempfile.mkdtemp(prefix="phalanx-workers-"))
    common = _Common(
        nproc_per_node=devices,
        max_restarts=restarts,
        monitor_interval=0.1,
        start_method=start_method(),
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
            rdzv_backend=registered(RENDEZVOUS, _rendezvous_handler),
            rdzv_endpoint=f"127.0.0.1:{listener.getsockname()[1]}",
            local_addr="127.0.0.1",
            **common,
        )
    else:
        run_id = nodes.run_id
        stores[run_id] = store
        run_dirs[run_id] = run_dir
        # rounds of torch's dynamic rendezvous: whoever is there, between least and count
        if nodes.elastic:
            config = LaunchConfig(
                min_nodes=nodes.fewest,
                max_nodes=nodes.count,
                run_id=run_id,
                rdzv_backend=registered(ELASTIC_RENDEZVOUS, elastic_rendezvous_handler),
                rdzv_endpoint=f"{nodes.host}:{nodes.port}",
                rdzv_configs={"last_call_timeout": LAST_CALL_S, "join_timeout": 600},
                **common,
            )
        else:
            config = LaunchConfig(
                min_nodes=nodes.count,
                max_nodes=nodes.count,
                run_id=run_id,
                rdzv_backend=registered(NODES_RENDEZVOUS, nodes_rendezvous_handler),
                rdzv_endpoint=f"{nodes.host}:{nodes.port}",
                rdzv_configs={"rank": nodes.rank},
                **common,
            )
    clear_requests(run_dir)
    # the launcher reads it after a failed launch
    (run_dir / OOM_FILE).unlink(missing_ok=True)
    # the launcher reports failures itself, once
    for name in (
        "torch.distributed.elastic",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.multiprocessing.spawn",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        settings = _workers_settings(run_dir, nodes)
        if rejoin and restarts:
            settings[environment.REJOINS] = f"{','.join(map(str, rejoin))}:{restarts}"
        with _Relay(run_dir), _environment(settings), _server(config.start_method, run):
            results = elastic_launch(config, worker)(str(run_dir), os.getpid(), run, args)
    except ChildFailedError as e:
        first_rank = None if nodes is not None and nodes.elastic else 0
        if nodes is not None and not nodes.elastic:
            first_rank = nodes.rank * devices  # a node's workers come in a block of ranks
        explained = failures.explain(e, records, run_dir / STACKS, first_rank)
        raise failures.in_the_run(
            run_dir, explained, None if nodes is None else nodes.rank
        ) from None
    except Exception as e:
        if nodes is None:
            raise
        # the launcher's own rendezvous failed: the store node 0 serves is gone
        failure = RankFailure(
            f"node {nodes.rank} lost the job's rendezvous at {nodes.host}:{nodes.port} "
            f"({first_line(e)}): node 0, which serves it, has ended or cannot be "
            "reached; once it is back, resume the run on the machines there are: phalanx resume "
            f"{run_dir} --nnodes ... --node-rank ... --rdzv ..."
        )
        raise failures.in_the_run(run_dir, failure, nodes.rank) from None
    finally:
        shutil.rmtree(records, ignore_errors=True)
        unused = _listeners.pop(run_id, None)
        if unused is not None:
            unused.close()
        stores.pop(run_id, None)
        run_dirs.pop(run_id, None)
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
        # "started" events before this launch (a resumed run)
        self._started = _count_started(run_dir)
        self._previous: dict[int, signals.Handler] = {}
        # the signal the receiving thread passed on to the main thread
        self._interrupt: int | None = None
        self._closed = threading.Event()
        self._receiver: threading.Thread | None = None

    def __enter__(self) -> _Relay:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals.SIGNALS}
        if hasattr(signal, "sigtimedwait"):
            from multiprocessing import resource_tracker

            # started now: started later, it would unblock the signals (it blocks them around its
            # start)
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
                # runs _handle in the main thread
                _thread.interrupt_main(signal.Signals(info.si_signo))

    def _handle(self, signum: int, frame: object) -> None:
        """A signal in the main thread: delivered there, or passed on by the receiving thread."""
        passed_on, self._interrupt = self._interrupt, None
        if passed_on is not None or self._relay(signum):
            raise signals.Interrupted(passed_on or signum)

    def _relay(self, signum: int) -> bool:
        """Tell the workers; whether the launch must end now."""
        if self.requested or not self.training():
            write_whole(self.run_dir / ABORT_FILE, str(128 + signum))  # the workers exit at once
            return True
        self.requested = True
        write_whole(self.run_dir / STOP_FILE, str(signum))
        log.warning(
            "%s received: the workers finish their step and save; send it again to stop at once",
            signal.Signals(signum).name,
        )
        return False


def _count_started(run_dir: Path) -> int:
    return sum(1 for event in rundir.read_trace(run_dir) if event.get("event") == "started")


# --- everything on loopback ---------------------------------------------------------------------


def _listen() -> socket.socket:
    """A socket listening on 127.0.0.1, on a port of its own."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(socket.SOMAXCONN)
    return sock


def _store_on(sock: socket.socket):
    """A store server that listens on `sock` (which it takes over), not on every interface."""
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
        # the handler must answer to the name it was asked for
        name = RENDEZVOUS

    store = _store_on(_listeners.pop(params.run_id))
    handler = create_handler(store, Backend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda addr, port: _store_on(_listen())
    return handler


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
      would listen on every interface): the elastic handler gives them the job's store;
    - this process's multiprocessing start method, for the workers' DataLoader workers (see
      `spawned.worker`)."""
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
    import multiprocessing

    # "" where this process has chosen none (asking for it would choose the default for it)
    settings[environment.START_METHOD] = multiprocessing.get_start_method(allow_none=True) or ""
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


# --- how the workers start --------------------------------------------------------------------


def start_method() -> str:
    """Forked from a server process that has imported torch and phalanx once for the launch
    (multiprocessing's forkserver): a worker starts in a tenth of a second, not in the seconds of
    its own imports, and a restarted attempt as fast. Spawned, where there is no forkserver, or no
    pidfd through which a worker watches its launcher (it is the server's child, not the
    launcher's: see `spawned.Watch`)."""
    import multiprocessing
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if "forkserver" not in multiprocessing.get_all_start_methods() or not all(
        hasattr(server, field) for field in [*_SERVER_FIELDS, "_lock"]
    ):  # `_server` sets the running server aside through these
        return "spawn"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return "spawn"
    return "forkserver"


@contextlib.contextmanager
def _server(method: str, run: Callable[..., int]):
    """Around a launch whose workers fork from a server: the server starts at the first worker's
    start, inside the launch's environment and with the signals blocked that the launcher relays,
    as a spawned worker would start; it imports what every worker imports (`phalanx.preloaded`)
    and the module of `run`, and ends with the launch. multiprocessing keeps one such server a
    process: one already running (the user's, with an earlier environment) is set aside for the
    launch and put back after it, with its list of imports."""
    if method != "forkserver":
        yield
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with server._lock:  # type: ignore[attr-defined]
        before = {f: getattr(server, f, empty) for f, empty in _SERVER_FIELDS.items()}
        for field in _SERVER_FIELDS:
            setattr(server, field, None)
    modules = ["phalanx.preloaded"]
    if run.__module__ != "__main__":  # the main module runs again in each worker, as spawned
        modules.append(run.__module__)
    server.set_forkserver_preload(modules)
    try:
        yield
    finally:
        with server._lock:  # type: ignore[attr-defined]
            ours = {f: getattr(server, f, None) for f in _SERVER_FIELDS}
            for field, value in before.items():
                setattr(server, field, value)
        _stop_server(ours["_forkserver_pid"], ours["_forkserver_alive_fd"])
        address = ours["_forkserver_address"]
        if isinstance(address, str) and not address.startswith("\0"):  # a socket's file
            with contextlib.suppress(OSError):
                os.unlink(address)


# what multiprocessing's forkserver keeps of its running server, and its list of imports
_SERVER_FIELDS = {
    "_forkserver_address": None,
    "_forkserver_alive_fd": None,
    "_forkserver_pid": None,
    "_preload_modules": ["__main__"],
}


def _stop_server(pid: int | None, alive: int | None) -> None:
    """End a launch's server once the launch is over: nothing more forks from it, and its workers
    have ended (the agent waited for them). It is killed, not asked to end by closing its pipe: an
    interpreter that imported torch takes most of a second to tear itself down, at every launch,
    and a worker's data loader child or a worker stuck in the kernel, holding the pipe, would keep
    it longer. A worker still alive (the launcher failed on its own) ends with it (`_Guard`)."""
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def check_main_importable(devices: int) -> None:
    """A spawned worker runs this program's main module again before anything else (as
    multiprocessing's spawn does), from its file: a script read from standard input (`python - <
    script.py`) has none, and each worker would end before it could say why."""
    from multiprocessing import spawn

    main = spawn.get_preparation_data("phalanx").get("init_main_from_path")
    if main is not None and not os.path.isfile(main):
        raise PhalanxError(
            f"the {devices} worker processes would each run this program's main module again, "
            f"from its file, {main}, which does not exist (a script read from standard input, "
            "`python - < script.py`, has none): save the script to a file and run "
            "`python script.py`, or set parallel.devices: 1"
        )
