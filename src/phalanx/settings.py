"""Each strategy's own section of `parallel` (`parallel.ddp`, `parallel.pipeline` ...): the
strategies' settings, and the registry the config's schema takes them from (`register`).

A strategy's section is named after it and checked as every section of the config is: its keys'
types and ranges, and an unknown key is a did-you-mean error. The strategies read theirs with
`cfg.parallel.section(name, Settings)`. The module holds nothing of the config or the strategies,
so that both can use it: the config builds its model from `SECTIONS`, a strategy names its class.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator


class StrategySettings(BaseModel):
    """A strategy's own section of `parallel`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# strategy name -> (the section's type, pydantic's Field with its default)
SECTIONS: dict[str, tuple[Any, Any]] = {}


def register(strategy: str, kind: Any, field: Any) -> None:
    """Give strategy `strategy` its section `parallel.<strategy>` of type `kind` (`field`: its
    default and description): configs validated from now on have it."""
    SECTIONS[strategy] = (kind, field)


class DDPSettings(StrategySettings):
    """`parallel.ddp`: settings of the `ddp` strategy."""

    bucket_cap_mb: StrictFloat | None = Field(
        None, gt=0, description="size of DDP's gradient buckets in MiB; default DDP's own (25)"
    )


class TowersSettings(StrategySettings):
    """`parallel.towers`: settings of the `towers` strategy."""

    variables_on: Literal["device0", "cpu"] = Field(
        "device0",
        description="where the master copy of the variables lives and the optimizer steps: on the "
        "first device (which is also the first tower), or on the CPU",
    )


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


V_SCHEDULES = ("zbv", "dualpipev")  # two stages a process, in a V


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
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"] = Field(
        "1f1b",
        description="gpipe: every forward, then every backward; 1f1b: one forward, one backward "
        "(fewer activations held); interleaved: 1f1b over several stages per process (a smaller "
        "bubble); zero_bubble: interleaved, each backward split into its input and weight halves; "
        "zbv and dualpipev: two stages per process in a V (process p: stages p and 2P - 1 - p), "
        "zero-bubble, and DualPipe's overlap of one micro-batch's forward with another's backward",
    )
    stages_per_process: StrictInt | None = Field(
        None,
        ge=1,
        description="stages each process holds, looped (process p: stages p, p + P ...); "
        "default 1, and 2 for interleaved and zero_bubble (zbv and dualpipev: 2, in a V)",
    )

    @model_validator(mode="after")
    def _per_process(self) -> PipelineSettings:
        if self.stages is not None and self.split != "auto":
            raise ValueError(
                "stages goes with split: auto; a list of split points makes one stage more than "
                "it names"
            )
        several = self.schedule in ("interleaved", "zero_bubble")
        if self.schedule in V_SCHEDULES:
            if self.stages_per_process not in (None, 2):
                raise ValueError(
                    f"schedule {self.schedule} runs two stages per process, in a V; remove "
                    "stages_per_process or set it to 2"
                )
            self.stages_per_process = 2
        elif self.stages_per_process is None:
            self.stages_per_process = 2 if several else 1
        elif self.stages_per_process > 1 and not several:
            raise ValueError(
                f"schedule {self.schedule} runs one stage per process; use interleaved or "
                "zero_bubble for stages_per_process > 1"
            )
        return self


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


register("ddp", DDPSettings, Field(default_factory=DDPSettings, description="the ddp strategy's"))
register("towers", TowersSettings, Field(default_factory=TowersSettings, description="the towers'"))
register(
    "fsdp", FSDPSettings, Field(default_factory=FSDPSettings, description="the fsdp strategy's")
)
register(
    "pipeline",
    PipelineSettings | None,
    Field(None, description="the pipeline strategy's (split is required)"),
)
register(
    "placement",
    dict[str, str],
    Field(
        default_factory=dict,
        description="the placement strategy's devices by module name, such as {encoder: cuda:0, "
        "decoder: cuda:1, head: cpu}; the rest of the model on the run's device",
    ),
)
register(
    "param_server",
    ParamServerSettings,
    Field(default_factory=ParamServerSettings, description="the param_server strategy's"),
)
