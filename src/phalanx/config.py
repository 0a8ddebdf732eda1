"""The config: a YAML file (see `yamltext`), command-line overrides (see `overrides`), and a
pydantic schema.

Framework sections reject unknown keys with a did-you-mean. A `class:` section (model, optimizer,
scheduler, dataset) passes its other keys to the constructor it names; that constructor's own
signature is what checks them, when `construct.instantiate` builds it. A config that does not
validate is one ConfigError, each bad key said as `validation` says it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    create_model,
    field_validator,
)

from phalanx import settings, validation
from phalanx.environment import cpu_cores
from phalanx.errors import ConfigError
from phalanx.overrides import apply as apply_overrides
from phalanx.yamltext import TooLarge, check_bounds, read_yaml

# Counts and sizes are StrictInt (and numbers StrictFloat): pydantic's lax int reads `true` as 1, so
# `batch_size: true` trained with batch 1. Booleans are not numbers here.


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _ClassSection(BaseModel):
    """A section naming a class; keys other than the framework's go to its constructor."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    class_: str = Field(alias="class", description="dotted path of the class to build")

    def kwargs(self) -> dict[str, Any]:
        """The constructor's keyword arguments: every key the framework does not own."""
        return dict(self.model_extra or {})


class LossConfig(BaseModel):
    """A torch.nn.functional loss computed from one model output and one batch key; other keys
    (ignore_index, label_smoothing, pos_weight ...) go to the function."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    function: str = Field(
        description="name in torch.nn.functional, e.g. cross_entropy, or a dotted path"
    )
    output: str = Field("output", description="the model output that is the loss's input")
    target: str = Field(description="the batch key that is the loss's target")

    def kwargs(self) -> dict[str, Any]:
        """The loss function's own keyword arguments."""
        return dict(self.model_extra or {})


class InitFromConfig(_Section):
    """Trained weights a new run starts from; its optimizer starts afresh."""

    path: str = Field(description="a run directory, or a .safetensors file")
    checkpoint: str | StrictInt = Field(
        "auto", description="a run's best, latest or step N; auto: best, else latest"
    )
    strict: bool = Field(
        True, description="false: names the weights lack or the model lacks are listed, not errors"
    )

    @field_validator("checkpoint")
    @classmethod
    def _a_checkpoint(cls, which: str | int) -> str | int:
        if which in ("best", "latest", "auto") or str(which).isdigit():  # digits: 0 or more
            return which
        raise ValueError("a checkpoint is best, latest, auto or a step number (0 or more)")


class ModelConfig(_ClassSection):
    n_gpus: StrictInt | None = Field(None, ge=0, description="alias of parallel.devices on CUDA")
    args: list[Any] = Field(default_factory=list, description="positional constructor arguments")
    inputs: dict[str, str] | None = Field(
        None,
        description="batch key -> forward argument, for modules that take tensors, not batches",
    )
    outputs: str | list[str] = Field(
        "output", description="names of a plain module's returned tensors"
    )
    loss: LossConfig | None = Field(
        None, description="the objective, for modules that return no `loss`"
    )
    init_from: InitFromConfig | None = Field(
        None,
        description="start from trained weights: a run directory or a .safetensors file, or "
        "{path, checkpoint, strict}",
    )

    @field_validator("init_from", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


class LrScalingConfig(_Section):
    """Scale the learning rate with the global batch (Goyal et al. 2017): lr * f(batch / base)."""

    rule: Literal["linear", "sqrt", "none"] = "none"
    base_batch_size: StrictInt = Field(
        gt=0, description="the batch size the configured lr was tuned for"
    )


class OptimizerConfig(_ClassSection):
    warmup_steps: StrictInt = Field(
        0, ge=0, description="linear warm-up of the learning rate, in optimizer steps"
    )
    lr_scaling: LrScalingConfig | None = Field(
        None, description="scale lr with the global batch size"
    )
    max_grad_norm: StrictFloat | StrictInt | None = Field(
        None,
        gt=0,
        description="clip the global gradient norm (over every rank and shard) to this value",
    )


class SchedulerConfig(_ClassSection):
    interval: Literal["step", "epoch"] = Field("step", description="when the scheduler steps")


# DataLoader workers a training process may start: per CPU core of the machine that checks the
# config, and on any machine (a job's script may be written on a smaller machine than the one that
# runs it). More than one a core helps loaders that wait on storage or the network; a thousand only
# fork the machine to a halt.
WORKERS_PER_CORE, WORKERS_ANYWHERE = 4, 32
# batches a DataLoader worker may prepare ahead (torch's default is 2): each is held in memory, and
# the first epoch waits for every worker's
MOST_PREFETCHED = 64


class DatasetConfig(_ClassSection):
    batch_size: StrictInt = Field(
        gt=0, description="global batch: samples per optimizer step, for the whole job"
    )
    eval_batch_size: StrictInt | None = Field(
        None, gt=0, description="batch for evaluation streams; default batch_size"
    )
    pin_memory: bool | Literal["auto"] = Field(
        "auto", description="page-locked batches, copied to the GPU without waiting; auto: on GPUs"
    )
    prefetch_factor: StrictInt | None = Field(
        None,
        ge=1,
        description="batches each DataLoader worker prepares ahead (torch's default, 2, where "
        "unset); at most 64",
    )
    keys: list[str] | None = Field(
        None,
        min_length=1,
        description="names of the parts of items that are tuples or lists (TensorDataset, "
        "torchvision), or the one name of items that are tensors",
    )
    num_workers: StrictInt | Literal["auto"] = Field(
        "auto",
        description="DataLoader worker processes; auto: 0 on CPU, up to 4 per GPU; at most the "
        "larger of 32 and 4 a CPU core",
    )
    persistent_workers: bool | Literal["auto"] = Field(
        "auto",
        description="keep each stream's DataLoader workers for the whole run instead of starting "
        "them every epoch (they are seeded each epoch as fresh ones would be); auto: where "
        "there are workers",
    )

    @field_validator("keys")
    @classmethod
    def _each_key_once(cls, keys: list[str] | None) -> list[str] | None:
        twice = sorted({k for k in keys or [] if keys.count(k) > 1})  # type: ignore[union-attr]
        if twice:
            raise ValueError(
                f"keys names {', '.join(map(repr, twice))} twice; each part of an item needs a "
                "name of its own"
            )
        return keys

    @field_validator("num_workers")
    @classmethod
    def _workers_this_machine_runs(cls, n: int | str) -> int | str:
        if isinstance(n, int) and n < 0:
            raise ValueError(f"num_workers must be 0 or more, or auto; got {n}")
        cores = cpu_cores()
        most = max(WORKERS_ANYWHERE, WORKERS_PER_CORE * cores)
        if isinstance(n, int) and n > most:
            raise ValueError(
                f"num_workers={n} would start {n} loader processes for each training process on "
                f"a machine of {cores} CPU core(s); give {most} or fewer (the larger of "
                f"{WORKERS_ANYWHERE} and {WORKERS_PER_CORE} a core), or auto"
            )
        return n

    @field_validator("prefetch_factor")
    @classmethod
    def _batches_ahead_bounded(cls, n: int | None) -> int | None:
        if n is not None and n > MOST_PREFETCHED:
            raise ValueError(
                f"prefetch_factor={n} would have each loader worker prepare {n} batches ahead, "
                f"all held in memory; give 1 to {MOST_PREFETCHED} (torch's default is 2)"
            )
        return n


S = TypeVar("S")


class ParallelConfig(_Section):
    """`parallel`: the framework's keys, and each strategy's own section (its `registry.Family`'s
    settings, added by `schema`)."""

    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    devices: StrictInt | Literal["auto"] = 1
    strategy: str = "auto"
    gradient_accumulation: StrictInt | Literal["auto"] = Field(
        1,
        description="micro-batches per optimizer step; auto: the fewest whose predicted peak "
        "memory fits each device (`phalanx plan`'s memory column), chosen when a run starts",
    )
    device_memory_gb: StrictFloat | None = Field(
        None,
        gt=0,
        description="the memory of one device that a run may fill, for the planner and "
        "gradient_accumulation: auto; default: what the device has (on the CPU, the machine's "
        "memory shared among its processes)",
    )
    sync_batchnorm: bool = Field(
        False, description="BatchNorm statistics over the global micro-batch"
    )
    shard_weights: list[StrictFloat] | None = Field(
        None, description="relative shard size per rank, for mixed hardware; default equal"
    )
    timeout_s: StrictFloat | None = Field(
        None, gt=0, description="collective timeout; default 300 on CPU, 600 on GPU"
    )
    oversubscribe: bool = Field(False, description="allow more than 4 CPU processes per core")
    build: Literal["host", "device"] = Field(
        "host",
        description="where the model is built: host (on the CPU, then moved to its device: the "
        "same initial values on any device kind, count and strategy) or device (built on its "
        "device as under `with torch.device(...)`, its initialisation run there: no copy of the "
        "model in host memory and no host-side drawing of its values, for large models on GPUs; "
        "the initial values are the device's draws, the same on any count of that kind of device "
        "under single, ddp, towers and param_server)",
    )
    cpu_threads: StrictInt | Literal["auto"] = Field(
        "auto",
        description="torch's threads per device on the CPU; auto: a process alone keeps torch's "
        "default, and the processes of a machine share its cores",
    )
    max_restarts: StrictInt = Field(
        0,
        ge=0,
        description="times the workers are started again after one fails; each attempt resumes "
        "from the last checkpoint (one machine)",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="collective backend: auto is nccl on GPUs and gloo on CPUs; gloo on GPUs lets "
        "several ranks share one GPU, which nccl refuses",
    )

    def section(self, strategy: str, kind: type[S]) -> S:
        """Strategy `strategy`'s own section (`parallel.<strategy>`), of its registered type."""
        value = self.optional_section(strategy, kind)
        if value is None:
            raise TypeError(f"parallel.{strategy} is not given")
        return value

    def optional_section(self, strategy: str, kind: type[S]) -> S | None:
        """The section, or None where the strategy's section has no default and is not given."""
        value = getattr(self, strategy)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"parallel.{strategy} is a {type(value).__name__}, not a {kind}")
        return value

    @property
    def accumulation(self) -> int:
        """`gradient_accumulation`, once `auto` is resolved: a run resolves it as it starts."""
        if self.gradient_accumulation == "auto":
            raise ConfigError(
                "parallel.gradient_accumulation=auto is chosen when `phalanx train` (or "
                "phalanx.fit) starts a run from a config file; here give a number"
            )
        return self.gradient_accumulation

    @field_validator("gradient_accumulation")
    @classmethod
    def _one_or_more(cls, n: int | str) -> int | str:
        if isinstance(n, int) and n < 1:
            raise ValueError(f"gradient_accumulation must be 1 or more, or auto; got {n}")
        return n

    @field_validator("cpu_threads")
    @classmethod
    def _at_least_one(cls, n: int | str) -> int | str:
        if isinstance(n, int) and not 1 <= n <= 4096:
            raise ValueError(f"cpu_threads must be 1 to 4,096, or auto; got {n}")
        return n

    @field_validator("shard_weights")
    @classmethod
    def _positive_weights(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and (not weights or any(w <= 0 for w in weights)):
            raise ValueError(
                f"shard_weights must be positive numbers, one per device; got {weights}"
            )
        return weights


class MainLoopConfig(_Section):
    epochs: StrictInt = Field(1, ge=1, description="training epochs")
    extra_streams: list[str] = Field(
        default_factory=list, description="streams evaluated after each epoch"
    )
    skip_zeroth_epoch: bool = Field(
        True, description="skip evaluating every stream before training"
    )
    eval_every_n_steps: StrictInt | None = Field(
        None,
        ge=1,
        description="evaluate the extra streams, and end an evaluation round (the after_epoch "
        "hooks: checkpoints, early stopping, logs), every N optimizer steps instead of every "
        "epoch",
    )

    @field_validator("extra_streams")
    @classmethod
    def _each_stream_once(cls, streams: list[str]) -> list[str]:
        """A stream listed twice (`+main_loop.extra_streams=valid` where it is listed) is evaluated
        once a round, where it is first listed."""
        return list(dict.fromkeys(streams))


class CheckpointsConfig(_Section):
    keep_last: StrictInt = Field(3, ge=1, description="checkpoints kept besides the best")
    async_: bool = Field(
        False,
        alias="async",
        description="copy the state to host memory and write it in the background, one at a time",
    )


class CompileConfig(_Section):
    """torch.compile settings; `compile: true` takes the defaults."""

    backend: str = Field("inductor", description="torch.compile backend")
    mode: str | None = Field(None, description="e.g. max-autotune, reduce-overhead")


class ProfileConfig(_Section):
    start_step: StrictInt = Field(10, ge=1, description="first optimizer step recorded")
    steps: StrictInt = Field(5, ge=1, description="steps recorded")
    record_shapes: bool = False


class Config(_Section):
    """The whole run. `model`, `optimizer` and `dataset` are required."""

    name: str | None = Field(None, description="run name; default: the config file's name")
    model: ModelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig | None = None
    dataset: DatasetConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: Literal["fp32", "fp64", "bf16", "fp16"] = "fp32"
    seed: StrictInt = Field(
        0, ge=-(2**63), le=2**63 - 1, description="the run's seed, a 64-bit signed integer"
    )
    per_sample_random: bool = Field(
        True,
        description="each sample's random numbers (dropout masks, the augmentation its dataset "
        "draws in __getitem__) are a function of the seed, the step or epoch and the sample's "
        "index alone, so that they do not depend on the device count, the strategy or the "
        "loader's workers; false: torch's own per-process generators, as plain PyTorch draws",
    )
    main_loop: MainLoopConfig = Field(default_factory=MainLoopConfig)
    hooks: list[str | dict[str, dict[str, Any] | None]] | None = None
    checkpoints: CheckpointsConfig = Field(default_factory=CheckpointsConfig)
    compile: bool | CompileConfig = Field(False, description="torch.compile the model")
    channels_last: bool = Field(
        False, description="channels-last memory format for 4-D weights and inputs"
    )
    cudnn_benchmark: bool = Field(
        False,
        description="let cuDNN time its convolution algorithms and keep the fastest (faster "
        "convolutions of fixed shapes; the choice, and so the last bits of the results, may "
        "differ between runs)",
    )
    matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest",
        description="float32 matrix products: highest (float32), high (TF32 on GPUs that have it: "
        "faster, about 3 fewer decimal digits), medium (bfloat16 products)",
    )
    activation_checkpointing: list[str] = Field(
        default_factory=list,
        description="module class names whose activations are recomputed in backward",
    )
    profile: ProfileConfig | None = Field(
        None, description="record a torch.profiler trace of a few steps"
    )
    output_root: str = "runs"

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, name: str | None) -> str | None:
        """The run directory is `<output_root>/<name>-<time>`, and job files carry the name: it
        must be one folder's name, and nothing that could end a line of a script."""
        if name is not None and (
            not name
            or len(name) > 128
            or not name.isprintable()
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise ValueError(
                "a run name is one folder's name: at most 128 printable characters, without / or "
                "\\, not . or ..; choose one such as digits-small"
            )
        return name

    @field_validator("hooks")
    @classmethod
    def _one_hook_per_item(cls, hooks: list | None) -> list | None:
        for i, item in enumerate(hooks or []):
            if isinstance(item, dict) and len(item) != 1:
                raise ValueError(
                    f"hooks.{i} has {len(item)} keys {list(item)}; write one hook per list item"
                )
        return hooks


def load(path: str | os.PathLike, overrides: str | Sequence[str] = ()) -> tuple[Config, dict]:
    """Read, override and validate a config file. Returns the validated config and the raw dict."""
    raw = read(path, overrides)
    return validate(raw), raw


def read(path: str | os.PathLike, overrides: str | Sequence[str] = ()) -> dict:
    """A config file's raw mapping, overridden, with its default name; not yet validated."""
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}; pass the path of a YAML file")
    raw = read_yaml(
        path, "save the config as UTF-8 YAML, or check that this is the config file you meant"
    )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} must hold a mapping of sections (model, optimizer, dataset ...), "
            f"got {type(raw).__name__}"
        )
    raw = apply_overrides(raw, overrides)
    if raw.get("name") is None:  # not given, or given empty (`name=`)
        raw["name"] = _default_name(path)
    return raw


def _default_name(path: Path) -> str:
    """The config file's name, or its folder's for config.yaml; characters a run name may not hold
    (see Config.name) become `-`."""
    name = path.parent.resolve().name if path.stem == "config" else path.stem
    return re.sub(r"[^\w.+=,@-]+", "-", name).strip("-.")[:128] or "run"


_SCHEMAS: dict[tuple, type[Config]] = {}


def schema() -> type[Config]:
    """The config's model with a section of `parallel` for each strategy that registered one
    (`strategies.registry`), of the type it registered (built once for each set of sections)."""
    sections: dict[str, Any] = settings.sections()
    key = tuple((name, id(section)) for name, section in sections.items())
    if key not in _SCHEMAS:
        parallel = create_model(
            "ParallelConfig", __base__=ParallelConfig, __doc__=ParallelConfig.__doc__, **sections
        )
        _SCHEMAS[key] = create_model(
            "Config",
            __base__=Config,
            __doc__=Config.__doc__,
            parallel=(parallel, Field(default_factory=parallel)),
        )
    return _SCHEMAS[key]


def validate(raw: dict) -> Config:
    """The validated config, or a ConfigError naming each bad key and the fix."""
    try:  # a dict from Python, or a file's values after the overrides: bounded as a file's are
        check_bounds(raw)
    except TooLarge as e:
        raise ConfigError(f"the config is refused: {e}") from None
    try:
        model = schema()
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(validation.said(e, raw, model)) from None


def flat_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves by dotted key (`optimizer.lr`); an empty mapping is a leaf."""
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flat_keys(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def dump(raw: dict) -> str:
    """YAML text of a raw config, keys in their given order."""
    return yaml.safe_dump(raw, sort_keys=False)
