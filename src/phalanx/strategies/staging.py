"""The `pipeline` strategy's settings as the config gives them (`parallel.pipeline`), and their
checks before any process starts: the stages a layout makes of the processes (`layout`), the
schedule's conditions on the micro-batch count, and the settings the plan prices and writes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StrictInt, model_validator

from phalanx.costs import NO_CHAIN, ONE_DEVICE, Measured, Setup, balanced_split
from phalanx.errors import ConfigError, count
from phalanx.losses import UNSUMMED
from phalanx.settings import StrategySettings
from phalanx.strategies import schedules
from phalanx.strategies.registry import PRECISION, refuse
from phalanx.strategies.schedules import SCHEDULES

if TYPE_CHECKING:
    from phalanx.config import Config


def layout(settings: PipelineSettings, processes: int) -> tuple[int, int]:
    """The stages of `settings` over `processes` processes, and the processes a copy of the pipeline
    takes; a ConfigError where they do not share out, or where the schedule cannot run its
    micro-batches through them. A config check: a run or a resume is refused before any process
    starts."""
    per_process = settings.stages_per_process or 1
    if settings.split == "auto":  # cut in setup, by measured time
        stages = settings.stages or processes * per_process
        made = "parallel.pipeline.stages makes"
    else:
        stages = len(settings.split) + 1
        made = "parallel.pipeline.split makes"
    if stages % per_process:
        raise ConfigError(
            f"{made} {stages} stages, which cannot be shared out {per_process} to a process "
            f"(parallel.pipeline.stages_per_process); name {per_process} x N - 1 split points"
        )
    depth = stages // per_process
    if processes % depth:
        raise ConfigError(
            f"{made} {stages} stages, {per_process} per process, so {depth} processes a copy of "
            f"the pipeline, but there are {processes} processes: set parallel.devices to a "
            f"multiple of {depth}"
        )
    _check_schedule(settings, stages, depth)
    return stages, depth


def _check_schedule(settings: PipelineSettings, stages: int, depth: int) -> None:
    """The conditions that torch's schedules set on the micro-batch count as they are built (at
    the first step, when a resume has already rewritten the run's config), checked beforehand."""
    m, schedule = settings.microbatches, settings.schedule
    if SCHEDULES[schedule].fills and m < stages:
        # a schedule of one stage a process has one that fills the pipeline as it goes
        unfilled = [n for n, s in SCHEDULES.items() if s.per_process == 1 and not s.fills]
        one = SCHEDULES[schedule].per_process == 1
        other = "".join(f", or parallel.pipeline.schedule={n}" for n in unfilled) if one else ""
        raise ConfigError(
            f"parallel.pipeline.schedule={schedule} needs at least as many micro-batches as "
            f"stages, but has {count(m, 'micro-batch', 'es')} for {stages} stages; set "
            f"parallel.pipeline.microbatches to {stages} or more{other}"
        )
    rounds = max(1, m // depth)
    if SCHEDULES[schedule].in_rounds and m % rounds:
        raise ConfigError(
            f"parallel.pipeline.schedule={schedule} runs its micro-batches in rounds of one a "
            f"process: {m} micro-batches do not share out evenly over {rounds} rounds of "
            f"{depth} processes; set parallel.pipeline.microbatches to a multiple of {depth}, or "
            f"to {depth} or fewer"
        )


def _looping_schedules() -> list[str]:
    """The schedules that loop several stages a process (p, p + P, ...)."""
    return [n for n, s in SCHEDULES.items() if s.per_process > 1 and not s.in_v]


class PipelineSettings(StrategySettings):
    """`parallel.pipeline`: settings of the `pipeline` strategy."""

    split: Annotated[list[str], Field(min_length=1)] | Literal["auto"] = Field(
        description="the modules where a new stage starts: blocks of one nn.Sequential or "
        "nn.ModuleList of the model, such as [net.3]; one process per stage; or auto: the "
        "model's largest such chain cut into stages of about equal measured time",
    )
    stages: StrictInt | None = Field(
        None,
        ge=2,
        description="with split: auto, the stages to cut; default the processes times "
        "stages_per_process (one copy of the pipeline)",
    )
    microbatches: StrictInt = Field(
        4, ge=1, description="micro-batches per global batch (per accumulation window)"
    )
    # the choices are the schedule table's names (a Literal of them, as pydantic checks it)
    schedule: Literal[tuple(SCHEDULES)] = Field(  # type: ignore[valid-type]
        "1f1b", description=schedules.describe()
    )
    agree_every: StrictInt = Field(
        8,
        ge=1,
        # a window sent within the losses' tally's reach (`UNSUMMED`), whose oldest half settles
        # without sending anything
        le=UNSUMMED // 2,
        description="the most training steps whose losses and stop flags the processes agree on "
        "in one message, behind the steps; a step whose loss a hook reads, an evaluation round's "
        "and the epoch's last end it sooner, so hooks see every loss as one process would. A stop "
        "(a signal) takes effect up to twice this many steps later; 1: every step",
    )
    stages_per_process: StrictInt | None = Field(
        None,
        ge=1,
        description="stages each process holds, looped (process p: stages p, p + P ...); "
        f"default 1, and 2 for {' and '.join(_looping_schedules())} "
        f"({' and '.join(n for n, s in SCHEDULES.items() if s.in_v)}: 2, in a V)",
    )

    @model_validator(mode="after")
    def _per_process(self) -> PipelineSettings:
        if self.stages is not None and self.split != "auto":
            raise ValueError(
                "stages goes with split: auto; a list of split points makes one stage more than "
                "it names"
            )
        schedule = SCHEDULES[self.schedule]
        if schedule.in_v:
            if self.stages_per_process not in (None, 2):
                raise ValueError(
                    f"schedule {self.schedule} runs two stages per process, in a V; remove "
                    "stages_per_process or set it to 2"
                )
            self.stages_per_process = 2
        elif self.stages_per_process is None:
            self.stages_per_process = schedule.per_process
        elif self.stages_per_process > 1 and schedule.per_process == 1:
            raise ValueError(
                f"schedule {self.schedule} runs one stage per process; use "
                f"{' or '.join(_looping_schedules())} for stages_per_process > 1"
            )
        return self


def checked_settings(cfg: Config, accelerator: str, strategy: str = "pipeline") -> PipelineSettings:
    """`parallel.pipeline`, checked against the rest of the config (`strategy`: the one that
    stages the model, as the errors name it)."""
    settings = cfg.parallel.optional_section("pipeline", PipelineSettings)
    if settings is None:
        raise ConfigError(
            f"parallel.strategy={strategy} needs parallel.pipeline.split, the modules where a new "
            "stage starts, such as parallel.pipeline.split=[net.3]"
        )
    if accelerator == "cuda" and cfg.parallel.backend == "gloo":
        raise ConfigError(
            f"parallel.strategy={strategy} on GPUs sends activations between stages over NCCL, one "
            "GPU a process; gloo cannot send GPU memory: set parallel.backend=auto (or nccl)"
        )
    per_process = settings.stages_per_process or 1
    stages = len(settings.split) + 1 if settings.split != "auto" else settings.stages
    if stages == per_process:
        raise ConfigError(
            f"parallel.pipeline puts its {stages} stages in one process ({per_process} per "
            "process, parallel.pipeline.stages_per_process): a pipeline runs over two processes "
            f"or more; split it at {2 * per_process - 1} points, or set parallel.strategy=single"
        )
    refuse(
        strategy,
        {
            "parallel.shard_weights": cfg.parallel.shard_weights is not None,
            "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
            PRECISION: cfg.precision == "fp16",
            "compile": bool(cfg.compile),
        },
        "parallel.strategy=ddp or fsdp",
    )
    return settings


def unplanned(m: Measured, devices: int) -> str | None:
    if devices < 2:
        return ONE_DEVICE
    return NO_CHAIN if balanced_split(m.blocks, 2) is None else None


def accumulation_setup(cfg: Config, devices: int) -> Callable[[Measured], Setup]:
    """The pipeline the config names, its split cut from the measured blocks where auto."""
    settings = cfg.parallel.section("pipeline", PipelineSettings)
    named = settings.split
    stages = (settings.stages or devices) if named == "auto" else len(named) + 1

    def setup(m: Measured) -> Setup:
        split = balanced_split(m.blocks, stages) if named == "auto" else named
        return Setup(
            "pipeline",
            devices,
            stages,
            settings.microbatches,
            settings.schedule,
            tuple(split or ()),
        )

    return setup


def plan_settings(row: dict[str, Any]) -> dict[str, Any]:
    """The section that trains a plan's pipeline row."""
    return {
        "pipeline": {
            "split": row["split"],
            "microbatches": row["microbatches"],
            "schedule": row["schedule"],
        }
    }
