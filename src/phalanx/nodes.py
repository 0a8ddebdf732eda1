"""A job on several machines: each machine's launcher joins the job's store (served by node 0 on
`--rdzv`), the nodes agree that they run one job, node 0 shares its run directory, and torch's
launcher meets the nodes' workers through rendezvous handlers over that store.

Every wait here is a series of short ones, so that a signal ends it at once (a C++ wait of
torch's would hold Python's signal handlers off until its timeout), and a node that hears nothing
says so within seconds, what to check, and goes on waiting until the timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from phalanx import rundir
from phalanx.config import flat_keys
from phalanx.errors import ConfigError, PhalanxError
from phalanx.spawned import REFORM_FILE

log = logging.getLogger("phalanx")
TIMEOUT_S = 600  # how long a node waits for the others
# how long it waits before it says that it is waiting, and for what
SAY_AFTER_S = 5
_POLL_S = 1.0
# run id -> its run directory, for the elastic handler
run_dirs: dict[str, Path] = {}


@dataclass(frozen=True)
class Nodes:
    """This machine's part in a job on several: `count` machines (between `least` and `count` where
    the job is elastic), this one's `rank` (0: the one that serves the job's store, on
    `host:port`)."""

    count: int
    rank: int
    host: str
    port: int
    # elastic: the job goes on with as few machines as this
    least: int | None = None

    @property
    def elastic(self) -> bool:
        return self.least is not None and self.least < self.count

    @property
    def fewest(self) -> int:
        """The fewest machines the job goes on with: `least` where it is given, else `count`."""
        return self.count if self.least is None else self.least

    @property
    def run_id(self) -> str:  # the same on every node
        return f"phalanx-{self.host}-{self.port}"


def join(nodes: Nodes, timeout_s: float = TIMEOUT_S) -> Any:
    """The job's store: served on `nodes.host:port` by node 0 (that address alone), reached by the
    others, who try again every second for up to `timeout_s`, saying after a few seconds that
    nothing answers there yet."""
    from torch.distributed import TCPStore

    if nodes.rank != 0:
        return _reach(nodes, timeout_s)
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


def _reach(nodes: Nodes, timeout_s: float) -> Any:
    started, said = time.monotonic(), False
    where = f"{nodes.host}:{nodes.port}"
    while True:
        try:
            store = _connect(nodes.host, nodes.port)
        except _NotTheStore as e:
            failure = str(e)
            state = f"what answers at {where} is not node 0's rendezvous ({failure})"
        except (RuntimeError, OSError) as e:
            failure = " ".join(str(e).split())[:200] or type(e).__name__
            state = f"nothing answers at {where} yet"
        else:
            store.set_timeout(timedelta(seconds=timeout_s))
            return store
        waited = time.monotonic() - started
        if waited >= SAY_AFTER_S and not said:
            said = True
            log.warning(
                "node %d: %s; is node 0 started with --rdzv %s, and does this machine reach that "
                "address (a firewall, another interface)? Trying again until %.0f s have passed",
                nodes.rank,
                state,
                where,
                timeout_s,
            )
        if waited >= timeout_s:
            raise PhalanxError(
                f"node {nodes.rank} cannot reach node 0 at {where} within {timeout_s:.0f} s "
                f"({failure}); start node 0 with the same --rdzv, and check that this machine "
                "reaches that address"
            ) from None
        time.sleep(0.2)


class _NotTheStore(PhalanxError):
    """Something answers at the address, but not as node 0's store does."""


def _connect(host: str, port: int) -> Any:
    """A client of the store at `host:port`, tried once. A plain connection first: where nothing
    answers, torch's client would print its C++ stack to the terminal on every try; and what that
    client prints where something else answers is held back (the exception says it in a line)."""
    from torch.distributed import TCPStore

    with socket.create_connection((host, port), timeout=_POLL_S):
        pass
    with _native_stderr_held():
        try:
            return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_POLL_S))
        except RuntimeError as e:
            raise _NotTheStore(str(e).strip().splitlines()[0][:200]) from None


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """What native code writes to this process's stderr meanwhile, dropped (a terminal would get
    torch's C++ stack for every failed try)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr: nothing to hold back
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def wait_for(store: Any, key: str, what: str, timeout_s: float = TIMEOUT_S) -> bytes:
    """`store.get(key)`, waited for in short waits (a signal ends it at once); after a few seconds,
    a line saying what is awaited; a PhalanxError after `timeout_s`."""
    started, said = time.monotonic(), False
    while True:
        try:
            store.wait([key], timedelta(seconds=_POLL_S))
        except (RuntimeError, OSError) as e:
            # timed out: not there yet (or the store is gone)
            waited = time.monotonic() - started
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise PhalanxError(
                    f"the job's store is gone while waiting for {what} ({e})"
                ) from None
            if waited >= timeout_s:
                raise PhalanxError(f"no answer from {what} within {timeout_s:.0f} s") from None
            if waited >= SAY_AFTER_S and not said:
                said = True
                log.info("waiting for %s", what)
            continue
        return store.get(key)


RUN_DIR_KEY = "phalanx/run_dir"
JOB_KEY = "phalanx/job/node-"  # + a node's rank: what it was started with
VERDICT_KEY = "phalanx/job/verdict"
HEARD_KEY = "phalanx/job/heard-"  # + a node's rank: it has read the verdict
# keys of a config that each node may set apart
_LOCAL = ("name", "output_root")


def agree(store: Any, nodes: Nodes, resolved: dict) -> None:
    """Every node runs the same job: the same node count and the same resolved config (its name
    and output_root aside: node 0 makes the run directory). Node 0 compares each node's with its
    own as they arrive and gives the verdict; any difference fails every node, with one line that
    names the keys and each node's value. In an elastic job nodes come and go, so a joining node
    compares its own with node 0's, and only it is refused."""
    mine = json.dumps({"nodes": nodes.count, "config": _drop_local_keys(resolved)})
    if nodes.elastic:
        if nodes.rank == 0:
            store.set(f"{JOB_KEY}0", mine)
            return
        theirs = wait_for(store, f"{JOB_KEY}0", "node 0's job").decode()
        problem = _difference({0: theirs, nodes.rank: mine})
        if problem:
            raise ConfigError(problem)
        return
    if nodes.rank != 0:
        store.set(f"{JOB_KEY}{nodes.rank}", mine)
        verdict = wait_for(store, VERDICT_KEY, "node 0's check of the nodes' configs").decode()
        store.set(f"{HEARD_KEY}{nodes.rank}", "")
        if verdict != "same":
            raise ConfigError(verdict)
        return
    seen = {0: mine}
    problem = None
    for rank in range(1, nodes.count):
        seen[rank] = wait_for(store, f"{JOB_KEY}{rank}", f"node {rank} to join").decode()
        problem = _difference(seen)
        if problem:
            break
    store.set(VERDICT_KEY, problem or "same")
    # node 0 serves the store: it stays until the others have read why they stop
    if problem:
        with contextlib.suppress(PhalanxError):
            for rank in seen:
                if rank:
                    wait_for(store, f"{HEARD_KEY}{rank}", f"node {rank}", timeout_s=SAY_AFTER_S)
        raise ConfigError(problem)


def _drop_local_keys(resolved: dict) -> dict:
    return {k: v for k, v in resolved.items() if k not in _LOCAL}


def _difference(jobs: dict[int, str]) -> str | None:
    """One line naming what the nodes' jobs differ in, or None."""
    read = {rank: json.loads(text) for rank, text in jobs.items()}
    counts = {rank: job["nodes"] for rank, job in read.items()}
    if len(set(counts.values())) > 1:
        said = ", ".join(f"node {rank}: --nnodes {count}" for rank, count in counts.items())
        return (
            f"the nodes were started with different node counts ({said}); start every node with "
            "the same --nnodes"
        )
    flat = {rank: flat_keys(job["config"]) for rank, job in read.items()}
    keys = sorted({k for f in flat.values() for k in f})
    differing = [k for k in keys if len({repr(f.get(k)) for f in flat.values()}) > 1]
    if not differing:
        return None
    shown = "; ".join(
        f"{key}: " + ", ".join(f"node {rank} {flat[rank].get(key)!r}" for rank in flat)
        for key in differing[:6]
    ) + (f"; and {len(differing) - 6} more" if len(differing) > 6 else "")
    return (
        f"the nodes were started with different configs ({shown}); start every node with the same "
        "config file and overrides"
    )


def share_run_dir(store: Any, run_dir: Path | None) -> Path:
    """Node 0 gives the run directory it made; the others receive it, and check they see it."""
    if run_dir is not None:
        store.set(RUN_DIR_KEY, str(run_dir))
        return run_dir
    shared = Path(wait_for(store, RUN_DIR_KEY, "node 0's run directory").decode())
    if not (shared / rundir.CONFIG).is_file():
        raise PhalanxError(
            f"node 0's run directory {shared} is not visible on this machine; output_root must be "
            "on a file system every node shares"
        )
    return shared


# --- torch's launcher meets the nodes' workers over the job's store ----------------------------


def registered(name: str, handler: Callable) -> str:
    """`name`, registered with torch's launcher as the rendezvous that `handler` makes."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, handler)
    return name


NODES_RENDEZVOUS = "phalanx-nodes"
# run id -> the job's store (`join`), for the rendezvous handler
stores: dict[str, Any] = {}


def nodes_rendezvous_handler(params):
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
        stores[params.run_id],
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
# after the least count has joined a round, how long it waits for more machines
LAST_CALL_S = 3
# + a machine's rank in the round: the round's token, for its workers
ROUND_KEY = "phalanx/round-of-node/"


def elastic_rendezvous_handler(params):
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
    store = stores[params.run_id]
    inner = create_handler(store, Backend(store, params.run_id), params)

    class Elastic(RendezvousHandler):
        use_agent_store = True

        def get_backend(self) -> str:
            return ELASTIC_RENDEZVOUS

        def next_rendezvous(self) -> RendezvousInfo:
            info = inner.next_rendezvous()
            # every machine's workers of the last round are stopped
            if params.run_id in run_dirs:
                with contextlib.suppress(OSError):
                    (run_dirs[params.run_id] / REFORM_FILE).unlink(missing_ok=True)
            if info.rank == 0:
                info.store.set("phalanx/round-token", uuid.uuid4().hex)
            # in the round's own keys: waits for rank 0's
            token = info.store.get("phalanx/round-token")
            store.set(f"{ROUND_KEY}{info.rank}", token)
            return RendezvousInfo(
                info.store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port))
            )

        def is_closed(self) -> bool:
            return inner.is_closed()

        def set_closed(self) -> None:
            inner.set_closed()

        def num_nodes_waiting(self) -> int:
            """Asked by torch's agent between its looks at the workers; more than 0 and it stops
            them (SIGTERM) for a new round. The marker written first tells them why."""
            waiting = inner.num_nodes_waiting()
            if waiting and params.run_id in run_dirs:
                with contextlib.suppress(OSError):
                    (run_dirs[params.run_id] / REFORM_FILE).write_text(str(waiting))
            return waiting

        def get_run_id(self) -> str:
            return inner.get_run_id()

        def shutdown(self) -> bool:
            return inner.shutdown()

    return Elastic()
