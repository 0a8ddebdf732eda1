"""The workers of a `param_server` run among themselves. Once the run has started, the servers
serve and take no part in the collectives the trainer asks of its strategy (a sum, a gather, a
broadcast, a barrier): the workers run those over a gloo group of their own, made from the job's
store by name. Where a worker died and another took its place, the group is made again (each
worker waiting for every other), numbered by a generation the store keeps."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.strategies.distributed import _OPS


def named_group(
    store: dist.Store, run: int, name: str, rank: int, size: int, timeout_s: float
) -> Any:
    """A gloo group of `size` processes of run `run`, met under `name` in the job's store."""
    named = dist.PrefixStore(f"phalanx/param_server/{run}/{name}", store)
    return dist.ProcessGroupGloo(named, rank, size, timedelta(seconds=timeout_s))


class Crew:
    """The workers' group and its collectives. `enter` names each collective as it starts (the
    strategy's progress, so that one that times out names the ranks that did not arrive)."""

    def __init__(
        self,
        store: dist.Store,
        run: int,
        rank: int,
        size: int,
        timeout_s: float,
        enter: Callable[[str], None],
    ):
        self._store, self._run, self.rank, self.size = store, run, rank, size
        self._timeout_s, self._enter = timeout_s, enter
        self._key = f"phalanx/param_server/{run}/generation"
        self._group: Any = None  # of generation `_generation`
        self._generation = -1

    def group(self) -> Any:
        """The group of this generation: made again, each worker waiting for every other, where a
        worker has died since (its successor among them)."""
        generation = int(self._store.add(self._key, 0))
        if generation != self._generation:
            name = f"crew/{generation}"
            self._group = named_group(
                self._store, self._run, name, self.rank, self.size, self._timeout_s
            )
            self._generation = generation
        return self._group

    def new_generation(self) -> None:
        """A worker took a dead one's place: the next collective meets in a new group."""
        self._store.add(self._key, 1)

    @property
    def rejoined(self) -> bool:
        """Whether a worker has taken a dead one's place in this run."""
        return int(self._store.add(self._key, 0)) > 0

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().cpu().clone()
        self._enter("an all-reduce")
        options = dist.AllreduceOptions()
        options.reduceOp = _OPS[op]  # type: ignore[assignment]  # the stub: a RedOpType is one
        self.group().allreduce([out], options).wait()
        return out.to(tensor.device)

    def gather(self, value: Any) -> list[Any]:
        self._enter("a gather")
        every = self._gather_bytes(pickle.dumps(value))
        # bytes this run's own workers pickled, over loopback links (as all_gather_object)
        return [pickle.loads(data) for data in every]  # safe: the workers' own pickles

    def broadcast(self, value: Any, main: bool) -> Any:
        """The value of the worker for which `main` is true."""
        self._enter("a broadcast")
        first = self._gather_bytes(pickle.dumps(value) if main else b"")[0]
        return pickle.loads(first)  # safe: the main worker's own pickle, as broadcast_object_list

    def barrier(self) -> None:
        self._enter("a barrier")
        self.group().barrier().wait()

    def close(self) -> None:
        self._group = None

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        """Every worker's `data`, in rank order."""
        group = self.group()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        group.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(n) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        group.allgather([every], [mine]).wait()
        return [e[: int(n)].numpy().tobytes() for e, n in zip(every, sizes, strict=True)]
