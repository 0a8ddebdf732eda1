"""What strategies of one process per device share: the process group, its collectives, and the
progress each rank publishes so that a timed-out collective names the ranks that did not arrive."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx import environment
from phalanx.config import flat_keys
from phalanx.errors import ConfigError
from phalanx.strategies import progress
from phalanx.strategies.base import Abilities

log = logging.getLogger("phalanx")
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
DEFAULT_TIMEOUT_S = {"cpu": 300.0, "cuda": 600.0}


class ProcessGroup(Abilities):
    """This process's device, its place in the process group (joined here unless already joined) and
    the collectives over it. Each collective is counted (`progress`): a background thread publishes
    the count and the step to the group's store, so that a timed-out collective names the ranks
    that never arrived and their step."""

    def __init__(self, accelerator: str, timeout_s: float | None = None, backend: str = "auto"):
        """`backend`: nccl or gloo; auto picks nccl on GPUs and gloo on CPUs."""
        place = environment.here()
        self.local_rank = place.local_rank
        if accelerator == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.devices = (self.device,)
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S[self.device.type]
        self._made_alone = False  # a group of this process alone, made here
        if not dist.is_initialized():
            self._made_alone = place.launcher == "alone"
            if backend == "auto":
                backend = "nccl" if accelerator == "cuda" else "gloo"
            try:
                _join(place, backend, timedelta(seconds=self.timeout_s))
            except dist.DistStoreError as e:
                raise _join_timed_out(place, self.timeout_s, e) from None
        try:
            self._set_up()
        except BaseException:  # no strategy comes back to abandon: a group made here goes now
            self.abandon()
            raise

    def _set_up(self) -> None:
        """In the group: this process's place in it, the flight recorder's folder, and the thread
        that publishes its collectives' count."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        trace = environment.nccl_trace_prefix() if dist.get_backend() == "nccl" else None
        if trace:  # the flight recorder's folder (the launcher turned it on)
            Path(trace).parent.mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                log.info(
                    "NCCL's flight recorder is on: on a collective's timeout, each rank writes "
                    "its last collectives to %s<rank>",
                    trace,
                )
        self.data_rank, self.data_world_size = self.rank, self.world_size
        self.progress = progress.start(self.rank, self.world_size, self.timeout_s, _default_store())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def watch(self, where: Callable[[], tuple[int, bool]]) -> None:
        """`where()` tells the run's steps done and whether it is training, for naming a hung
        rank's step."""
        self.progress.where = where

    def check_identical(self, module: nn.Module) -> None:
        """Every rank holds the same parameters and buffers (a hash of them compared)."""
        differing = self.differing_ranks(module)
        if differing:
            raise RuntimeError(
                f"initial parameters differ on ranks {differing} after the broadcast"
            )

    def differing_ranks(self, module: nn.Module) -> list[int]:
        """The ranks whose parameters and buffers differ from rank 0's (a hash of them compared)."""
        digest = hashlib.sha256()
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(
                tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            )
        digests = self.gather(digest.hexdigest())
        return [r for r, d in enumerate(digests) if d != digests[0]]

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone()
        self.progress.enter("an all-reduce")
        dist.all_reduce(out, op=_OPS[op])
        return out

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.progress.enter("a gather")
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self.progress.enter("a broadcast")
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.progress.enter("a barrier")
        dist.barrier()

    def meet(self, what: str, step: int) -> None:
        self.progress.meet(what, step)

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        """Every rank's data for each micro-batch, concatenated in dataset order (rank order within
        a micro-batch, micro-batches in order). Only `keys` move, through the CPU."""
        from phalanx.engine import concat

        out = []
        for part in parts:
            payload = None
            if part is not None:
                payload = {
                    k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                    for k, v in part.items()
                    if keys is None or k in keys
                }
            out.append(concat(self.gather(payload)))
        return concat(out)

    def shutdown(self) -> None:
        """After a successful run: every rank leaves the group together. A rank that tore its group
        down while another still talked to it could abort at exit in gloo's threads ("terminate
        called without an active exception"), failing a run that had succeeded."""
        global left_a_group
        progress.stop()
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()
            left_a_group = self.world_size > 1
            if left_a_group:  # the interpreter's lock free while gloo's threads let go (see below)
                time.sleep(RELEASE_S)

    def abandon(self) -> None:
        """A group of this process alone (fsdp on one device, in the user's process) goes with the
        failed run: no other rank is left to fail on its closing, and the user's next run in this
        process makes its own. A group of several stays (see `shutdown`)."""
        if self._made_alone and dist.is_initialized():
            progress.stop()
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                dist.destroy_process_group()


# Whether this process trained in a group of several and left it: the gloo worker threads may still
# be releasing the last collectives' tensors (which takes the interpreter's lock), and an
# interpreter that finalizes under them aborts ("terminate called without an active exception").
# The `phalanx` command then ends without finalizing (`cli.entry`); a script that called
# `phalanx.fit` under torchrun, or a worker of the launcher, finalizes: `shutdown` gives the
# threads `RELEASE_S` first (without it, 3 of 20 such scripts aborted on a loaded machine; with
# it, none).
left_a_group = False
RELEASE_S = 0.1


def sum_gradients(params: list[nn.Parameter], group: Any = None, divide: float = 1.0) -> None:
    """The parameters' gradients summed over `group` (divided by `divide`) in place, in one
    all-reduce; a parameter without a gradient takes part with zeros, and gets the sum. A split
    parameter's (a DTensor's) local part is summed with the same part of the other processes."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(_local(p.grad))
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide != 1.0:
        flat /= divide
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (its storage), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def agreement(loss: torch.Tensor, stop: bool) -> torch.Tensor:
    """What `agree` sums over ranks: this rank's loss share (a scalar, or a weighted loss's pair of
    sums) and its stop flag, in float64. Made on the loss's device by a kernel: a tensor from
    Python values would be copied there, and such a copy waits for the device."""
    loss = loss.detach().to(torch.float64).reshape(-1)
    return torch.cat((loss, loss.new_full((1,), float(stop))))


def agreed(values: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The summed `agreement`: the global loss (or pair of sums), and whether any rank asked to
    stop."""
    return values[0] if len(values) == 2 else values[:-1], bool(values[-1] > 0)


class Behind:
    """An agreement (an all-reduce of values ending in the stop flag) running behind the step that
    started it: waited for when the step's loss is read (`settled`, as `Outcome.settle`), and by
    the next step, which takes its stop flag (`stopped`), a step late on every process alike."""

    def __init__(self, values: torch.Tensor, work: Any):
        self._values, self._work = values, work
        self._waited = False
        self._host: list[float] | None = None  # the summed values, checked, on the host

    def settled(self) -> None:
        """The loss is read: the agreement waited for (on a GPU, by the stream that reads it)."""
        if self._waited:
            return
        self._work.wait()  # a timeout raises here, and again at the next reader
        self._waited = True
        if self._values.device.type != "cuda":
            self._to_host(self._values)

    def stopped(self) -> bool:
        """Whether any process asked to stop. On a GPU the values come to the host on a stream of
        their own, which waits for the agreement alone: the kernels queued since (the next step's)
        are not waited for."""
        if self._host is None:
            values = self._values
            if values.device.type != "cuda":
                self.settled()
            else:
                side = _side_stream(values.device)
                with torch.cuda.stream(side):
                    self._work.wait()
                    self._to_host(values.to("cpu"))
                values.record_stream(side)
        assert self._host is not None
        return self._host[-1] > 0

    def _to_host(self, values: torch.Tensor) -> None:
        """The summed values read once, as numbers, and checked."""
        self._host = values.tolist()
        self._check(self._host)

    def _check(self, values: list[float]) -> None:
        """What the summed values must hold, checked once they are on the host."""


class LastAgreement:
    """The step before's agreement, if it ran behind its step: the next step takes its stop flag."""

    def __init__(self) -> None:
        self._last: Behind | None = None

    def swap(self, behind: Behind | None) -> bool:
        """This step's agreement in (None: it was waited for); whether the step before's asked to
        stop."""
        before, self._last = self._last, behind
        return before is not None and before.stopped()

    def check(self) -> None:
        """The last agreement read on the host and checked, where no next step will take it."""
        if self._last is not None:
            self._last.stopped()


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """The stream that brings agreements to the host, one a device."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _join(place: environment.Place, backend: str, timeout: timedelta) -> None:
    """Join the job's process group, through the store of whoever started this process."""
    if place.launcher == "agent" and not place.agent_store:  # rank 0 serves it (torchrun's way)
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = place.rank, place.world_size
    if place.launcher == "agent":  # the agent's store, outliving attempts
        store = _attempt_store(place, timeout)
    elif place.launcher == "slurm":  # a task of srun's: the job's store on its first node
        store = _job_store(place, timeout)
    else:
        # alone: a group of this process only (fsdp on one device), its store in memory, no port
        store, rank, world_size = dist.HashStore(), 0, 1
    dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world_size)


def _join_timed_out(place: environment.Place, timeout_s: float, e: Exception) -> ConfigError:
    """The error of a rank whose wait for the others to join ran out (torch's own says only which
    keys or clients were missing)."""
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConfigError(
        f"rank {place.rank} waited {timeout_s:g} s (parallel.timeout_s) for the job's "
        f"{place.world_size} processes to join, and not all did ({said}): a process started "
        "slower than that (Python, torch and the model's imports, on a loaded machine), or not "
        "at all (see its machine's log); raise parallel.timeout_s, which also bounds every "
        "collective"
    )


def _attempt_store(place: environment.Place, timeout: timedelta) -> dist.Store:
    """The agent's store, under a prefix of this attempt (or of this round, in an elastic job): the
    agent keeps one store for every attempt after a worker failed, and the previous attempt's keys
    (its ranks' addresses) are stale."""
    addr, port = place.master_addr, place.master_port
    if addr is None or port is None:
        raise ConfigError(
            "the agent that started this process set no MASTER_ADDR or MASTER_PORT; "
            "start it with phalanx's launcher or torchrun"
        )
    store = dist.TCPStore(addr, port, place.world_size, False, timeout=timeout)
    round_key = f"phalanx/round-of-node/{place.node_rank}"  # an elastic job's round (see launch)
    if store.check([round_key]):
        return dist.PrefixStore(f"phalanx/round-{store.get(round_key).decode()}", store)
    return dist.PrefixStore(f"phalanx/attempt-{place.attempt}", store)


def _job_store(place: environment.Place, timeout: timedelta) -> dist.TCPStore:
    """The store of a job that Slurm started: served by rank 0 on the master address alone (not on
    every interface, as torch's own would), the other ranks its clients."""
    addr, port = place.master_addr, place.master_port
    if not addr:
        raise ConfigError(
            "this Slurm job names no master address (MASTER_ADDR, or SLURM_JOB_NODELIST); "
            "export MASTER_ADDR in the job script"
        )
    if port is None:  # environment.here derives one from the job id where MASTER_PORT is unset
        raise ConfigError(
            "this Slurm job names no master port; export MASTER_PORT in the job script"
        )
    if place.rank != 0:
        return dist.TCPStore(addr, port, place.world_size, False, timeout=timeout)
    try:
        sock = socket.create_server((addr, port))
    except OSError as e:
        raise ConfigError(
            f"cannot serve the job's store on {addr}:{port} ({e.strerror}); set MASTER_PORT to a "
            "free port in the job script"
        ) from None
    return dist.TCPStore(
        addr,
        port,
        place.world_size,
        True,
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def _default_store() -> Any:
    """The process group's store (where ranks publish their progress), or None where torch hides
    it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, hung ranks are not named
        return None


def check_same_config(strategy: Any, resolved: dict, versions: dict) -> None:
    """Every rank must run the same resolved config and library versions."""
    mine = _flatten({"config": resolved, "versions": versions})
    every = strategy.gather(mine)
    differing = sorted(
        {k for other in every for k in set(other) | set(mine) if other.get(k) != mine.get(k)}
    )
    if differing:
        shown = "; ".join(
            _by_rank(key, [other.get(key) for other in every]) for key in differing[:8]
        )
        more = f" (and {len(differing) - 8} more keys)" if len(differing) > 8 else ""
        raise ConfigError(
            f"ranks run different configs or versions: {shown}{more}. Give every node the same "
            "config file and phalanx, torch versions"
        )


def _by_rank(key: str, values: list[str | None]) -> str:
    """`key: 0.1 on ranks 0-2, 0.2 on rank 3`: each value a rank holds (None: the key is not in its
    config), with the ranks that hold it."""
    holders: dict[str | None, list[int]] = {}
    for rank, value in enumerate(values):
        holders.setdefault(value, []).append(rank)
    return f"{key}: " + ", ".join(
        f"{'not set' if value is None else _clipped(value)} on {_ranks(ranks)}"
        for value, ranks in holders.items()
    )


def _clipped(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    """'rank 3', or 'ranks 0-2, 5' (ascending)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(
        str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs
    )


def _flatten(tree: Any) -> dict[str, str]:
    return {key: repr(value) for key, value in flat_keys(tree).items()}
