"""`param_server`: workers that never wait for each other. Servers hold the parameters and the
optimizer; workers pull the parameters, compute gradients on the samples they take, and push them.

Processes 0 .. W-1 are the workers (process 0, the main one, writes the logs and checkpoints), the
last S the servers. Each server holds a share of the parameters (by size, in the optimizer's
order), their optimizer state, and the schedulers; every server receives every gradient's part
for its share and applies one optimizer step per global batch, as one device would.

The samples of each global batch are dealt, not sharded: each micro-batch is cut into W chunks
that the workers claim from server 0 as they become free (a fast worker claims more), and a worker
reads only the samples of the chunks it takes. A chunk's
gradient is weighed by the contract (1/B of the global batch), so the step's gradient is the sum
of its chunks', whoever computed them. A worker computes a chunk of step k on parameters that
have had k - `staleness` updates or more: where its copy is older, it pulls a fresh one from every
server, which answer once they have applied that many. At staleness 0 every chunk of step k is
computed on the parameters after step k - 1, and the run is exactly the synchronous one. Above 0,
a worker may run up to `staleness` steps ahead of the slowest, on parameters as many updates old;
the staleness of each gradient is counted and logged each epoch, with each worker's share of the
work.

The messages go over gloo's point-to-point operations (a group of its own where the default
group is NCCL's): a header, then its payload; a server receives headers from whichever worker
sends one. A step's loss is agreed behind it: the workers learn it from server 0 when it is read.
A stop request stops every worker at the same step, one after the last step any worker had
claimed. Checkpoints hold the logical state: a worker's copy of the model, fresh from the servers,
and the servers' optimizer states gathered into the optimizer's own.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx import environment, signals
from phalanx.data import Micro
from phalanx.engine import concat, total_norm
from phalanx.errors import ConfigError
from phalanx.strategies.base import Micros, ModelOptions, Outcome, Replicated, prepare
from phalanx.strategies.distributed import _OPS, ProcessGroup

if TYPE_CHECKING:
    from phalanx.engine import Engine
    from phalanx.settings import ParamServerSettings

log = logging.getLogger("phalanx")

# message tags: a worker's header to a server, its payload, a server's reply
_HEADER, _PAYLOAD, _REPLY = 11, 12, 13
# what a header asks: [kind, step, a, b, c]
_CLAIM, _PULL, _PUSH, _LOSSES, _STATE, _DONE = range(1, 7)
_HEADER_SIZE = 5
# a server waits for the workers as long as they take (an evaluation, a slow worker's chunk)
_SERVING_TIMEOUT = timedelta(hours=24)
_SCHEDULER_BEFORE_OPTIMIZER = (
    r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
)


class ParamServer(ProcessGroup, Replicated):
    runs_empty_shards = False

    def __init__(
        self,
        accelerator: str,
        settings: ParamServerSettings,
        timeout_s: float | None = None,
        backend: str = "auto",
    ):
        place = environment.here()
        # the parameters and the optimizer live in a server's host memory: it holds no GPU, and
        # every process joins the group over gloo, which both sides speak
        self.serving = place.rank >= place.world_size - settings.servers
        super().__init__("cpu" if self.serving else accelerator, timeout_s, "gloo")
        self.servers, self.staleness = settings.servers, settings.staleness
        self.workers = self.world_size - self.servers  # at least one: `strategies` checked
        if not self.serving:  # a worker steps its schedulers beside the servers' optimizers
            warnings.filterwarnings("ignore", message=_SCHEDULER_BEFORE_OPTIMIZER)
        self.data_rank = 0 if self.serving else self.rank
        self.data_world_size = self.workers
        # every process makes every group, in the same order
        self._wire = dist.new_group(backend="gloo", timeout=_SERVING_TIMEOUT)
        # the workers' collectives: NCCL where they are GPUs and the backend lets it
        crew = "nccl" if accelerator == "cuda" and backend in ("auto", "nccl") else "gloo"
        self._crew = dist.new_group(list(range(self.workers)), backend=crew)
        self._peers = (
            dist.new_group(list(range(self.workers, self.world_size)), backend="gloo")
            if self.servers > 1
            else None
        )
        self._group: Any = None  # the group the collectives run over: all, then the workers
        self._params: list[nn.Parameter] = []  # the optimizer's, in its order
        self._shares: list[list[int]] = []  # each server's parameters, by index
        self._version = 0  # the updates this worker's parameters have had
        self._drained = -1  # the steps done when this worker last caught up with the servers
        self._ids: list[int] = []  # the chunks of the last step this worker trained
        self._unsettled: list[tuple[int, torch.Tensor]] = []  # steps whose loss is not known yet
        self._staleness: Counter[int] = Counter()  # this epoch's gradients, by staleness
        self._chunks = 0  # this epoch's chunks computed here
        self._fetch: Callable[[list[int]], Mapping | None] | None = None  # reads training samples

    shard_name = "chunk"  # what the run's first line calls a worker's part of a micro-batch

    @property
    def layout(self) -> str:
        """How the run's first line describes the processes."""
        bound = "synchronous" if not self.staleness else f"up to {self.staleness} updates stale"
        return (
            f"{_count(self.servers, 'server')} and {_count(self.workers, 'worker')}, which take "
            f"the chunks as they become free ({bound})"
        )

    # --- building

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module
        return prepare(module, options, self._place), self.model

    def _place(self, module: nn.Module) -> nn.Module:
        module = module.to(self.device)
        self.progress.enter("the broadcast of the initial parameters")
        for tensor in module.state_dict().values():  # every process starts from process 0's
            wired = tensor.detach().cpu()
            dist.broadcast(wired, 0, group=self._wire)
            tensor.copy_(wired)
        self.check_identical(module)
        return module

    def _plan(self, engine: Engine) -> None:
        """Which server holds which parameter: the largest first, each to the server holding the
        fewest elements so far (every process computes the same)."""
        if self._params:
            return
        optimizer = engine.trained_optimizer
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._shares = [[] for _ in range(self.servers)]
        held = [0] * self.servers
        for i in sorted(range(len(self._params)), key=lambda i: -self._params[i].numel()):
            s = held.index(min(held))
            self._shares[s].append(i)
            held[s] += self._params[i].numel()
        for share in self._shares:
            share.sort()
        assert self.progress.where is not None  # the trainer tells every strategy its steps
        # every process starts from the same state (broadcast, or restored): the servers' now
        self._version = self.progress.where()[0]

    # --- the step (workers)

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        self._plan(engine)
        assert self.progress.where is not None  # the trainer tells every strategy its steps
        step = self.progress.where()[0]  # steps done before this one: its number from 0
        chunks = list(self._deal(micros))
        engine.begin()
        parts: list[dict | None] = []
        self._ids = []
        waited = 0.0
        stop_at = -1
        last = False
        while not last:  # chunks are handed out in order: after the last, none is left
            start = time.perf_counter()
            chunk, stop_at = self._claim(step, len(chunks), stop)
            if chunk < 0:
                waited += time.perf_counter() - start
                break
            last = chunk == len(chunks) - 1
            if self._version < step - self.staleness:  # older than the bound: a fresh copy
                self._pull(step - self.staleness)
            waited += time.perf_counter() - start
            micro = chunks[chunk]
            assert self._fetch is not None  # the trainer deals before the first step
            batch = self._fetch(micro.shard)
            assert batch is not None  # a chunk holds a sample or more
            weighed = engine.forward(micro, batch)
            engine.backward(weighed.loss, weighed.gradient)
            start = time.perf_counter()
            self._push(step, chunk, len(chunks), weighed.part)
            waited += time.perf_counter() - start
            self._staleness[step - self._version] += 1
            self._chunks += 1
            engine.trained_optimizer.zero_grad(set_to_none=True)
            parts.append(weighed.data)
            self._ids.append(chunk)
        engine.step_schedulers()  # the servers' optimizers step; this process's rates follow
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._unsettled.append((step, loss))
        return Outcome(
            loss,
            parts,
            0 <= stop_at <= step,
            waited,
            settle=lambda: self._settle(step),
        )

    def deal_from(self, fetch: Callable[[list[int]], Mapping | None]) -> None:
        self._fetch = fetch

    def _deal(self, micros: Micros) -> Iterator[Micro]:
        """The step's chunks: each micro-batch (the whole of it, unread) in `workers` contiguous
        pieces, in dataset order; empty ones left out."""
        for micro, _ in micros:
            n = len(micro.shard)
            for piece in range(self.workers):
                lo, hi = piece * n // self.workers, (piece + 1) * n // self.workers
                if hi > lo:
                    yield Micro(micro.shard[lo:hi], micro.global_size)

    def _claim(self, step: int, chunks: int, stop: bool) -> tuple[int, int]:
        """The next chunk of `step` no worker has claimed (-1: none left), from server 0, and the
        step at which every worker stops (-1: none asked to). Chunks are handed out in order."""
        reply = self._ask(self.workers, [_CLAIM, step, chunks, int(stop), 0], 2)
        return int(reply[0]), int(reply[1])

    def _pull(self, version: int) -> None:
        """The parameters from every server, once each has applied `version` updates or more
        (only what changed since this worker's copy)."""
        sent = [
            self._send(server, [_PULL, version, self._version, 0, 0])
            for server in self._server_ranks()
        ]
        versions = []
        for server, share in zip(self._server_ranks(), self._shares, strict=True):
            reply = self._receive(server, 2, torch.int64)
            versions.append(int(reply[0]))
            if reply[1]:
                flat = self._receive(
                    server, _numel(self._params, share), _dtype(self._params, share)
                )
                _unflatten(flat, [self._params[i] for i in share])
        _wait(sent)
        self._version = min(versions)

    def _push(self, step: int, chunk: int, chunks: int, part: torch.Tensor) -> None:
        """This chunk's gradient, each server its share, and its part of the step's loss."""
        loss = torch.zeros(3, dtype=torch.float64)
        values = part.detach().to(torch.float64).reshape(-1).cpu()
        loss[: len(values)] = values
        loss[2] = float(len(values) == 2)  # a weighted loss's pair of sums
        works = []
        for server, share in zip(self._server_ranks(), self._shares, strict=True):
            grads = _flatten(
                [_gradient(self._params[i]) for i in share], _dtype(self._params, share)
            )
            works.append(self._send(server, [_PUSH, step, chunk, self._version, chunks]))
            works.append((dist.isend(grads, server, group=self._wire, tag=_PAYLOAD), grads))
            works.append((dist.isend(loss, server, group=self._wire, tag=_PAYLOAD), loss))
        _wait(works)

    def _settle(self, step: int) -> None:
        """The global loss of every step up to `step` whose loss this worker does not know yet,
        from server 0, which answers once it has applied them."""
        due = [(k, loss) for k, loss in self._unsettled if k <= step]
        if not due:
            return
        self._unsettled = [(k, loss) for k, loss in self._unsettled if k > step]
        first, last = due[0][0], due[-1][0]
        values = self._ask(
            self.workers, [_LOSSES, first, last, 0, 0], last - first + 1, torch.float64
        )
        for k, loss in due:
            loss.fill_(float(values[k - first]))

    def _catch_up(self) -> None:
        """This worker's copy of the model as the servers hold it after every step done so far
        (before an evaluation, a checkpoint, the run's end)."""
        if not self._params or self.serving:
            return
        assert self.progress.where is not None
        done = self.progress.where()[0]
        if self._drained == done and self._version >= done:
            return
        self._pull(done)
        self._drained = done

    # --- what a worker asks of the servers

    def _server_ranks(self) -> range:
        return range(self.workers, self.world_size)

    def _send(self, server: int, header: list[int]) -> Any:
        message = torch.tensor(header, dtype=torch.int64)
        return dist.isend(message, server, group=self._wire, tag=_HEADER), message

    def _receive(self, server: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(n, dtype=dtype)
        with signals.waiting():  # a server that died never answers: a signal still ends this
            dist.recv(out, server, group=self._wire, tag=_REPLY)
        return out

    def _ask(
        self, server: int, header: list[int], n: int, dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        sent = self._send(server, header)
        reply = self._receive(server, n, dtype)
        _wait([sent])
        return reply

    # --- roles

    def working(self) -> contextlib.AbstractContextManager:
        return self._working()

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        self._group = self._crew
        yield
        self._catch_up()
        for server in self._server_ranks():
            _wait([self._send(server, [_DONE, 0, 0, 0, 0])])
        self._group = None

    def serve(self, engine: Engine, steps_per_epoch: int | None) -> None:
        if steps_per_epoch is None:
            raise ConfigError(
                "parallel.strategy=param_server needs a training stream whose length is known "
                "(its servers end each epoch by its steps); give the dataset a __len__, or use "
                "parallel.strategy=ddp"
            )
        self._plan(engine)
        assert self.progress.where is not None
        _Server(self, engine, self.progress.where()[0], steps_per_epoch).run()

    def epoch_report(self) -> None:
        counts = self.gather((dict(self._staleness), self._chunks))
        self._staleness, self._chunks = Counter(), 0
        if not self.is_main:
            return
        histogram: Counter[int] = Counter()
        for seen, _ in counts:
            histogram.update(seen)
        total = sum(n for _, n in counts) or 1
        log.info(
            "param_server | gradients by staleness (updates old): %s; each worker's share: %s",
            ", ".join(f"{k}: {histogram[k]}" for k in sorted(histogram)) or "none",
            ", ".join(f"{100 * n / total:.0f}%" for _, n in counts),
        )

    # --- collectives: over every process until the run starts, then among the workers

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone()
        self.progress.enter("an all-reduce")
        dist.all_reduce(out, op=_OPS[op], group=self._group)
        return out

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self._group)
        self.progress.enter("a gather")
        dist.all_gather_object(out, value, group=self._group)
        return out

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self.progress.enter("a broadcast")
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def barrier(self) -> None:
        self.progress.enter("a barrier")
        dist.barrier(group=self._group)

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        assert self.progress.where is not None
        if not self.progress.where()[1]:  # evaluating: shards, as every data-parallel strategy
            return super().gather_outputs(parts, keys)
        mine = [
            (chunk, {k: _cpu(v) for k, v in part.items() if keys is None or k in keys})
            for chunk, part in zip(self._ids, parts, strict=True)
            if part is not None
        ]
        every = sorted((c for chunks in self.gather(mine) for c in chunks), key=lambda c: c[0])
        return concat([part for _, part in every])

    # --- state

    def model_state(self) -> nn.Module:
        """The model after every step done so far. During a run every worker saves at the same
        step: they meet first, so that none pushes a later step's gradients before the main one has
        the servers' state too (`optimizer_state`)."""
        if self._group is not None:
            self.barrier()
        self._catch_up()
        return self.model

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        self._catch_up()
        return super().evaluate(engine, batch)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The servers' states, each of its parameters, as one optimizer's (on the main worker;
        the other workers wait for it during a run, see `model_state`)."""
        merged: dict[str, Any] = {}
        if self.is_main and not self._params:  # no step yet: the servers' state is the initial
            merged = optimizer.state_dict()
        elif self.is_main:
            merged = {"state": {}, "param_groups": None}
            for server in self._server_ranks():
                _wait([self._send(server, [_STATE, 0, 0, 0, 0])])
                box: list[Any] = [None]
                dist.recv_object_list(box, server, group=self._wire)
                merged["state"].update(box[0]["state"])
                merged["param_groups"] = merged["param_groups"] or box[0]["param_groups"]
        if self._group is not None:
            self.barrier()
        return merged

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def shutdown(self) -> None:
        self._group = None
        super().shutdown()


@dataclass
class _Step:
    """What a server has received of one step: the sum of its chunks' gradients, of their loss
    parts, and how many of its chunks have come."""

    grads: torch.Tensor
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    received: int = 0
    chunks: int = 0


class _Server:
    """One server's loop: receive a header from any worker, act on it, answer; an update is
    applied once every chunk of the next step has come."""

    def __init__(
        self, strategy: ParamServer, engine: Engine, version: int, steps_per_epoch: int | None
    ):
        self.strategy, self.engine, self.version = strategy, engine, version
        self.steps_per_epoch = steps_per_epoch
        self.index = strategy.rank - strategy.workers
        self.share = strategy._shares[self.index]
        self.params = [strategy._params[i] for i in self.share]
        self.dtype = _dtype(strategy._params, self.share)
        self.numel = sum(p.numel() for p in self.params)
        self.steps: dict[int, _Step] = {}
        self.claimed: dict[int, int] = {}  # step -> chunks claimed (server 0)
        self.stop_at = -1
        self.losses: dict[int, float] = {}  # step -> its global loss (server 0)
        self.pulls: list[tuple[int, int, int]] = []  # (worker, version, its copy's) waiting
        self.asked: list[tuple[int, int, int]] = []  # (worker, first, last) losses waiting
        self.sending: list[Any] = []
        self.done = 0
        self._flat: torch.Tensor | None = None  # the parameters as a pull sends them, this version

    def run(self) -> None:
        header = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
        wire = self.strategy._wire
        while self.done < self.strategy.workers:
            with signals.waiting():  # a worker that died never sends: a signal still ends this
                worker = dist.recv(header, None, group=wire, tag=_HEADER)
            kind, a, b, c, d = (int(x) for x in header)
            if kind == _CLAIM:
                self._claim(worker, a, b, bool(c))
            elif kind == _PULL:
                self.pulls.append((worker, a, b))
            elif kind == _PUSH:
                self._receive_push(worker, a, b, c, d)
            elif kind == _LOSSES:
                self.asked.append((worker, a, b))
            elif kind == _STATE:
                self._send_state(worker)
            elif kind == _DONE:
                self.done += 1
            self._answer()
        _wait(self.sending)

    def _reply(self, worker: int, tensor: torch.Tensor) -> None:
        work = dist.isend(tensor, worker, group=self.strategy._wire, tag=_REPLY)
        self.sending.append((work, tensor))
        if len(self.sending) > 64:
            self.sending = [s for s in self.sending if not s[0].is_completed()]

    def _claim(self, worker: int, step: int, chunks: int, stop: bool) -> None:
        if stop and self.stop_at < 0:  # every worker stops after the step after the last claimed
            self.stop_at = max([step, *self.claimed]) + 1
        taken = self.claimed.get(step, 0)
        # a step applied already had all of its chunks (a slow worker comes to it late)
        chunk = taken if taken < chunks and step >= self.version else -1
        if chunk >= 0:
            self.claimed[step] = taken + 1
        for old in [k for k in self.claimed if k < self.version]:
            del self.claimed[old]
        self._reply(worker, torch.tensor([chunk, self.stop_at], dtype=torch.int64))

    def _receive_push(self, worker: int, step: int, chunk: int, version: int, chunks: int) -> None:
        wire = self.strategy._wire
        grads = torch.empty(self.numel, dtype=self.dtype)
        loss = torch.empty(3, dtype=torch.float64)
        with signals.waiting():
            dist.recv(grads, worker, group=wire, tag=_PAYLOAD)
            dist.recv(loss, worker, group=wire, tag=_PAYLOAD)
        pending = self.steps.get(step)
        if pending is None:
            pending = self.steps[step] = _Step(torch.zeros(self.numel, dtype=self.dtype))
        pending.grads += grads
        pending.loss[:2] += loss[:2]
        pending.loss[2] = loss[2]
        pending.received += 1
        pending.chunks = chunks
        while self.version in self.steps and self._complete(self.steps[self.version]):
            self._apply(self.steps.pop(self.version))

    @staticmethod
    def _complete(pending: _Step) -> bool:
        return pending.received == pending.chunks

    def _apply(self, pending: _Step) -> None:
        """One optimizer step with the step's summed gradients, as `Engine.finish` takes it."""
        optimizer = self.engine.trained_optimizer
        optimizer.zero_grad(set_to_none=True)
        _unflatten_grads(pending.grads, self.params)
        weighted = pending.loss[2] > 0
        loss = pending.loss[:2].clone() if weighted else pending.loss[0].clone()
        value = self.engine.finish(loss, self._norm)
        self.losses[self.version] = float(value)
        self.version += 1
        self._flat = None
        if self.steps_per_epoch and self.version % self.steps_per_epoch == 0:
            self.engine.end_epoch()
        for old in [k for k in self.losses if k < self.version - 100_000]:
            del self.losses[old]

    def _norm(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm over every server's share."""
        norm = total_norm(gradients).to(torch.float64)
        peers = self.strategy._peers
        if peers is None:
            return norm
        squared = norm.square().reshape(1)
        dist.all_reduce(squared, group=peers)
        return squared.sqrt()[0]

    def _answer(self) -> None:
        """The pulls and loss requests that can be answered now."""
        waiting = []
        for worker, version, have in self.pulls:
            if self.version < version:
                waiting.append((worker, version, have))
                continue
            changed = self.version != have
            self._reply(worker, torch.tensor([self.version, int(changed)], dtype=torch.int64))
            if changed:
                if self._flat is None:  # one copy a version, however many workers pull it
                    self._flat = _flatten([p.detach() for p in self.params], self.dtype)
                self._reply(worker, self._flat)
        self.pulls = waiting
        waiting_losses = []
        for worker, first, last in self.asked:
            if self.version <= last:
                waiting_losses.append((worker, first, last))
                continue
            values = [self.losses[k] for k in range(first, last + 1)]
            self._reply(worker, torch.tensor(values, dtype=torch.float64))
        self.asked = waiting_losses

    def _send_state(self, worker: int) -> None:
        state = self.engine.trained_optimizer.state_dict()
        mine = {
            "state": {i: s for i, s in state["state"].items() if i in set(self.share)},
            "param_groups": state["param_groups"],
        }
        dist.send_object_list([mine], worker, group=self.strategy._wire)


# --- helpers


def _dtype(params: list[nn.Parameter], share: list[int]) -> torch.dtype:
    dtype = torch.float32
    for i, k in enumerate(share):
        dtype = params[k].dtype if i == 0 else torch.promote_types(dtype, params[k].dtype)
    return dtype


def _numel(params: list[nn.Parameter], share: list[int]) -> int:
    return sum(params[i].numel() for i in share)


def _gradient(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _flatten(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=dtype) for t in tensors])


def _unflatten(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _unflatten_grads(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """The parameters' gradients: views of `flat` (which they then own), copies where the dtype
    differs."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _wait(works: list[tuple[Any, torch.Tensor]]) -> None:
    """Wait for each (work, the tensor it sends: kept alive until then)."""
    with signals.waiting():
        for work, _ in works:
            work.wait()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
