"""The servers' side of `param_server`, the links between servers and workers, and a worker's
side of them (`Client`).

Each server and each worker talk over a gloo group of the two of them alone (a link), made from
the run's store under a name of its own: a worker that dies breaks only its links, which its
servers see at once, and a process started in its place can make new ones without the others
making anything. A server reads each of its links in a thread of its own, which hands each whole
message (a header, and a push's payload) to the server's loop; the loop answers in turn, one
message at a time, in the order they came.

A worker that dies (its links break) loses nothing but its time: server 0 deals the chunks it had
claimed and not pushed again, each server counts a chunk's gradient once however many times it
comes (the dead worker's share of it, or another's recomputation), and every server makes a new
link for the process that takes the dead one's place, which starts where the servers are.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx import signals
from phalanx.engine import total_norm
from phalanx.strategies.progress import is_timeout

if TYPE_CHECKING:
    from phalanx.engine import Engine

# message tags: a worker's header to a server, its payload, a server's reply
HEADER, PAYLOAD, REPLY = 11, 12, 13
# what a header asks: [kind, step, a, b, c]
CLAIM, PULL, PUSH, LOSSES, STATE, DONE, WHERE = range(1, 8)
HEADER_SIZE = 5
# a link waits as long as its other end takes (an evaluation, a slow worker's chunk)
SERVING_TIMEOUT = timedelta(hours=24)
_ENDED, _JOINED = -1, -2  # what the loop is handed when a worker is gone, and when one is back


_runs = 0  # the param_server runs this process has been part of: its links' names are theirs


def next_run() -> int:
    """A number for this process's next param_server run, the same in every process of it (they
    make their runs in the same order), that keeps its links' names apart from an earlier run's."""
    global _runs
    _runs += 1
    return _runs


def link(store: Any, run: int, server: int, worker: int, incarnation: int, serving: bool) -> Any:
    """The gloo group of one server and one worker's `incarnation` (the server its rank 0) in the
    process's `run`th param_server run; both ends make it, and each waits here for the other."""
    name = f"phalanx/param_server/{run}/link/{server}/{worker}.{incarnation}"
    return dist.ProcessGroupGloo(
        dist.PrefixStore(name, store), 0 if serving else 1, 2, SERVING_TIMEOUT
    )


def send(group: Any, tensor: torch.Tensor, tag: int, serving: bool) -> tuple[Any, torch.Tensor]:
    """Start sending `tensor` to the link's other end: (the work, the tensor, kept until done)."""
    return group.send([tensor], 1 if serving else 0, tag), tensor


def receive(
    group: Any, out: torch.Tensor, tag: int, serving: bool, timeout: timedelta | None = None
) -> torch.Tensor:
    """Receive into `out`; a RuntimeError past `timeout` (the link's own: a day), after which the
    link is closed."""
    with signals.waiting():  # a peer that died never answers: a signal still ends this
        work = group.recv([out], 1 if serving else 0, tag)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    return out


def wait(works: list[tuple[Any, torch.Tensor]]) -> None:
    """Wait for each (work, the tensor it sends: kept alive until then)."""
    with signals.waiting():
        for work, _ in works:
            work.wait()


class Client:
    """A worker's side of its links (`links`, by server rank): the headers it sends, the replies it
    waits for. A reply that waits for every worker's part of some steps comes once they have all
    pushed theirs: it is waited for `timeout_s` at most, as a collective would be, and then raises
    `late(steps, what)`, which names the workers behind."""

    def __init__(
        self,
        links: dict[int, Any],
        timeout_s: float,
        late: Callable[[int, str], BaseException],
    ):
        self.links, self._timeout, self._late = links, timedelta(seconds=timeout_s), late

    def send(self, server: int, header: list[int]) -> tuple[Any, torch.Tensor]:
        message = torch.tensor(header, dtype=torch.int64)
        return send(self.links[server], message, HEADER, serving=False)

    def receive(
        self, server: int, n: int, dtype: torch.dtype, awaits: tuple[int, str] | None = None
    ) -> torch.Tensor:
        """A reply of `n` values from `server`; `awaits`: the steps done it needs, and what it is
        (the servers' parameters, a loss), where it waits for the other workers."""
        out = torch.empty(n, dtype=dtype)
        link = self.links[server]
        if awaits is None:
            return receive(link, out, REPLY, serving=False)
        try:
            return receive(link, out, REPLY, serving=False, timeout=self._timeout)
        except RuntimeError as e:
            if not is_timeout(e):
                raise
            raise self._late(*awaits) from None

    def ask(
        self,
        server: int,
        header: list[int],
        n: int,
        dtype: torch.dtype = torch.int64,
        awaits: tuple[int, str] | None = None,
    ) -> torch.Tensor:
        sent = self.send(server, header)
        reply = self.receive(server, n, dtype, awaits)
        wait([sent])
        return reply


def pack(value: Any) -> torch.Tensor:
    """A state dict as bytes in a tensor, for a link (tensors and plain values only)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


@dataclass
class _Step:
    """What a server has received of one step: the sum of its chunks' gradients, of their loss
    parts, and which of its chunks have come."""

    grads: torch.Tensor
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    received: set[int] = field(default_factory=set)
    chunks: int = 0


@dataclass
class _Message:
    worker: int
    header: list[int]
    grads: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    link: Any = None  # a new link to the worker (_JOINED)


class Server:
    """One server's loop: take the next message any worker sent, act on it, answer; an update is
    applied once every chunk of the next step has come."""

    def __init__(
        self,
        engine: Engine,
        index: int,
        share: list[int],
        workers: int,
        peers: Any,
        version: int,
        steps_per_epoch: int | None,
        relink: Callable[[int, int], Any],
        generation: Callable[[], None],
    ):
        """`index`: this server's among the servers; `share`: its parameters, by their index in
        the optimizer's order; `peers`: the servers' group (None where this is the only one);
        `relink(worker, incarnation)`: a new link to a worker that took a dead one's place (it
        waits for it); `generation()`: tell the workers their group changes (server 0, when a
        worker dies)."""
        optimizer = engine.trained_optimizer
        every = [p for group in optimizer.param_groups for p in group["params"]]
        self.engine, self.index, self.share = engine, index, share
        self.params = [every[i] for i in share]
        self.dtype = dtype_of(every, share)
        self.workers, self.peers, self.version = workers, peers, version
        self.steps_per_epoch = steps_per_epoch
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
        self.links: dict[int, Any] = {}
        self.inbox: queue.Queue[_Message] = queue.Queue()
        self.relink, self.generation = relink, generation
        self.outstanding: dict[int, set[tuple[int, int]]] = {}  # worker -> claimed, not pushed
        self.again: dict[int, list[int]] = {}  # step -> chunks to deal again (server 0)
        self.gone: dict[int, int] = {}  # worker -> how many of its processes died

    def run(self, links: dict[int, Any]) -> None:
        self.links = dict(links)
        for worker, group in links.items():
            self._listen(worker, group)
        while self.done < self.workers:
            with signals.waiting():
                message = self.inbox.get()
            kind, a, b, c, d = message.header
            if kind == CLAIM:
                self._claim(message.worker, a, b, bool(c))
            elif kind == PULL:
                self.pulls.append((message.worker, a, b))
            elif kind == PUSH:
                assert message.grads is not None and message.loss is not None
                self.outstanding.get(message.worker, set()).discard((a, b))
                self._push(a, b, d, message.grads, message.loss)
            elif kind == LOSSES:
                self.asked.append((message.worker, a, b))
            elif kind == STATE:
                self._send_state(message.worker)
            elif kind == WHERE:
                later = [k for k in self.claimed if k >= self.version]
                where = [self.version, max(later, default=-1)]
                self._reply(message.worker, torch.tensor(where, dtype=torch.int64))
            elif kind == DONE:
                self.done += 1
            elif kind == _ENDED:
                self._ended(message.worker)
            elif kind == _JOINED:
                self.links[message.worker] = message.link
                self._listen(message.worker, message.link)
            self._answer()
        self._settle_sends()

    def _listen(self, worker: int, group: Any) -> None:
        threading.Thread(
            target=self._read, args=(worker, group), name=f"link-{worker}", daemon=True
        ).start()

    def _ended(self, worker: int) -> None:
        """A worker's links broke: what it had claimed and not pushed is dealt again (server 0),
        what it waited for is not answered, and a new link waits for the process in its place."""
        del self.links[worker]
        self.pulls = [p for p in self.pulls if p[0] != worker]
        self.asked = [a for a in self.asked if a[0] != worker]
        for step, chunk in sorted(self.outstanding.pop(worker, set())):
            if step >= self.version:
                self.again.setdefault(step, []).append(chunk)
        if self.index == 0:
            self.generation()
        self.gone[worker] = self.gone.get(worker, 0) + 1
        threading.Thread(
            target=self._join, args=(worker, self.gone[worker]), name="join", daemon=True
        ).start()

    def _join(self, worker: int, incarnation: int) -> None:
        group = self.relink(worker, incarnation)
        self.inbox.put(_Message(worker, [_JOINED, 0, 0, 0, 0], link=group))

    def _settle_sends(self) -> None:
        """Wait for the replies still going out; one to a worker that died is lost with it."""
        for work, _ in self.sending:
            try:
                with signals.waiting():
                    work.wait()
            except RuntimeError:
                pass
        self.sending = []

    def _read(self, worker: int, group: Any) -> None:
        """Hand the loop each whole message of one worker's link, until the worker is done."""
        try:
            while True:
                header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
                group.recv([header], 1, HEADER).wait()
                message = _Message(worker, [int(x) for x in header])
                if message.header[0] == PUSH:
                    message.grads = torch.empty(self.numel, dtype=self.dtype)
                    message.loss = torch.empty(3, dtype=torch.float64)
                    group.recv([message.grads], 1, PAYLOAD).wait()
                    group.recv([message.loss], 1, PAYLOAD).wait()
                self.inbox.put(message)
                if message.header[0] == DONE:
                    return
        except RuntimeError:  # the link broke: the worker is gone
            self.inbox.put(_Message(worker, [_ENDED, 0, 0, 0, 0]))

    def _reply(self, worker: int, tensor: torch.Tensor) -> None:
        group = self.links.get(worker)
        if group is None:  # gone: its successor asks again
            return
        try:
            self.sending.append(send(group, tensor, REPLY, serving=True))
        except RuntimeError:  # it died a moment ago: its link's reader says so next
            return
        if len(self.sending) > 64:
            self.sending = [s for s in self.sending if not s[0].is_completed()]

    def _claim(self, worker: int, step: int, chunks: int, stop: bool) -> None:
        if stop and self.stop_at < 0:  # every worker stops after the step after the last claimed
            self.stop_at = max([step, *self.claimed]) + 1
        taken = self.claimed.get(step, 0)
        again = self.again.get(step)
        if step < self.version:  # applied already: it had all of its chunks (a slow worker)
            chunk = -1
        elif again:  # a chunk whose worker died before it pushed it
            chunk = again.pop(0)
        else:
            chunk = taken if taken < chunks else -1
            if chunk >= 0:
                self.claimed[step] = taken + 1
        if chunk >= 0:
            self.outstanding.setdefault(worker, set()).add((step, chunk))
        for old in [k for k in self.claimed if k < self.version]:
            del self.claimed[old]
        for old in [k for k in self.again if k < self.version]:
            del self.again[old]
        self._reply(worker, torch.tensor([chunk, self.stop_at], dtype=torch.int64))

    def _push(
        self, step: int, chunk: int, chunks: int, grads: torch.Tensor, loss: torch.Tensor
    ) -> None:
        if step < self.version:  # applied already: a chunk dealt again, and computed twice
            return
        pending = self.steps.get(step)
        if pending is None:
            pending = self.steps[step] = _Step(torch.zeros(self.numel, dtype=self.dtype))
        if chunk in pending.received:  # the dead worker's share of it came after all
            return
        pending.grads += grads
        pending.loss[:2] += loss[:2]
        pending.loss[2] = loss[2]
        pending.received.add(chunk)
        pending.chunks = chunks
        while self.version in self.steps and self._complete(self.steps[self.version]):
            self._apply(self.steps.pop(self.version))

    @staticmethod
    def _complete(pending: _Step) -> bool:
        return len(pending.received) == pending.chunks

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
        if self.peers is None:
            return norm
        squared = norm.square().reshape(1)
        self.peers.allreduce([squared]).wait()
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
                    self._flat = flatten([p.detach() for p in self.params], self.dtype)
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
        """This server's share of the optimizer's state: its size, then its bytes."""
        state = self.engine.trained_optimizer.state_dict()
        share = set(self.share)
        data = pack(
            {
                "state": {i: s for i, s in state["state"].items() if i in share},
                "param_groups": state["param_groups"],
            }
        )
        self._reply(worker, torch.tensor([data.numel()], dtype=torch.int64))
        self._reply(worker, data)


# --- helpers


def dtype_of(params: list[nn.Parameter], share: list[int]) -> torch.dtype:
    dtype = torch.float32
    for i, k in enumerate(share):
        dtype = params[k].dtype if i == 0 else torch.promote_types(dtype, params[k].dtype)
    return dtype


def numel_of(params: list[nn.Parameter], share: list[int]) -> int:
    return sum(params[i].numel() for i in share)


def gradient(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=dtype) for t in tensors])


def unflatten(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
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
