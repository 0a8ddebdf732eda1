"""The pipeline's stages as torch's schedules run them: each stage's module (the model's own
forward, as far as the stage goes), and the `PipelineStage` that runs it, whose sends and receives
count as collectives (so that a hung process is named) and whose forward of a micro-batch draws
that micro-batch's samples' random numbers."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from phalanx import random
from phalanx.engine import TOKENS
from phalanx.errors import ModelError
from phalanx.model import loss_not_a_tensor
from phalanx.strategies.cutting import Active, Cut, Split, stage_parts
from phalanx.strategies.padding import rows_of

if TYPE_CHECKING:
    from phalanx.engine import Engine
    from phalanx.precision import Precision


def stage_error(error: RuntimeError) -> BaseException:
    """The error of the model's own code where torch's stage wrapped it in one whose message is
    the stage's arguments ("[Stage 1] failed to run forward: args ..."); else `error`."""
    cause = error.__cause__
    if cause is not None and re.match(r"\s*\[Stage \d+\] failed to run", str(error)):
        return cause
    return error


class CountedStage(pipelining.PipelineStage):
    """A stage whose sends and receives, as the schedules make them, count as collectives
    (`enter`, once per stage the transfer lies down the flow of its data: see `transfer_count`),
    so that a timed-out transfer names the rank that did not come to it, and its step. Its forward
    of a micro-batch takes that micro-batch's rows of the step's batch (`Active.chunks`: the
    schedule is handed none, so that it neither splits nor flattens them) and draws its samples'
    random numbers."""

    def __init__(
        self,
        enter: Callable[[str, int], None],
        draws: Callable[[int], random.Draws | None],
        active: Active,
        rows: int,
        *args: Any,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._enter, self._draws, self._active = enter, draws, active
        self._rows = rows
        # each transfer's name and count, by (kind, micro-batch): see `_count`
        self._counts: dict[tuple[int, int], tuple[str, int]] = {}

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """The forward of micro-batch `fwd_chunk_id`, its dropout masks those of its samples."""
        active = self._active
        active.batch, active.rows = active.chunks[fwd_chunk_id], self._rows
        draws = self._draws(fwd_chunk_id)
        with random.drawing(None) if draws is None else draws:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """The stage module's forward, without `nn.Module`'s dispatch every micro-batch: the module
        is a `Stage`, which nothing hooks, wraps or compiles (the model's own modules inside it
        keep all of theirs)."""
        return self.submod.forward(*args, **kwargs)

    def _count(self, kind: int, chunk: int) -> None:
        """A transfer of micro-batch `chunk` counted: `kind` 0 the activation received, 1 the
        activation sent, 2 the gradient received, 3 the gradient sent."""
        counted = self._counts.get((kind, chunk))
        if counted is None:
            k = self.stage_index
            source, target = ((k - 1, k), (k, k + 1), (k + 1, k), (k, k - 1))[kind]
            counted = transfer_count(self.num_stages, kind > 1, chunk, source, target)
            self._counts[(kind, chunk)] = counted
        if counted[1]:
            self._enter(*counted)

    # the side a first or last stage lacks makes no ops, and counts none
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        if ops:
            self._count(0, fwd_chunk_id)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if ops:
            self._count(1, fwd_chunk_id)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if ops:
            self._count(2, bwd_chunk_id)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if ops:
            self._count(3, bwd_chunk_id)
        return ops


def count_transfer(
    enter: Callable[[str, int], None],
    stages: int,
    gradient: bool,
    chunk: int | None,
    source: int,
    target: int,
) -> None:
    """A transfer between two stages, counted (`transfer_count`)."""
    name, times = transfer_count(stages, gradient, chunk, source, target)
    if times:
        enter(name, times)


def transfer_count(
    stages: int, gradient: bool, chunk: int | None, source: int, target: int
) -> tuple[str, int]:
    """A transfer between two stages' name, and how many times it counts on both its sides: as
    many as its target lies stages down the flow of its data (activations from the first stage,
    gradients from the last). A process that waits for a stage up the flow has then counted more
    than the hung process it waits for, though both received the same number of micro-batches.
    (The counts of a step are evened out after it: `Pipeline._counts_evened`.)"""
    what = "gradient" if gradient else "activation"
    of = f"micro-batch {chunk + 1}'s" if chunk is not None else "the round's"
    name = f"the transfer of {of} {what} from stage {source} to stage {target}"
    return name, stages - 1 - target if gradient else target


def make_stages(
    model: nn.Module,
    split: Split,
    mine: list[int],
    stages: int,
    engine: Engine,
    active: Active,
    enter: Callable[[str, int], None],
    draws: Callable[[int], random.Draws | None],
    rows: int,
    device: torch.device,
    group: Any,
) -> tuple[dict[int, Stage], list[CountedStage]]:
    """This process's stages (`mine`, of `stages`) of `model`, split at `split`, on its device:
    each stage's module, by index, and the `CountedStage` that runs it for a schedule, with
    micro-batches of `rows` rows, talking over `group`."""
    bounds = [0, *split.cuts, split.size]
    loss_dtype = next(p.dtype for p in model.parameters())

    def meta(k: int) -> torch.Tensor:  # stage k's activation, as the schedule allocates it
        shape, dtype = split.shapes[k]
        return torch.empty(shape, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)

    modules: dict[int, Stage] = {}
    counted: list[CountedStage] = []
    for k in mine:
        module = modules[k] = Stage(
            stage_parts(model, split, k, stages),
            (bounds[k], bounds[k + 1], k),
            engine.forward_fn,
            active,
            engine.precision,
        )
        # the last stage's output is each row's loss
        output = (
            torch.empty(rows, dtype=loss_dtype, device=device, requires_grad=True)
            if k == stages - 1
            else meta(k)
        )
        counted.append(
            CountedStage(
                enter,
                draws,
                active,
                rows,
                module,
                k,
                stages,
                device,
                input_args=() if k == 0 else meta(k - 1),
                output_args=output,
                group=group,
            )
        )
    return modules, counted


def forward_in_turn(
    modules: Mapping[int, nn.Module],
    ranks: list[int],
    shapes: list[tuple[torch.Size, torch.dtype]],
    batch: dict[str, torch.Tensor],
    active: Active,
    group: Any,
    device: torch.device,
    enter: Callable[[str, int], None],
) -> None:
    """One forward of `batch` through every stage in turn, without a schedule: this process runs
    its stages (`modules`, by stage index) and sends each activation on where the next stage is
    held elsewhere (`ranks[k]`, the global rank of the process that holds stage k; `shapes[k]`,
    the activation after it). The last stage's module keeps its outputs, as in a schedule. A V
    schedule evaluates this way: torch 2.13's fail in `eval`, taking the activation passed within a
    process for a backward's."""
    received: tuple[torch.Tensor, ...] = ()
    active.batch, active.rows = batch, rows_of(batch)
    for k in range(len(ranks)):
        if k and ranks[k] != ranks[k - 1]:  # the activation crosses between processes
            if k in modules:
                shape, dtype = shapes[k - 1]
                activation = torch.empty((rows_of(batch), *shape[1:]), dtype=dtype, device=device)
                count_transfer(enter, len(ranks), False, None, k - 1, k)
                dist.recv(activation, ranks[k - 1], group=group)
                received = (activation,)
            elif k - 1 in modules:
                count_transfer(enter, len(ranks), False, None, k - 1, k)
                dist.send(received[0], ranks[k], group=group)
        if k in modules:
            output = modules[k](*received)
            received = (output,) if k < len(ranks) - 1 else ()


class Stage(nn.Module):
    """One stage as `PipelineStage` runs it: the model's forward of the micro-batch in hand
    (`Active.batch`), as far as the stage goes. Its parameters are its own modules' (a process's
    stages share one model)."""

    def __init__(
        self,
        parts: list[nn.Module],
        span: tuple[int, int, int],
        call: Callable,
        active: Active,
        precision: Precision,
    ):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._span, self._call, self._active, self._precision = span, call, active, precision

    def forward(self, *received: torch.Tensor) -> torch.Tensor:
        active = self._active
        batch = active.batch
        active.lo, active.hi, active.stage = self._span
        active.received = received[0] if received else None
        precision = self._precision
        try:
            if precision.autocast_dtype is None:  # no context to enter, every micro-batch
                outputs = self._call(batch)
            else:
                with precision.autocast():
                    outputs = self._call(batch)
        except Cut as cut:
            return cut.activation
        finally:
            active.received = None
        loss = outputs["loss"]
        rows = active.rows
        try:
            per_sample = loss.dim() == 1 and loss.shape[0] == rows
        except AttributeError:  # not a tensor
            raise loss_not_a_tensor(loss) from None
        if not per_sample:
            raise ModelError(
                "the pipeline strategy needs the model's loss per sample (a vector of the batch's "
                f"size, {rows}), but it returned one of shape {tuple(loss.shape)}; return the "
                "loss with reduction='none', or name one with model.loss"
            )
        data: dict[str, Any] = dict(batch)
        for key, value in outputs.items():
            if key == TOKENS or not isinstance(value, torch.Tensor):
                data[key] = value
            else:
                data[key] = value.detach()
        active.captured.append(data)
        return loss
