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

The messages go over gloo's point-to-point operations, on a link of each server and worker
(`serving`): a header, then its payload; a server takes the messages from whichever worker sends
one, in the order they come. A step's loss is agreed behind it: the workers learn it from server 0
when it is read. A stop request stops every worker at the same step, one after the last step any
worker had claimed. Checkpoints hold the logical state: a worker's copy of the model, fresh from
the servers, and the servers' optimizer states gathered into the optimizer's own.

A worker other than process 0 that dies is started again alone by the launcher (`max_restarts`):
the new process makes its own links, asks server 0 where the servers are and starts there
(`rejoining`, `joined_at`); the workers meet in a group of their own made again each time one
rejoins. The servers' side of this is in `serving`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import Field, StrictInt
from torch import nn

from phalanx import environment
from phalanx.data import Micro
from phalanx.engine import concat
from phalanx.errors import ConfigError, count
from phalanx.settings import StrategySettings
from phalanx.strategies import crew, in_worker, progress, serving
from phalanx.strategies.base import Micros, ModelOptions, Outcome, Replicated, prepare
from phalanx.strategies.ddp import INSTEAD
from phalanx.strategies.distributed import ProcessGroup, _attempt_store, _default_store
from phalanx.strategies.registry import PRECISION, Family, refuse, register
from phalanx.strategies.serving import CLAIM, DONE, LOSSES, PULL, PUSH, STATE

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.engine import Engine

log = logging.getLogger("phalanx")

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
        self.incarnation = place.incarnation
        if self.incarnation:  # in place of a worker that died: the others' group is closed to it
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        super().__init__("cpu" if self.serving else accelerator, timeout_s, "gloo")
        if self.incarnation:
            self.rank, self.world_size = place.rank, place.world_size
        self.servers, self.staleness = settings.servers, settings.staleness
        self.workers = self.world_size - self.servers  # at least one: `strategies` checked
        if not self.serving:  # a worker steps its schedulers beside the servers' optimizers
            warnings.filterwarnings("ignore", message=_SCHEDULER_BEFORE_OPTIMIZER)
        self.data_rank = 0 if self.serving else self.rank
        self.data_world_size = self.workers
        # the processes talk over gloo groups of their own, made from the job's store by name:
        # a link of each server and worker, the servers' group, and the workers' group of each
        # generation (a new one each time a worker dies)
        store = _attempt_store(place, timedelta(seconds=self.timeout_s)) if place.in_group else None
        self._store = store if store is not None else _default_store()
        if self._store is None:
            raise RuntimeError("param_server needs the process group's store, which torch hides")
        self._run = serving.next_run()
        if self.incarnation:  # it reports to a store of its own, and sees no other's reports
            self.progress.peers = ()
        if self.serving:
            self._links = {
                worker: serving.link(self._store, self._run, self.rank, worker, 0, True)
                for worker in range(self.workers)
            }
        else:
            self._links = {
                server: serving.link(
                    self._store, self._run, server, self.rank, self.incarnation, False
                )
                for server in self._server_ranks()
            }
        # what a worker asks of the servers (servers ask nothing)
        self._client = serving.Client(self._links, self.timeout_s, self.progress.late)
        self._peers = None  # the servers' group
        if self.serving and self.servers > 1:
            index, run = self.rank - self.workers, self._run
            self._peers = crew.named_group(
                self._store, run, "peers", index, self.servers, self.timeout_s
            )
        # the workers' own group, where the collectives run once the run has started
        self._crew = crew.Crew(
            self._store, self._run, self.rank, self.workers, self.timeout_s, self.progress.enter
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

    def describe(self) -> tuple[str, str]:
        # a worker's part of a micro-batch is a chunk
        bound = "synchronous" if not self.staleness else f"up to {self.staleness} updates stale"
        return "chunk", (
            f"{count(self.servers, 'server')} and {count(self.workers, 'worker')}, which take "
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
            dist.broadcast(wired, 0)
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
        # every process starts from the same state (broadcast, or restored): the servers' now;
        # one in a dead worker's place has none of theirs yet
        self._version = -1 if self.incarnation else self.progress.where()[0]

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

    # a worker's gradients go to the servers as they are made
    local_gradients = False

    @property
    def random_processes(self) -> int:
        # the workers' streams alone are saved: a server draws nothing
        return self.workers

    def feed(self, feed: Any) -> None:
        # each worker takes each batch's samples as it becomes free, and reads them itself
        feed.deal(self._deal_from)

    def _deal_from(self, fetch: Callable[[list[int]], Mapping | None]) -> None:
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
        reply = self._client.ask(self.workers, [CLAIM, step, chunks, int(stop), 0], 2)
        return int(reply[0]), int(reply[1])

    def _pull(self, version: int) -> None:
        """The parameters from every server, once each has applied `version` updates or more
        (only what changed since this worker's copy)."""
        sent = [
            self._client.send(server, [PULL, version, self._version, 0, 0])
            for server in self._server_ranks()
        ]
        versions = []
        for server, share in zip(self._server_ranks(), self._shares, strict=True):
            reply = self._client.receive(
                server, 2, torch.int64, (version, "the servers' parameters")
            )
            versions.append(int(reply[0]))
            if reply[1]:
                flat = self._client.receive(
                    server,
                    serving.numel_of(self._params, share),
                    serving.dtype_of(self._params, share),
                )
                serving.unflatten(flat, [self._params[i] for i in share])
        serving.wait(sent)
        self._version = min(versions)

    def _push(self, step: int, chunk: int, chunks: int, part: torch.Tensor) -> None:
        """This chunk's gradient, each server its share, and its part of the step's loss."""
        loss = torch.zeros(3, dtype=torch.float64)
        values = part.detach().to(torch.float64).reshape(-1).cpu()
        loss[: len(values)] = values
        loss[2] = float(len(values) == 2)  # a weighted loss's pair of sums
        # server 0 last, once the others have theirs: what server 0 has, every server has (it
        # deals a dead worker's chunks again only where it lacks them)
        for server, share in reversed(list(zip(self._server_ranks(), self._shares, strict=True))):
            grads = serving.flatten(
                [serving.gradient(self._params[i]) for i in share],
                serving.dtype_of(self._params, share),
            )
            link = self._links[server]
            serving.wait(
                [
                    self._client.send(server, [PUSH, step, chunk, self._version, chunks]),
                    serving.send(link, grads, serving.PAYLOAD, serving=False),
                    serving.send(link, loss, serving.PAYLOAD, serving=False),
                ]
            )

    def _settle(self, step: int) -> None:
        """The global loss of every step up to `step` whose loss this worker does not know yet,
        from server 0, which answers once it has applied them."""
        due = [(k, loss) for k, loss in self._unsettled if k <= step]
        if not due:
            return
        self._unsettled = [(k, loss) for k, loss in self._unsettled if k > step]
        first, last = due[0][0], due[-1][0]
        header, awaits = [LOSSES, first, last, 0, 0], (last + 1, "its loss, from server 0")
        values = self._client.ask(self.workers, header, last - first + 1, torch.float64, awaits)
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

    # --- roles

    def working(self) -> contextlib.AbstractContextManager:
        return self._working()

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        self._group = "workers"
        if not self.incarnation:  # the servers serve, and take no part in the collectives
            self.progress.peers = range(self.workers)
        yield
        self._catch_up()
        for server in self._server_ranks():
            serving.wait([self._client.send(server, [DONE, 0, 0, 0, 0])])
        self._group = None
        if not self.incarnation:
            self.progress.peers = range(self.world_size)

    def serve(self, engine: Engine, steps_per_epoch: int | None) -> None:
        if steps_per_epoch is None:
            raise ConfigError(
                "parallel.strategy=param_server needs a training stream whose length is known "
                "(its servers end each epoch by its steps); give the dataset a __len__, or use "
                "parallel.strategy=ddp"
            )
        self._plan(engine)
        assert self.progress.where is not None
        index = self.rank - self.workers
        server = serving.Server(
            engine,
            index,
            self._shares[index],
            self.workers,
            self._peers,
            self.progress.where()[0],
            steps_per_epoch,
            lambda worker, incarnation: serving.link(
                self._store, self._run, self.rank, worker, incarnation, True
            ),
            self._crew.new_generation,
        )
        server.run(self._links)

    def end_epoch(self) -> None:
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
        if self._group is None:  # before the run: every process (one that rejoins: only itself)
            return tensor.detach().clone() if self.incarnation else super().reduce(tensor, op)
        return self._crew.reduce(tensor, op)

    def gather(self, value: Any) -> list[Any]:
        if self._group is None:
            return [value] * self.world_size if self.incarnation else super().gather(value)
        return self._crew.gather(value)

    def broadcast(self, value: Any) -> Any:
        if self._group is None:
            return value if self.incarnation else super().broadcast(value)
        return self._crew.broadcast(value, self.is_main)

    def barrier(self) -> None:
        if self._group is None:
            return None if self.incarnation else super().barrier()
        self._crew.barrier()

    def meet(self, what: str, step: int) -> None:
        """Nothing: the workers meet in `model_state`'s barrier (one rejoined reports elsewhere)."""

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
                [size] = self._client.ask(server, [STATE, 0, 0, 0, 0], 1).tolist()
                share = serving.unpack(self._client.receive(server, size, torch.uint8))
                merged["state"].update(share["state"])
                merged["param_groups"] = merged["param_groups"] or share["param_groups"]
        if self._group is not None:
            self.barrier()
        return merged

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    @property
    def rejoining(self) -> bool:
        """Whether this process takes the place of a worker that died, while the others go on."""
        return bool(self.incarnation) and not self.serving

    def joined_at(self) -> tuple[int, bool]:
        """Where the servers are, for a process in a dead worker's place: the steps applied, and
        whether that is the end of an epoch whose evaluation and hooks the workers have still to
        run (no chunk of a later step has been claimed)."""
        reply = self._client.ask(self.workers, [serving.WHERE, 0, 0, 0, 0], 2)
        applied, last_claimed = reply.tolist()
        return applied, last_claimed < applied

    def shutdown(self) -> None:
        """Every process past its last message, the links go first (their gloo threads end here,
        not while the interpreter finalizes), then the group. Where a worker died, the group of
        every process has lost it: the workers meet in theirs, the servers are done already."""
        self._group = None
        rejoined = self._crew.rejoined
        if not self.serving and rejoined:
            self._crew.group().barrier().wait()
        elif dist.is_initialized() and not rejoined:
            self.barrier()
        self._links.clear()  # the client's too
        self._peers = None
        self._crew.close()
        if rejoined:
            progress.stop()
            dist.destroy_process_group()
            return
        super().shutdown()


# --- helpers


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


# --- the strategy as the config names it ---------------------------------------------------


class ParamServerSettings(StrategySettings):
    """`parallel.param_server`: settings of the `param_server` strategy."""

    servers: StrictInt = Field(
        1,
        ge=1,
        description="processes that hold the parameters and the optimizer (each a share of the "
        "parameters) and apply the workers' gradients; the other processes are workers",
    )
    staleness: StrictInt = Field(
        0,
        ge=0,
        description="how many updates old the parameters a worker computes on may be: a worker "
        "whose copy is older waits for a fresh one; 0 is synchronous, and exactly the training "
        "of one device",
    )


def build(cfg: Config, accelerator: str, devices: int) -> ParamServer:
    settings = cfg.parallel.section("param_server", ParamServerSettings)
    if in_worker():
        check(cfg, accelerator, environment.here().world_size)
    else:
        raise ConfigError(
            f"parallel.strategy=param_server runs {settings.servers} server(s) and at least one "
            f"worker, each a process; set parallel.devices to {settings.servers + 1} or more "
            "(phalanx starts them), or start phalanx under torchrun"
        )
    return ParamServer(accelerator, settings, cfg.parallel.timeout_s, backend=cfg.parallel.backend)


def check(cfg: Config, accelerator: str, processes: int) -> None:
    servers = _servers(cfg)
    if processes <= servers:
        raise ConfigError(
            f"parallel.param_server.servers={servers} leaves no worker among the {processes} "
            f"processes; set parallel.devices to at least {servers + 1}, or fewer servers"
        )
    refuse(
        "param_server",
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            PRECISION: cfg.precision == "fp16",
        },
        INSTEAD,
    )
    readers = cfg.dataset.num_workers
    if isinstance(readers, int) and readers > 0:
        log.warning(
            "param_server: each worker reads the training samples it takes in its own process, "
            "without DataLoader workers; dataset.num_workers=%d serves the evaluated streams only",
            readers,
        )


def _servers(cfg: Config) -> int:
    """The processes that hold no GPU: the servers."""
    return cfg.parallel.section("param_server", ParamServerSettings).servers


def _rejoining(cfg: Config, devices: int) -> tuple[int, ...]:
    """The workers other than the main one: one that dies is started again alone while the others
    go on."""
    return tuple(range(1, devices - _servers(cfg)))


register(
    Family(
        "param_server",
        build,
        "servers hold the parameters and the optimizer; workers pull, compute and push, without "
        "waiting for each other (a staleness bound)",
        process_per_device=True,
        check=check,
        settings=ParamServerSettings,
        field=Field(default_factory=ParamServerSettings, description="the param_server strategy's"),
        host_processes=_servers,
        rejoining=_rejoining,
        unplanned=lambda m, devices: (
            "its asynchronous updates are not priced; measure them with phalanx bench CONFIG "
            "parallel.strategy=param_server"
        ),
    )
)
