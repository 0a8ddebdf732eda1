"""The strategy protocol: all the trainer knows of how devices and processes are used.

A strategy answers five questions, and nothing else reaches the trainer:
- topology: which processes and devices there are, and which shards of each global batch this
  process trains on (the *data* rank and world size, which need not be the process's: a process
  driving several towers trains on several shards, a pipeline's stages share one);
- building: where the model is built (its init context) and how it is wrapped, in one fixed order
  (`prepare`), and which parameters the optimizer updates;
- the step: one whole optimizer step (`train_step`), so that the gradients are the global batch's
  and the ranks agree on its loss and stop flag, and the outputs the hooks gather
  (`gather_outputs`);
- state: the model and optimizer state that a checkpoint holds, whole or as shards (`SavesShards`);
- collectives: reduce, gather, broadcast, barrier; shutdown.

The engine keeps the contract's arithmetic (each sample's weight 1/B, B the global batch) as
functions a strategy's step calls (`Engine.forward`, `weigh`, `backward`, `finish`); a strategy
only scales it where its reduction averages instead of adding (`Replica.scale`). Shared members come
from mixins (`Replicated`, `OneProcess`, `DataParallel`). What the run's parts ask of a strategy
beyond that (a feed that it reads itself, random streams of its own, a role other than training)
is `Abilities`: asked of every strategy alike, answered by default as a plain strategy would, so
that no part of the run asks which strategy it has. A new strategy is a module that implements
this protocol and registers itself (`registry.register`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from phalanx.engine import WHOLE, Replica, total_norm

if TYPE_CHECKING:
    from phalanx.data import Micro
    from phalanx.engine import Engine
    from phalanx.precision import Precision
    from phalanx.strategies.syncbn import PerDeviceStatistics

Micros = list[
    tuple["Micro", Mapping | None]
]  # a step's micro-batches: the plan's shard and its batch


@dataclass(frozen=True)
class ModelOptions:
    """How the config asks the model to be prepared (see `prepare`)."""

    precision: Precision
    channels_last: bool = False
    checkpointed: tuple[str, ...] = ()  # module class names whose forward is recomputed in backward
    compile: Any = None  # a CompileConfig, or None
    # the first `n` training samples as one batch, and the model's adapter from a batch to its
    # outputs: for a strategy that runs the model once to see where it splits
    sample: Callable[[int], Mapping] | None = None
    adapter: Callable[[nn.Module], Callable[[Mapping], dict]] | None = None


class Abilities(Protocol):
    """What the run's parts ask of a strategy beyond training and evaluating, each asked of every
    strategy alike; these answers are a strategy's that does nothing special, and a strategy that
    does overrides them. Every strategy inherits them (through `OneProcess` or `ProcessGroup`)."""

    world_size: int

    # a parameter server's servers serve the processes that train instead of training
    serving: bool = False
    # whether this process's gradients are its own to look at after the first step (a parameter
    # server's workers send theirs away as they are made)
    local_gradients: bool = True

    @property
    def rejoining(self) -> bool:
        """Whether this process takes the place of a worker that died while the others went on:
        it starts where the servers are (`joined_at`), not from a checkpoint."""
        return False

    @property
    def random_processes(self) -> int:
        """The processes whose random streams a checkpoint holds: those that train."""
        return self.world_size

    def feed(self, feed: Any) -> None:
        """See the run's `Feed` before its first step; a strategy that reads the training samples
        itself calls `feed.deal`."""
        return None

    def working(self) -> contextlib.AbstractContextManager:
        """Around a training process's run (a parameter server's worker: collectives among the
        workers alone, the servers told at the end)."""
        return contextlib.nullcontext()

    def serve(self, engine: Engine, steps_per_epoch: int | None) -> None:
        """Serve the processes that train, where `serving` (`engine`: this process's model,
        optimizer and schedulers, which it steps for them)."""
        raise RuntimeError(f"{type(self).__name__} has no process that serves")

    def joined_at(self) -> tuple[int, bool]:
        """Where `rejoining`: the steps applied, and whether the epoch they complete has still to
        end."""
        raise RuntimeError(f"{type(self).__name__} has no process that rejoins")

    def abandon(self) -> None:
        """After a run in this process failed: release what no other process waits on. Nothing,
        where the strategy made nothing of the kind."""
        return None

    def meet(self, what: str, step: int) -> None:
        """Every rank at its next `what` (a checkpoint's save) at the same step, before that makes
        any collective: a rank that does not come fails the job, saying so, after the timeout.
        Nothing to meet in one process."""
        return None

    def end_epoch(self) -> None:
        """At each epoch's end, on every training process (a parameter server logs how the epoch's
        work was shared)."""
        return None

    def agree_when(self, due: Callable[[], bool] | None, drop: bool = False) -> None:
        """In the training loop (None: out of it), `due()` says, the same on every process, whether
        the loss of the step about to run is read (by a hook, an evaluation round, the epoch's
        end). A strategy that agrees on the loss behind its steps (the pipeline) may gather the
        agreements of the steps between such reads into one message; the others agree every step
        and do not ask. With None, what is gathered goes at once (every process calls it at the
        same step), or is dropped where `drop` (a failed run's: no other process may come)."""
        return None

    def meanwhile(self, read_ahead: Callable[[], None] | None) -> None:
        """In the training loop (None: out of it), `read_ahead()` reads the next step's batch. A
        strategy whose step waits on a reduction with nothing else to do (ddp on CPUs) calls it
        while it waits, at most once a step; the others never do."""
        return None

    def seed_streams(self, seed: int, step: int) -> None:
        """A strategy whose one process runs several devices' shares of a batch (towers) gives each
        other device a random stream of its own, from the seed, the step and its index, as
        `derived_seed` gives ddp's ranks theirs. The process's own generators are the first
        device's."""
        return None

    def stream_states(self) -> list[str] | None:
        """Those other devices' streams as a checkpoint holds them (JSON); None: there are none."""
        return None

    def load_stream_states(self, states: list[str] | None, seed: int, step: int) -> None:
        """Continue the streams a checkpoint held; where it holds none, or another device count's,
        seed them from the seed and the step."""
        return None

    def differing_ranks(self, module: nn.Module) -> list[int]:
        """The ranks whose copy of a model given as an object differs from rank 0's."""
        return []

    def backward_communication(self) -> tuple[float, float] | None:
        """The gradient all-reduce inside backward, as last sampled: seconds per step it took, and
        seconds of it that overlapped computation. None where there is no sample, or none runs
        inside backward."""
        return None

    def describe(self) -> tuple[str, str]:
        """For the run's first line: what each share of a micro-batch goes to ("device"), and how
        the strategy lays the run out ("" where the rest of the line says it all)."""
        return "device", ""

    def model_summary(self) -> str | None:
        """Where each process keeps part of the model: the whole model's summary, for the run's
        first lines; None: this process's model is the whole."""
        return None

    def whole_model(self) -> nn.Module | None:
        """Where each process keeps only part of the model's modules and runs only that part (a
        pipeline's stages): the whole model as it was before the split, on the meta device, for
        what measures the whole (its FLOPs a step). None: this process's model is the whole."""
        return None


class Strategy(Abilities, Protocol):
    """How one module is trained on this process's devices: a strategy serves the one module it set
    up."""

    # --- topology
    rank: int  # this process among all
    world_size: int  # processes
    data_rank: int  # the first shard of each micro-batch that this process trains on
    data_world_size: int  # shards of each micro-batch, over all processes
    device: torch.device  # where batches and the model's outputs live: devices[0]
    # True where every rank must run the model on every micro-batch (its collectives are inside the
    # model's forward and backward): an empty shard then arrives as a batch of zero samples, not
    # None
    runs_empty_shards: bool

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices this process drives (read-only: a strategy of one device may say so in its
        type)."""

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs, progress and checkpoints."""

    def watch(self, where: Callable[[], tuple[int, bool]]) -> None:
        """`where()` returns the run's steps done and whether it is training: with several
        processes, a collective's timeout then names the ranks that did not arrive and their
        step."""

    # --- building
    def init_context(self) -> contextlib.AbstractContextManager:
        """Where the model is built (a meta device where the strategy shards it)."""

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        """The module to call (wrapped, compiled) and the user's module inside it, whose parameters
        the optimizer updates and whose state checkpoints hold; every rank starts from the same
        state."""

    # --- the step
    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        """One optimizer step over a global batch, whole: the micro-batches' forward and backward
        through the engine's `begin`, `forward` (or `weigh`) and `backward`, so that the gradients
        are the global batch's, the ranks' agreement on the loss and the stop flag (`stop`: this
        rank's wish), and the engine's `finish` with this strategy's gradient norm."""

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        """The outputs of the model on an evaluation batch (this process's shard of it)."""

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        """A step's or evaluation batch's outputs on every process, in dataset order: each
        process's `parts` (one per micro-batch, None where it had no sample), only `keys` (None:
        all) of them."""

    # --- state (every rank calls these at the same point: a sharded strategy gathers or scatters)
    def model_state(self) -> nn.Module | dict[str, torch.Tensor]:
        """The model's whole state as a checkpoint holds it, on the main process: a module whose
        state is saved, or a state dict of CPU tensors (other processes may return an empty one)."""

    def load_model_state(self, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load a checkpoint's weights into the model: a safetensors file of the whole model, or a
        shards folder (`checkpoint.SHARDS`, saved on any process count), which also holds the
        optimizer's state: loaded into `optimizer` where it is given."""

    def load_state(self, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """A whole model's state dict (every name, as `weights.whole_state` reads a file) into
        the model, each process keeping its part (its replica, shards or stages): the names the
        state lacks and the names the model lacks, left as they were. A value of another shape
        raises (RuntimeError, ValueError or KeyError)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's whole state as a checkpoint holds it (parameters by index, in the order
        of the model's trainable parameters), on the main process."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Give the optimizer the state a checkpoint held."""

    # --- collectives
    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The tensor reduced over ranks (op: sum, min or max); every rank gets the result."""

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value (any picklable object), in rank order, on every rank."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value (any picklable object), on every rank."""

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def shutdown(self) -> None:
        """Release process groups and devices."""


@dataclass
class Outcome:
    """What a training step gives the trainer."""

    loss: torch.Tensor  # the global batch's mean loss (weighted where the model weighs), every rank
    # this rank's inputs and outputs, one per micro-batch (None: empty)
    parts: Sequence[dict | None]
    stop: bool  # whether any rank asked to stop (by this step, or by the one before: see `settle`)
    communication_s: float = 0.0  # seconds spent communicating outside backward
    optimizer_s: float = 0.0  # seconds of the engine's `finish`
    # Where set, the ranks' agreement on the loss runs behind the step: `loss` holds its value
    # only once `settle()` has returned (the trainer calls it when the loss is read, or some steps
    # later at the latest), and `stop` may be agreed a step late (every rank alike).
    settle: Callable[[], object] | None = None
    # False while the step's agreement waits, gathered with the next steps', to be sent (see
    # `Abilities.agree_when`): `settle` would send it, a collective, so that a read of the loss
    # that not every process makes at this step must not come before a step that is agreed
    agreed: bool = True


# what `DataParallel._agree` gives: the global loss, whether any rank asked to stop, the seconds
# spent communicating, and the loss's `Outcome.settle` (None: there already)
Agreed = tuple[torch.Tensor, bool, float, Callable[[], object] | None]


@runtime_checkable
class SavesShards(Protocol):
    """A strategy whose checkpoints hold the model and optimizer as each process's shards, written
    by every process at once, instead of a whole copy gathered to one."""

    def save_shards(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """Write the model's and optimizer's shards into `folder` (torch.distributed.checkpoint's
        layout); every rank calls it."""


class Replicated:
    """Shared members of strategies that keep a whole copy of the model and optimizer in each
    process."""

    runs_empty_shards = False
    model: nn.Module
    device: torch.device
    # parallel.build=device: the model is built on `device` itself, not on the host
    build_on_device = False

    def init_context(self) -> contextlib.AbstractContextManager:
        return torch.device(self.device) if self.build_on_device else contextlib.nullcontext()

    def model_state(self) -> nn.Module:
        return self.model

    def load_model_state(self, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        from phalanx.shards import load_shards
        from phalanx.weights import SHARDS, load_weights

        # the whole state, read by each process on its own
        if path.name == SHARDS:
            load_shards(path, self.model, optimizer)
        else:
            load_weights(self.model, path)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        result = self.model.load_state_dict(state, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        return engine.eval_forward(batch)

    def watch(self, where: Callable[[], tuple[int, bool]]) -> None:
        pass


class DataParallel:
    """The step of strategies whose every copy of the model takes a shard of each micro-batch: the
    micro-batches run in order, each one's forward and backward, and the gradients add up. A
    strategy customises it where it must:
    - `_micro(engine, micro, batch, total, stop, final)`: a micro-batch's forward and backward (on
      several devices at once, say, or without gradient synchronisation but for the last,
      `final`); `total` is the step's part of the loss so far (None before the first), returned
      with this micro-batch's added, beside its outputs;
    - `_in_backward(total, stop)`: after the last forward, before its backward: the step's loss
      part and this rank's stop flag given to a reduction that runs during backward (what it
      returns must reach that reduction through backward);
    - `_agree(total, stop)`: after the last backward: the global loss, whether any rank asked to
      stop, the seconds spent communicating, and where the loss is agreed behind the step, what
      waits for it (`Outcome.settle`)."""

    replica: Replica = WHOLE  # how the engine runs this process's copy
    # where BatchNorm's statistics are the devices' own: warned of at the first step (setup)
    _statistics: PerDeviceStatistics | None = None

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        if self._statistics is not None:
            self._statistics.warn_once()
        engine.begin()
        last = len(micros) - 1
        parts: list[dict | None] = []
        total: torch.Tensor | None = None
        for i, (micro, batch) in enumerate(micros):
            if batch is None:
                parts.append(None)
                continue
            total, data = self._micro(engine, micro, batch, total, stop, i == last)
            parts.append(data if micro.shard else None)
        loss, stop, communication, settle = self._agree(total, stop)
        start = time.perf_counter()
        loss = engine.finish(loss, self.gradient_norm)
        return Outcome(loss, parts, stop, communication, time.perf_counter() - start, settle)

    def _micro(
        self,
        engine: Engine,
        micro: Micro,
        batch: Mapping,
        total: torch.Tensor | None,
        stop: bool,
        final: bool,
    ) -> tuple[torch.Tensor, dict]:
        loss, gradient, part, data = engine.forward(micro, batch, self.replica)
        total = part if total is None else total + part
        engine.backward(loss, gradient, self._in_backward(total, stop) if final else None)
        return total, data

    def _in_backward(self, total: torch.Tensor, stop: bool) -> torch.Tensor | None:
        return None

    def _agree(self, total: torch.Tensor | None, stop: bool) -> Agreed:
        assert total is not None  # one process: a step has one micro-batch or more
        return total, stop, 0.0, None

    def gradient_norm(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm of this process's gradients: whole copies hold them all."""
        return total_norm(gradients)


class OneProcess(Abilities):
    """Shared members of strategies that run in one process: there is no other to talk to."""

    runs_empty_shards = False
    rank = data_rank = 0
    world_size = data_world_size = 1

    @property
    def is_main(self) -> bool:
        return True

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value

    def barrier(self) -> None:
        pass

    def gather_outputs(self, parts: list[dict | None], keys: set[str] | None) -> dict:
        from phalanx.engine import concat

        return concat(parts)


def prepare(
    module: nn.Module, options: ModelOptions, place: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """The one order in which every strategy prepares the user's module (`place` is the strategy's
    part: moving it to its devices, wrapping or sharding it):

    1. precision: parameters in float64 under fp64 (bf16 and fp16 are autocast, no cast);
    2. channels-last memory format for 4-D weights (convolutions on GPUs);
    3. activation checkpointing of the configured module classes, before any wrapper, so that
       recomputation runs inside the wrapper's own hooks;
    4. the strategy's placement and wrapper;
    5. torch.compile last, over the wrapped module (DDP's graph is then split at its buckets).
    """
    module = options.precision.convert_module(module)
    if options.channels_last:
        module = module.to(  # type: ignore[call-overload]  # torch's stub lacks memory_format
            memory_format=torch.channels_last
        )
    if options.checkpointed:
        checkpoint_modules(module, options.checkpointed)
    module = place(module)
    if options.compile is not None:
        module = compile_module(module, options.compile)
    return module


def compile_module(module: nn.Module, compiled: Any) -> nn.Module:
    """`module` through torch.compile as `compiled` (the config's `compile`) says. torch checks
    the backend's and the mode's names here, and compiles at the first call: a name it does not know
    is the config's error."""
    from phalanx import random

    random.for_compiling()
    try:
        out = torch.compile(module, backend=compiled.backend, mode=compiled.mode)
    except RuntimeError as e:  # torch's own: an unknown backend (a RuntimeError too) or mode
        from phalanx.errors import ConfigError

        said = str(e).rstrip(".")
        raise ConfigError(
            f"compile (backend {compiled.backend!r}, mode {compiled.mode!r}): {said}; correct "
            "compile.backend or compile.mode, or set compile: false"
        ) from None
    # its stub says a callable; a module compiled is a module (an OptimizedModule)
    if not isinstance(out, nn.Module):
        raise TypeError(f"torch.compile returned a {type(out).__name__}, not a module")
    return out


def checkpoint_modules(module: nn.Module, class_names: tuple[str, ...]) -> int:
    """Recompute the forward of every submodule of the named classes during backward instead of
    keeping its activations. The module tree and its state's names are unchanged: each one's
    forward is replaced on the instance. Returns how many were found."""
    from phalanx.errors import ConfigError

    found = 0
    for sub in module.modules():
        if type(sub).__name__ in class_names:
            sub.forward = functools.partial(_recomputed, sub.forward)
            found += 1
    if not found:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ConfigError(
            f"activation_checkpointing names {list(class_names)}, but the model has no module of "
            f"those classes; it has {', '.join(present)}"
        )
    return found


def _recomputed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from phalanx import random

    if not torch.is_grad_enabled():  # evaluation: nothing to recompute
        return forward(*args, **kwargs)
    # the recomputation makes the very dropout masks the forward made; compiled, it keeps them
    context: Callable = random.recomputing
    if torch.compiler.is_compiling():
        context = functools.partial(create_selective_checkpoint_contexts, random.recompute_policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
