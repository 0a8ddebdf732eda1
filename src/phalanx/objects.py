"""Parts given as Python objects (to `phalanx.fit`) instead of named in the config by dotted path.

The config still says how to train them. Its `model` and `dataset` sections keep their framework
keys (batch_size, loss, inputs ...) and name the object's class, which the run's `run.json` records
as given, not built: such a run is resumed, evaluated and loaded from Python, with the objects
again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from torch import nn

from phalanx import keras_models, rundir
from phalanx.config import DatasetConfig, ModelConfig
from phalanx.errors import ConfigError, ModelError, RunDirError

log = logging.getLogger("phalanx")

# sections whose framework keys stay
_OWN_KEYS: dict[str, type[BaseModel]] = {"model": ModelConfig, "dataset": DatasetConfig}


class Streams:
    """A dataset made of streams given by name: `dataset={"train": ..., "valid": ...}`."""

    def __init__(self, streams: Mapping[str, Any]):
        self._streams = dict(streams)

    def streams(self) -> dict[str, Any]:
        return self._streams


@dataclass
class Objects:
    """A model, a dataset and hooks given as objects; each may be absent."""

    model: nn.Module | None = None
    dataset: Any = None
    hooks: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what `into` replaced, for the run's log

    @classmethod
    def given(
        cls, model: Any = None, dataset: Any = None, hooks: Sequence[Any] | None = None
    ) -> Objects:
        """Checked: a module, a dataset with streams() or a mapping of streams, Hook instances."""
        from phalanx.hooks import Hook

        if keras_models.is_keras(model):
            model = keras_models.KerasModule(model)
        if model is not None and not isinstance(model, nn.Module):
            raise ModelError(
                f"model= is a {type(model).__name__}, not a torch.nn.Module; give the module "
                "itself (or name its class in the config's model.class)"
            )
        if isinstance(dataset, Mapping):
            dataset = Streams(dataset)
        elif dataset is not None and not callable(getattr(dataset, "streams", None)):
            raise ConfigError(
                f"dataset= is a {type(dataset).__name__}, which has no streams() method; give "
                "{'train': ..., 'valid': ...} (a Dataset per stream), or an object whose streams() "
                "returns that"
            )
        if isinstance(hooks, Hook) or (hooks is not None and not isinstance(hooks, Sequence)):
            raise ConfigError(
                f"hooks= is a {type(hooks).__name__}; give a list of hooks, such as "
                "[phalanx.hooks.StopAfter(epochs=5)]"
            )
        hooks = list(hooks or [])
        for i, hook in enumerate(hooks):
            if isinstance(hook, type) and issubclass(hook, Hook):
                raise ConfigError(
                    f"hooks[{i}] is the class {hook.__name__}, not a hook; make one: "
                    f"{hook.__name__}(...)"
                )
            if not isinstance(hook, Hook):
                raise ConfigError(
                    f"hooks[{i}] is a {type(hook).__name__}, not a phalanx.hooks.Hook; give hook "
                    "instances, such as phalanx.hooks.StopAfter(epochs=5)"
                )
        return cls(model, dataset, hooks)

    def __bool__(self) -> bool:
        return self.model is not None or self.dataset is not None or bool(self.hooks)

    def names(self) -> dict[str, Any]:
        """What `run.json` records: each given part's class."""
        names: dict[str, Any] = {
            key: class_path(value)
            for key, value in (("model", self.model), ("dataset", self.dataset))
            if value is not None
        }
        if self.hooks:
            names["hooks"] = [class_path(hook) for hook in self.hooks]
        return names

    def into(self, raw: dict) -> dict:
        """The raw config with the given model's and dataset's classes in place of the ones it
        names: the sections' framework keys stay; constructor arguments, which the objects were
        built without, go (said in the log)."""
        raw = dict(raw)
        for section, value in (("model", self.model), ("dataset", self.dataset)):
            if value is None:
                continue
            given = raw.get(section)
            if given is None:
                given = {}
            if not isinstance(given, dict):
                raise ConfigError(
                    f"{section}: must be a mapping of settings, got {type(given).__name__}"
                )
            own = {f.alias or name for name, f in _OWN_KEYS[section].model_fields.items()} - {
                "class"
            }
            dropped = [key for key in given if key not in own and key != "class"]
            if "class" in given or dropped:
                self.notes.append(
                    f"{section}: the object given replaces "
                    f"{'class ' + given['class'] if 'class' in given else 'the section'}"
                    f"{' and its arguments ' + ', '.join(dropped) if dropped else ''}"
                )
            raw[section] = {
                "class": class_path(value),
                **{k: v for k, v in given.items() if k in own},
            }
        return raw


def class_path(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def check_given(
    run_dir: Path, objects: Objects, command: str, parts: Sequence[str] = ("model", "dataset")
) -> None:
    """A RunDirError where the run's model or dataset was given to `fit` as an object and is not
    given again: its config names their classes but not how to build them. Hooks given as objects
    and not again are only said, on resume (their part of the checkpoint is not restored)."""
    recorded = rundir.objects(run_dir)
    missing = [part for part in parts if part in recorded and getattr(objects, part) is None]
    if missing:
        given = ", ".join(f"{part}={recorded[part]}(...)" for part in missing)
        raise RunDirError(
            f"{run_dir} was trained with {' and '.join(missing)} given to phalanx.fit as objects "
            f"({', '.join(recorded[p] for p in missing)}), which its config does not say how to "
            f"build; give them again, in Python: phalanx.{command}({str(run_dir)!r}, {given})"
        )
    if "hooks" in recorded and not objects.hooks and command == "resume":
        log.warning(
            "%s was trained with hooks given as objects (%s); they are not part of this resume: "
            "pass them again with hooks=[...]",
            run_dir,
            ", ".join(recorded["hooks"]),
        )
