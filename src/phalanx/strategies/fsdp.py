"""`fsdp`: one process per device, the model's parameters, gradients and optimizer state sharded
over them with FSDP2 (`torch.distributed.fsdp.fully_shard`).

The contract's arithmetic is kept by making FSDP add instead of average: every sharded module's
gradient divide factor is 1 and its reductions are plain sums, so each rank's objective (its
samples' losses, each weighted 1/B of the global batch) adds up to the global batch's. Every rank
runs every micro-batch, since the all-gathers and reduce-scatters live inside forward and backward:
an empty shard arrives as a batch of zero samples and contributes zero gradient. Gradients are
reduced only after the last micro-batch of a step. The ranks agree on the step's loss and stop
flag with one small all-reduce.

Checkpoints hold the model and optimizer as each rank's shards (torch.distributed.checkpoint),
written by every rank at once into the step's folder; any strategy on any process count reads them,
so a run saved with fsdp resumes with ddp, single or another process count. The whole state can
also be gathered to the main process (`model_state`, `optimizer_state`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from phalanx import keras_models
from phalanx.costs import (
    ONE_DEVICE,
    Measured,
    Prediction,
    Setup,
    link_of,
    made,
    mb_text,
    ms,
    whole_bytes,
)
from phalanx.errors import ConfigError
from phalanx.settings import StrategySettings
from phalanx.strategies import refuse_outside_workers, sharded_state
from phalanx.strategies.base import Agreed, DataParallel, ModelOptions, prepare
from phalanx.strategies.ddp import INSTEAD
from phalanx.strategies.distributed import (
    Behind,
    LastAgreement,
    ProcessGroup,
    agreed,
    agreement,
)
from phalanx.strategies.pricing import compute_of
from phalanx.strategies.registry import PRECISION, Family, refuse, register
from phalanx.strategies.syncbn import WITH_DDP, PerDeviceStatistics

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from phalanx.config import Config
    from phalanx.data import Micro
    from phalanx.engine import Engine

_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def _dtype(name: str | None) -> torch.dtype | None:
    """The dtype a precision's name stands for; None (no name): the parameters' own."""
    return None if name is None else _DTYPES[name]


def shard_policies(options: FSDPSettings, device: torch.device) -> dict[str, Any]:
    """`fully_shard`'s policies from `parallel.fsdp`: the dtypes its parameters are gathered in and
    its gradients reduced in, and whether the shards live in CPU memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=_dtype(options.param_dtype), reduce_dtype=_dtype(options.reduce_dtype)
        ),
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=device.type == "cuda")
            if options.offload
            else OffloadPolicy()
        ),
    }


class FSDP(ProcessGroup, DataParallel):
    runs_empty_shards = True
    config_name = "fsdp"  # parallel.strategy's, as errors name it

    def __init__(
        self,
        accelerator: str,
        options: FSDPSettings,
        timeout_s: float | None = None,
        backend: str = "auto",
    ):
        super().__init__(accelerator, timeout_s, backend)
        self.options = options
        self._model: nn.Module | None = None
        self._whole: nn.Module | None = None  # the model before sharding, on the meta device
        # the last step's agreement on its loss and stop flag, while it runs behind the step
        self._behind = LastAgreement()

    @property
    def model(self) -> nn.Module:
        """The model `setup` was given (sharded in place by `fully_shard`)."""
        if self._model is None:
            raise RuntimeError("fsdp: the model is used before the strategy's setup")
        return self._model

    @property
    def _sharded(self) -> FSDPModule:
        """The model, as the FSDP module that `fully_shard` made it."""
        from torch.distributed.fsdp import FSDPModule

        model = self.model
        if not isinstance(model, FSDPModule):
            raise RuntimeError("fsdp: the model is used before it is sharded")
        return model

    def init_context(self) -> contextlib.AbstractContextManager:
        """Where the model is built: whole on every rank (`init: full`), or on the meta device, with
        no memory (`init: meta`); see `setup`."""
        return torch.device("meta") if self.options.init == "meta" else contextlib.nullcontext()

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        """Every rank builds the model from the same seed, so its values are one process's, and
        keeps its shard of each parameter. Built whole, it is sharded after; built on the meta
        device, it is sharded first and each module's values are then drawn whole, one module at a
        time, in the dtype the model was built in and in module order (as one process draws them),
        and cut to this rank's shards."""
        keras_models.refuse(
            module,
            self.config_name,
            "it swaps the module's parameters for shards, and Keras's layers read their own "
            "variables, which would never train",
        )
        self._model = module
        self._statistics = PerDeviceStatistics(module, self.world_size, self.is_main, WITH_DDP)
        if self.options.init == "meta":
            _check_resettable(module)
            self._built = {
                name: t.dtype for name, t in _tensors(module)
            }  # before the precision's cast
        return prepare(module, options, self._shard), self.model

    def _shard(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        meta = self.options.init == "meta"
        if not meta:
            module = module.to(self.device)
        self.keep_whole(module)
        self.progress.enter("the sharding of the model")
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policies = shard_policies(self.options, self.device)
        units = find_shard_units(module, self.options.shard)
        for unit in units:  # innermost first: a unit's parameters are those no inner unit took
            fully_shard(unit, mesh=mesh, **policies)
        fully_shard(module, mesh=mesh, **policies)
        if meta:
            module.to_empty(device="cpu" if self.options.offload else self.device)
            self._initialise(module)
        for name, sharded in module.named_modules():
            # sums, not averages: the objective carries 1/B already
            if isinstance(sharded, FSDPModule):
                sharded.set_gradient_divide_factor(1.0)
                sharded.set_force_sum_reduction_for_comms(True)
                self._count_unit(module.get_submodule(name), name)
        # FSDP warns when a module returns a view (`x.squeeze(-1)`), since an in-place op on it
        # would skip its backward hook; phalanx changes no output in place (it detaches them for the
        # hooks)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        return module

    def keep_whole(self, module: nn.Module) -> None:
        """The model's structure and shapes before anything splits it (a meta copy, no values):
        what counting its FLOPs needs, which a sharded module cannot be copied for."""
        from phalanx import metrics

        self._whole = metrics.on_meta(module)

    def whole_model(self) -> nn.Module | None:
        return self._whole

    def _count_unit(self, unit: nn.Module, name: str) -> None:
        """Each unit's all-gather before its forward, counted as a collective entered (before
        FSDP's own hook, which gathers): a rank that hangs between two units' gathers is then
        behind the others, and named when their wait times out."""
        what = f"the all-gather of {name or 'the model'}'s parameters"
        unit.register_forward_pre_hook(lambda *_: self.progress.enter(what), prepend=True)

    def _initialise(self, module: nn.Module) -> None:
        """Each module's parameters and buffers drawn by its reset_parameters() on whole CPU tensors
        of the dtype it was built in, then cast and cut to this rank's shards: no rank holds more
        than one module whole, and every rank draws the same values (so no values are sent)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for prefix, sub in module.named_modules():
            tables = {"parameters": sub._parameters, "buffers": sub._buffers}
            live = {
                (kind, name): table[name]
                for kind, table in tables.items()
                for name in table
                if table[name] is not None
            }
            if not live:
                continue
            for (kind, name), t in live.items():  # whole stand-ins, as the model was built
                whole = torch.empty(
                    t.shape, dtype=self._built.get(f"{prefix}.{name}" if prefix else name, t.dtype)
                )
                tables[kind][name] = (
                    nn.Parameter(whole, t.requires_grad) if kind == "parameters" else whole
                )
            try:
                with torch.no_grad():
                    sub.reset_parameters()
                drawn = {key: tables[key[0]][key[1]].detach() for key in live}
            finally:
                for (kind, name), t in live.items():
                    tables[kind][name] = t
            with torch.no_grad():
                for key, t in live.items():
                    whole = drawn[key].to(t.dtype)
                    if isinstance(t, DTensor):
                        shard = distribute_tensor(
                            whole, t.device_mesh, t.placements, src_data_rank=None
                        ).to_local()
                        t.to_local().copy_(shard)
                    else:
                        t.copy_(whole)

    def _sync_gradients(self, final: bool) -> None:
        """Whether this micro-batch's backward reduces the gradients: the last one's alone."""
        self._sharded.set_requires_gradient_sync(final)

    def _micro(
        self,
        engine: Engine,
        micro: Micro,
        batch: Mapping,
        total: torch.Tensor | None,
        stop: bool,
        final: bool,
    ) -> tuple[torch.Tensor, dict]:
        # an empty shard comes as a batch of zero samples; reduce once, after the last micro-batch
        self._sync_gradients(final)
        with explain_calls_past_units():
            loss, gradient, part, data = engine.forward(micro, batch, self.replica)
        total = part if total is None else total + part
        if final:
            self._in_backward(total, stop)
        engine.backward(loss, gradient)
        return total, data

    def _in_backward(self, total: torch.Tensor, stop: bool) -> None:
        """The loss and stop flag are known: agreed on while backward runs."""
        self._pending = self._agree_started(total, stop)
        self.progress.enter("the gradient reduce-scatter")

    def _agree(self, total: torch.Tensor | None, stop: bool) -> Agreed:
        """A weighted loss's agreement is waited for: the optimizer's step divides by the weights'
        global sum. A plain loss's runs on behind the step (nothing in the step needs it): the
        trainer waits for it when the loss is read, and the next step for its stop flag. So no
        process waits after backward for the slowest one's agreement, and the stop flag is a
        step late, on every process alike (ddp's on a GPU is too)."""
        values, work = self._pending
        assert total is not None  # every process runs each micro-batch, with no sample too
        if total.dim():
            stopped = self._behind.swap(None)
            work.wait()
            loss, stop = agreed(values)
            return loss, stop or stopped, 0.0, None
        # the step before's agreement gives the stop flag, on every process at the same step
        behind = Behind(values, work)
        return values[0], self._behind.swap(behind), 0.0, behind.settled

    def _agree_started(self, loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, dist.Work]:
        """`agree`'s all-reduce, started and not waited for: the tensor that holds its result once
        waited."""
        values = agreement(loss, stop)
        self.progress.enter("the agreement on the step's loss")
        return values, dist.all_reduce(values, async_op=True)

    def evaluate(self, engine: Engine, batch: Mapping) -> dict:
        # on every rank, zero samples too: its all-gathers need all
        with explain_calls_past_units():
            return engine.eval_forward(batch)

    # --- state: shards, or whole, gathered to the main process -----------------------------

    def model_state(self) -> dict[str, torch.Tensor]:
        self.progress.enter("the gathering of the model's state")
        return sharded_state.model_state(self.model, self.is_main)

    def load_model_state(self, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        from phalanx.checkpoint import SHARDS

        if path.name == SHARDS:  # each rank reads the parts of the files its shards need
            self.progress.enter("the loading of the checkpoint's shards")
        sharded_state.load_model_state(self.model, path, optimizer)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Every rank keeps its shards of the whole state."""
        return sharded_state.load_state(self.model, state)

    def save_shards(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        from phalanx.shards import save_shards

        self.progress.enter("the saving of the checkpoint's shards")
        save_shards(folder, self.model, optimizer)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        self.progress.enter("the gathering of the optimizer's state")
        return sharded_state.optimizer_state(self.model, optimizer, self.is_main)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        sharded_state.load_optimizer_state(self.model, optimizer, state)


# Containers never called themselves, while FSDP gathers a unit's parameters when its forward runs
_UNCALLED = (nn.ModuleList, nn.ModuleDict)


def find_shard_units(module: nn.Module, classes: list[str] | None) -> list[nn.Module]:
    """The submodules sharded as units of their own, innermost first: those of the named classes, or
    by default the model's parts (see `_default_units`)."""
    if classes is None:
        return _default_units(module)
    containers = sorted({c.__name__ for c in _UNCALLED} & set(classes))
    if containers:
        raise ConfigError(
            f"parallel.fsdp.shard names {', '.join(containers)}: a container that is never called "
            "itself cannot be a unit (FSDP gathers a unit's parameters when the unit is called); "
            "name the class of the blocks it holds instead, such as [Block]"
        )
    units = [m for m in module.modules() if type(m).__name__ in classes and m is not module]
    if not units and classes:  # [] asks for the model as one unit
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ConfigError(
            f"parallel.fsdp.shard names {classes}, but the model has no module of those classes; "
            f"it has {', '.join(present)}"
        )
    names = {id(m): name for name, m in module.named_modules()}
    seen: dict[int, nn.Module] = {}
    for unit in units:
        for p in unit.parameters():
            other = seen.setdefault(id(p), unit)
            if (
                other is not unit
                and not any(m is other for m in unit.modules())
                and not any(m is unit for m in other.modules())
            ):
                raise ConfigError(
                    f"parallel.fsdp.shard: {names[id(unit)]!r} and {names[id(other)]!r} share a "
                    "parameter (tied weights), and FSDP shards each unit's parameters apart; "
                    "leave one of their classes out of parallel.fsdp.shard"
                )
    return units[::-1]


def _default_units(module: nn.Module) -> list[nn.Module]:
    """The model's parts, as torchtitan shards a transformer: each block of a container of blocks
    (ModuleList, ModuleDict, Sequential) is a unit, wherever the container is (a wrapper that holds
    one, such as a Hugging Face model's `transformer` or `encoder`, is looked into), and so is each
    other part that holds parameters (an embedding, a norm, a head). A part whose parameters a
    module outside it also holds (tied weights, such as a language model's embedding and head) is
    not a unit: its own untied parts are, and the root, sharded last, gathers what no unit
    took."""
    holders: dict[int, list[nn.Module]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            holders.setdefault(id(p), []).append(sub)

    def alone(part: nn.Module) -> bool:
        inside = {id(m) for m in part.modules()}
        return all(id(m) in inside for p in part.parameters() for m in holders[id(p)])

    def parts(parent: nn.Module) -> list[nn.Module]:
        found: list[nn.Module] = []
        for child in parent.children():
            if not any(True for _ in child.parameters()):
                continue
            holds_blocks = any(isinstance(m, _UNCALLED) for m in child.modules())
            if isinstance(child, nn.Sequential) or holds_blocks or not alone(child):
                found += parts(child)
            else:
                found.append(child)
        return found

    unique = {id(part): part for part in parts(module)}  # a block held twice is one unit
    return list(unique.values())


@contextlib.contextmanager
def explain_calls_past_units() -> Iterator[None]:
    """A forward that reaches a unit's parameters without calling the unit (a model that calls a
    block's parts directly, past the block's own forward) finds them still sharded: torch's error
    about mixed tensors, turned into one line that says which setting to change."""
    try:
        yield
    except RuntimeError as e:
        if "mixed torch.Tensor and DTensor" not in str(e):
            raise
        raise ConfigError(
            "parallel.fsdp.shard: the model uses parameters of a sharded unit without calling the "
            "unit (FSDP gathers a unit's parameters when its forward is called); set "
            "parallel.fsdp.shard to the classes of the modules the model calls whole, such as "
            "[Block], or to [] to shard the model as one unit"
        ) from None


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _check_resettable(module: nn.Module) -> None:
    """A meta build needs each module that holds parameters or buffers to draw them again."""
    for name, sub in module.named_modules():
        holds = any(True for _ in sub.parameters(recurse=False)) or any(
            True for _ in sub.buffers(recurse=False)
        )
        if holds and not callable(getattr(sub, "reset_parameters", None)):
            where = f"{type(sub).__name__} at {name!r}" if name else type(sub).__name__
            raise ConfigError(
                f"parallel.fsdp.init: meta draws each module's values with its reset_parameters(), "
                f"which {where} does not define; define it, or use parallel.fsdp.init: full"
            )


# --- the strategy as the config names it ---------------------------------------------------


class FSDPSettings(StrategySettings):
    """`parallel.fsdp`: settings of the `fsdp` strategy."""

    shard: list[str] | None = Field(
        None,
        description="module class names sharded as units of their own; default each block of a "
        "ModuleList or Sequential and each other part of the model holding parameters, then the "
        "model itself; [] the model as one unit",
    )
    param_dtype: Literal["fp32", "bf16", "fp16", "fp64"] | None = Field(
        None,
        description="the dtype parameters are gathered in for forward and backward; default "
        "their own",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16", "fp64"] | None = Field(
        None, description="the dtype gradients are reduced in; default param_dtype's"
    )
    offload: bool = Field(
        False, description="keep parameters and optimizer state in CPU memory between uses"
    )
    init: Literal["full", "meta"] = Field(
        "full",
        description="full: every rank builds the whole model, then keeps its shards; meta: the "
        "model is built without memory and each module's reset_parameters() fills its shards "
        "one module at a time, so the whole model is never in one process's memory",
    )


def build(cfg: Config, accelerator: str, devices: int) -> FSDP:
    """Several processes (phalanx starts one per device), or this one alone on one device (a group
    of one: offload then trains a model larger than the device's memory)."""
    refuse_outside_workers("fsdp", devices)
    check(cfg, accelerator, devices)
    return FSDP(
        accelerator,
        cfg.parallel.section("fsdp", FSDPSettings),
        cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
    )


def check(cfg: Config, accelerator: str, processes: int) -> None:
    refuse(
        "fsdp",
        {
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            PRECISION: cfg.precision == "fp16",
        },
        INSTEAD,
    )


def units(m: Measured) -> int:
    """The units fsdp shards the model into: each block of the chain that holds parameters, and
    the rest of the model."""
    return 1 + sum(1 for b in m.blocks if b.param_bytes)


def price(m: Measured, setup: Setup) -> Prediction:
    n = setup.devices
    micro = math.ceil(m.batch / (m.accumulation * n))
    one = compute_of(m, setup).time(micro) * m.crowding
    compute = m.accumulation * one
    # each unit (a block of the chain, and the rest of the model) gathers its parameters for
    # each micro-batch's forward and again for its backward, and reduce-scatters its gradients
    # once a step: each collective moves what half an all-reduce of its bytes moves, and pays
    # its latency
    link = link_of(m, n)
    count = units(m)
    gathers = 2 * m.accumulation * count * link.time(m.param_bytes / (2 * count))
    scatter = count * link.time(m.grad_bytes / (2 * count))
    reduce = gathers + scatter
    hidden = min(reduce, m.overlap * m.compute.backward_share * compute)
    reduce += m.accumulation * count * m.fsdp_unit_s  # its own work around each collective
    exposed = reduce - hidden
    largest = max((b.param_bytes for b in m.blocks), default=m.param_bytes)
    memory = whole_bytes(m) / n + largest + m.activation_bytes_per_sample * micro
    parts = {
        "compute": compute,
        "communication": exposed + m.sync_s,
        "optimizer": m.optimizer_s / n,
    }
    reason = (
        f"each device computes {micro} samples in {ms(compute)}; gathering and scattering "
        f"{mb_text(m.param_bytes)} of parameters takes {ms(reduce)}, {ms(exposed)} of it not "
        "hidden"
    )
    return made(m, setup, parts, memory, reason)


register(
    Family(
        "fsdp",
        build,
        "one process per device, parameters, gradients and optimizer state sharded (FSDP2)",
        process_per_device=True,
        check=check,
        settings=FSDPSettings,
        field=Field(default_factory=FSDPSettings, description="the fsdp strategy's"),
        general=True,
        shards_state=True,
        large_model="parallel.fsdp.init=meta (each module drawn and sharded in turn)",
        setups=lambda m, devices: [Setup("fsdp", n) for n in range(2, devices + 1)],
        cost=price,
        unplanned=lambda m, devices: ONE_DEVICE if devices < 2 else None,
    )
)
