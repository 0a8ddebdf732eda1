"""The config: YAML reading, schema errors that name the key and the fix, overrides, and building
objects from `class:` sections."""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path

import pytest
import torch
import toy
import yaml
from pydantic import BaseModel
from torch import nn

from phalanx import config, construct
from phalanx.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config.validate(raw)
    return str(info.value)


# --- reading YAML ------------------------------------------------------------------------------


def test_load_reads_yaml_and_names_the_run_after_the_file(tmp_path):
    raw = toy.regression_config()
    del raw["name"]
    path = toy.write_config(tmp_path, raw, name="exp1.yaml")
    cfg, loaded = config.load(path)
    assert cfg.dataset.batch_size == 8
    assert cfg.model.class_ == "toy.Linear"
    assert cfg.model.kwargs() == {"features": 3}
    assert cfg.name == loaded["name"] == "exp1"
    path.write_text(yaml.safe_dump({**raw, "name": "given"}))
    assert config.load(path)[0].name == "given"
    assert config.load(path, ["name="])[0].name == "exp1"  # given empty: the file's name again
    path.write_text(yaml.safe_dump({**raw, "name": None}))
    assert config.load(path)[0].name == "exp1"


def test_load_names_a_config_yaml_run_after_its_folder(tmp_path):
    raw = toy.regression_config()
    del raw["name"]
    path = toy.write_config(tmp_path / "digits", raw)
    cfg, _ = config.load(path)
    assert cfg.name == "digits"


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "model:\n  class: [toy.Linear\n  features: : 3\n",
            "is not valid YAML at line 3, column 11: expected ',' or ']', but got ':' (while "
            "parsing a flow sequence)",
        ),
        (
            "name: toy\n\tseed: 1\n",
            "is not valid YAML at line 2, column 1: found character '\\t' that cannot start any "
            "token (while scanning for the next token)",
        ),
    ],
)
def test_a_yaml_error_says_the_line_and_column(tmp_path, text, said):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert f"{path} {said}; " in str(info.value), str(info.value)


def test_load_uses_safe_load_and_never_builds_python_objects(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(path)
    assert not marker.exists()


def test_a_stream_listed_twice_in_extra_streams_is_evaluated_once():
    raw = toy.regression_config(main_loop={"extra_streams": ["valid", "test", "valid"]})
    assert config.validate(raw).main_loop.extra_streams == ["valid", "test"]


def test_load_rejects_a_missing_file_and_a_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is not a file; pass the path of a YAML file"):
        config.load(tmp_path)
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        config.load(path)


@pytest.mark.parametrize(
    "content",
    [
        "name: caf\xe9\nseed: 0\n".encode("latin-1"),  # a Latin-1 file: \xe9 is not UTF-8
        bytes(range(256)),  # a binary file
    ],
    ids=["latin-1", "binary"],
)
def test_load_names_a_file_that_is_not_utf8_text(tmp_path, content):
    path = tmp_path / "exp.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert str(path) in message and "not UTF-8" in message and "save the config as UTF-8" in message
    assert "\n" not in message


def test_load_applies_overrides_before_validation(tmp_path):
    path = toy.write_config(tmp_path, toy.regression_config())
    cfg, raw = config.load(path, ["dataset.batch_size=16", "main_loop.extra_streams=[valid, test]"])
    assert cfg.dataset.batch_size == 16
    assert cfg.main_loop.extra_streams == ["valid", "test"]
    assert raw["dataset"]["batch_size"] == 16
    with pytest.raises(ConfigError, match="dataset.batch_size"):
        config.load(path, ["dataset.batch_size=0"])


# --- schema errors -----------------------------------------------------------------------------


def test_unknown_key_in_framework_section_suggests_the_right_one():
    message = _error(toy.regression_config(main_loop={"epoch": 3}))
    assert "main_loop.epoch" in message
    assert 'did you mean "epochs"' in message


def test_unknown_top_level_key_suggests_the_section():
    raw = toy.regression_config()
    raw["optimiser"] = raw.pop("optimizer")
    message = _error(raw)
    assert "'optimiser'" in message and 'did you mean "optimizer"' in message
    assert "missing key 'optimizer'" in message


def test_an_unknown_key_like_none_there_lists_the_keys_there():
    raw = toy.regression_config(main_loop={"nope": 3})
    raw["foo"] = 1
    message = _error(raw)
    assert "unknown key 'main_loop.nope'; main_loop takes epochs, extra_streams," in message
    assert "unknown key 'foo'; the config takes name, model, optimizer," in message


def test_a_validators_own_message_says_the_value_once():
    message = _error(toy.regression_config(parallel={"gradient_accumulation": 0}))
    assert message.endswith(
        "parallel.gradient_accumulation: gradient_accumulation must be 1 or more, or auto; got 0"
    )
    assert "Value error" not in message


@pytest.mark.parametrize(
    "section, typo, expected",
    [
        ("main_loop", "extra_stream", "extra_streams"),
        ("parallel", "strategi", "strategy"),  # a key that starts with "str"
        ("main_loop", "streams", "extra_streams"),  # likewise
    ],
)
def test_unknown_key_is_named_in_full(section, typo, expected):
    raw = toy.regression_config()
    raw.setdefault(section, {})[typo] = "x"
    message = _error(raw)
    assert f"'{section}.{typo}'" in message
    assert f'did you mean "{expected}"' in message


def test_class_sections_pass_unknown_keys_to_the_constructor():
    cfg = config.validate(toy.regression_config(optimizer={"momentum": 0.9}))
    assert cfg.optimizer.kwargs() == {"lr": 0.05, "momentum": 0.9}
    assert cfg.model.kwargs() == {"features": 3}


@pytest.mark.parametrize("section", ["model", "optimizer", "dataset"])
def test_missing_required_section(section):
    raw = toy.regression_config()
    del raw[section]
    message = _error(raw)
    assert f"missing key {section!r}" in message


def test_missing_class_in_a_class_section():
    raw = toy.regression_config()
    del raw["model"]["class"]
    assert "missing key 'model.class'" in _error(raw)


def test_wrong_type_names_the_key_and_the_value():
    message = _error(toy.regression_config(dataset={"batch_size": "lots"}))
    assert "dataset.batch_size" in message and "'lots'" in message
    message = _error(toy.regression_config(precision="fp8"))
    assert "precision" in message and "'fp8'" in message
    message = _error(toy.regression_config(main_loop={"epochs": 0}))
    assert "main_loop.epochs" in message and "0" in message


def _number_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    """Every key of the schema that holds an int or a float (or a list of them), found by walking
    it."""
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name,)
        args = typing.get_args(field.annotation) or (field.annotation,)
        sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            yield from _number_fields(sections[0], key)
        elif _holds(field.annotation, (int, float)):
            yield ".".join(key), _holds(field.annotation, (list,))


def _holds(annotation, types: tuple[type, ...]) -> bool:
    if annotation in types or typing.get_origin(annotation) in types:
        return True
    return any(_holds(arg, types) for arg in typing.get_args(annotation))


NUMBER_FIELDS = sorted(_number_fields(config.schema()))


def test_the_schema_walk_finds_the_number_fields():
    keys = [key for key, _ in NUMBER_FIELDS]
    assert {
        "dataset.batch_size",
        "seed",
        "parallel.devices",
        "parallel.shard_weights",
        "optimizer.lr_scaling.base_batch_size",
        "profile.steps",
        "parallel.ddp.bucket_cap_mb",
        "parallel.max_restarts",
        "optimizer.max_grad_norm",
        "main_loop.eval_every_n_steps",
        "model.init_from.checkpoint",
        "dataset.prefetch_factor",
        "parallel.cpu_threads",
        "parallel.pipeline.microbatches",
        "parallel.pipeline.stages_per_process",
        "parallel.pipeline.agree_every",
        "parallel.pipeline.stages",
        "parallel.gradient_accumulation",
        "parallel.device_memory_gb",
        "parallel.param_server.servers",
        "parallel.param_server.staleness",
        "parallel.mesh.replicate",
        "parallel.mesh.shard",
        "parallel.mesh.tensor",
        "parallel.mesh.pipeline",
    } <= set(keys)
    assert len(keys) == 33, keys


@pytest.mark.parametrize("key, is_list", NUMBER_FIELDS, ids=[key for key, _ in NUMBER_FIELDS])
def test_a_boolean_is_not_a_number(key, is_list):
    """`batch_size: true` trained with batch 1: pydantic's lax int reads True as 1."""
    raw = toy.regression_config(
        optimizer={"lr_scaling": {"rule": "linear", "base_batch_size": 8}}, profile={}
    )
    config.validate(raw)  # valid before the boolean goes in
    node = raw
    *sections, last = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = [True] if is_list else True
    message = _error(raw)
    assert key in message and "True" in message


def test_a_key_of_several_types_is_one_message():
    message = _error(toy.regression_config(parallel={"devices": True}))
    assert message == "parallel.devices: Input should be a valid integer or 'auto' (got True)"


def test_hooks_item_with_two_keys_is_rejected():
    raw = toy.regression_config(
        hooks=["LogVariables", {"SaveBest": {"mode": "max"}, "StopAfter": {"epochs": 2}}]
    )
    message = _error(raw)
    assert "hooks.1" in message and "one hook per list item" in message


def test_hooks_items_may_be_names_or_one_key_mappings():
    cfg = config.validate(
        toy.regression_config(
            hooks=["LogVariables", {"SaveBest": None}, {"StopAfter": {"epochs": 2}}]
        )
    )
    assert cfg.hooks == ["LogVariables", {"SaveBest": None}, {"StopAfter": {"epochs": 2}}]


# --- overrides ---------------------------------------------------------------------------------


def test_override_values_are_parsed_as_yaml():
    raw = toy.regression_config()
    out = config.apply_overrides(
        raw,
        [
            "dataset.batch_size=16",
            "optimizer.lr=0.5",
            "name=run 2",
            "main_loop.skip_zeroth_epoch=false",
            "main_loop.extra_streams=[a, b]",
            "scheduler={class: StepLR, step_size: 3}",
            "seed=null",
        ],
    )
    assert out["dataset"]["batch_size"] == 16 and isinstance(out["dataset"]["batch_size"], int)
    assert out["optimizer"]["lr"] == 0.5
    assert out["name"] == "run 2"
    assert out["main_loop"]["skip_zeroth_epoch"] is False
    assert out["main_loop"]["extra_streams"] == ["a", "b"]
    assert out["scheduler"] == {"class": "StepLR", "step_size": 3}
    assert out["seed"] is None
    assert raw == toy.regression_config()  # the input is not modified


def test_override_creates_missing_sections():
    out = config.apply_overrides(toy.regression_config(), ["parallel.gradient_accumulation=3"])
    assert out["parallel"] == {"gradient_accumulation": 3}
    assert config.validate(out).parallel.gradient_accumulation == 3


def test_override_indexes_lists():
    raw = toy.regression_config(
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            {"SaveBest": {"variable": "valid.loss", "mode": "min"}},
            "SaveLatest",
        ]
    )
    out = config.apply_overrides(raw, ["hooks.1.SaveBest.mode=max"])
    assert out["hooks"][1] == {"SaveBest": {"variable": "valid.loss", "mode": "max"}}
    assert out["hooks"][0] == raw["hooks"][0] and out["hooks"][2] == "SaveLatest"
    out = config.apply_overrides(raw, ["hooks.-2.SaveBest.variable=train.loss"])
    assert out["hooks"][1]["SaveBest"]["variable"] == "train.loss"
    out = config.apply_overrides(raw, ["hooks.0.ComputeStats.variables.0=accuracy"])
    assert out["hooks"][0]["ComputeStats"]["variables"] == ["accuracy"]


@pytest.mark.parametrize(
    "override, words",
    [
        ("hooks.3.SaveLatest.x=1", ["'hooks.3'", "list of 3 items"]),
        ("hooks.-4.SaveLatest.x=1", ["'hooks.-4'", "list of 3 items"]),
        ("hooks.first.x=1", ["hooks has no item 'first'", "by its index"]),
        ("hooks.2.LogVariables.x=1", ["'hooks.2'", "str", "not a section"]),
        ("main_loop.epochs.max=1", ["'main_loop.epochs'", "int", "not a section"]),
    ],
)
def test_bad_override_paths(override, words):
    raw = toy.regression_config()
    with pytest.raises(ConfigError) as info:
        config.apply_overrides(raw, [override])
    message = str(info.value)
    assert override in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("override", ["dataset.batch_size", "=16", ""])
def test_override_must_be_key_equals_value(override):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        config.apply_overrides(toy.regression_config(), [override])


def test_override_with_invalid_yaml_value():
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.apply_overrides(toy.regression_config(), ["main_loop.extra_streams=[valid"])


@pytest.mark.parametrize(
    "override, words",
    [
        ("seed=18446744073709551616", "seed: Input should be less than or equal to"),
        ("seed=-9223372036854775809", "seed: Input should be greater than or equal to"),
        ("parallel.cpu_threads=100000000000000000000", "cpu_threads must be 1 to 4,096"),
    ],
)
def test_numbers_torch_cannot_hold_are_refused_with_the_config(override, words):
    with pytest.raises(ConfigError, match=words):
        config.validate(config.apply_overrides(toy.regression_config(), [override]))
    bounds = ["seed=9223372036854775807", "seed=-9223372036854775808", "parallel.cpu_threads=4096"]
    for fine in bounds:
        config.validate(config.apply_overrides(toy.regression_config(), [fine]))


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "[0.9, .nan]"])
def test_an_optimizer_keyword_that_is_not_a_finite_number_is_refused(value):
    from phalanx.build import build_optimizer

    key = "betas" if value.startswith("[") else "lr"
    raw = config.apply_overrides(
        toy.regression_config(optimizer={"class": "Adam", "lr": 0.01}), [f"optimizer.{key}={value}"]
    )
    cfg = config.validate(raw)
    with pytest.raises(ConfigError, match=f"optimizer.{key} is .* not a finite number"):
        build_optimizer(cfg.optimizer, nn.Linear(2, 1), [], batch_size=8)


def test_dataset_keys_name_each_part_once():
    raw = config.apply_overrides(toy.regression_config(), ["dataset.keys=[x, y, x]"])
    with pytest.raises(ConfigError, match="keys names 'x' twice; each part of an item needs"):
        config.validate(raw)


def test_an_optimizer_class_that_is_no_optimizer_is_refused():
    from phalanx.build import build_optimizer

    cfg = config.validate(toy.regression_config(optimizer={"class": "torch.nn.Linear", "lr": 1}))
    with pytest.raises(ConfigError, match="torch.nn.Linear is a Linear, not a torch.optim"):
        build_optimizer(cfg.optimizer, nn.Linear(2, 1), [], batch_size=8)


# --- import_object, instantiate, build_value ---------------------------------------------------


def test_import_object_by_dotted_path_and_from_search_dirs(tmp_path):
    assert construct.import_object("torch.nn.Linear") is nn.Linear
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "unit_config_search_mod.py").write_text("class Thing:\n    pass\n")
    thing = construct.import_object("unit_config_search_mod.Thing", [folder])
    assert thing.__name__ == "Thing" and thing.__module__ == "unit_config_search_mod"


def test_import_object_bad_module():
    with pytest.raises(ConfigError) as info:
        construct.import_object("no_such_package_xyz.models.Net")
    assert "cannot import 'no_such_package_xyz.models'" in str(info.value)


def test_import_object_missing_attribute_suggests_a_name():
    with pytest.raises(ConfigError) as info:
        construct.import_object("torch.nn.Linaer")
    assert "'Linaer'" in str(info.value) and 'did you mean "Linear"' in str(info.value)


def test_import_object_bare_name_needs_a_dot():
    with pytest.raises(ConfigError, match="not a dotted path"):
        construct.import_object("Linear")


def test_import_object_bare_torch_optim_name():
    assert construct.import_object("SGD", default_module="torch.optim") is torch.optim.SGD
    assert (
        construct.import_object("torch.optim.AdamW", default_module="torch.optim")
        is torch.optim.AdamW
    )
    with pytest.raises(ConfigError) as info:
        construct.import_object("SDG", default_module="torch.optim")
    assert "torch.optim has no 'SDG'" in str(info.value) and 'did you mean "SGD"' in str(info.value)


@pytest.mark.parametrize(
    "section, value, key",
    [
        ("model", {"class": "toy.NoSuchNet", "features": 3}, "model.class"),
        ("dataset", {"class": "toy.Regresion", "batch_size": 8}, "dataset.class"),
        ("optimizer", {"class": "SDG", "lr": 0.1}, "optimizer.class"),
        ("scheduler", {"class": "StepLRR", "step_size": 1}, "scheduler.class"),
    ],
)
def test_a_class_that_is_not_there_is_named_by_its_key(tmp_path, section, value, key):
    """Where the run builds it, the error starts with the config key that names it."""
    from phalanx.trainer import Trainer

    raw = toy.regression_config(**{section: value})
    with pytest.raises(ConfigError) as info:
        Trainer(config.validate(raw), tmp_path, [str(Path(toy.__file__).parent)], hooks=[])
    assert str(info.value).startswith(f"{key}: "), str(info.value)


def test_instantiate_bad_keyword_lists_the_valid_ones():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError) as info:
        construct.instantiate("optimizer", torch.optim.SGD, params, lrr=0.1)
    message = str(info.value)
    assert message.startswith("optimizer:")
    assert "'lrr'" in message and 'did you mean "lr"' in message
    for valid in ("lr", "momentum", "weight_decay", "nesterov"):
        assert valid in message


def test_instantiate_missing_argument():
    with pytest.raises(ConfigError) as info:
        construct.instantiate("model", nn.Linear, in_features=3)
    assert "model" in str(info.value) and "out_features" in str(info.value)


def test_instantiate_builds_with_good_arguments():
    layer = construct.instantiate("model", nn.Linear, in_features=3, out_features=2, bias=False)
    assert isinstance(layer, nn.Linear) and layer.weight.shape == (2, 3) and layer.bias is None


def test_instantiate_names_the_section_when_a_constructor_refuses_a_value_with_torchs_error():
    """torch's own checks raise RuntimeError (a negative size): the section and values are named."""
    with pytest.raises(
        ConfigError, match=r"model: .*Linear\(in_features=3, out_features=-5\) failed"
    ):
        construct.instantiate("model", nn.Linear, in_features=3, out_features=-5)


@pytest.mark.parametrize(
    "scheduler, says",
    [
        ({"class": "CosineAnnealingLR", "T_max": 0}, "ZeroDivisionError"),
        ({"class": "CosineAnnealingLR", "T_max": "ten"}, "T_max takes an integer, got the string"),
        ({"class": "ReduceLROnPlateau"}, "steps on a measured value"),
    ],
)
def test_a_scheduler_that_its_first_step_refuses_is_refused_before_the_run(
    tmp_path, scheduler, says
):
    """Found by its own steps, these would end a run after its first epoch with torch's
    traceback; they are refused at the start, before the run directory."""
    from phalanx.trainer import Trainer

    raw = toy.regression_config(
        scheduler={"interval": "step", **scheduler}, optimizer={"warmup_steps": 2}
    )
    with pytest.raises(ConfigError, match=f"scheduler: .*{says}"):
        Trainer(config.validate(raw), tmp_path, [str(Path(toy.__file__).parent)])
    assert not list(tmp_path.iterdir())


def test_a_schedule_shorter_than_the_run_ends_it_in_one_line_where_it_runs_out(tmp_path):
    """OneCycleLR's total_steps below the run's steps: the run may be meant to stop first (a
    StopAfter, `phalanx bench`), so it is not refused at the start; the step it runs out at ends
    the run with a config error that says what to give, its checkpoints kept."""
    from phalanx.trainer import Trainer

    scheduler = {"class": "OneCycleLR", "max_lr": 0.1, "total_steps": 7, "interval": "step"}
    trainer = Trainer(
        config.validate(toy.regression_config(scheduler=scheduler)),
        tmp_path,
        [str(Path(toy.__file__).parent)],
    )
    with pytest.raises(ConfigError, match=r"OneCycleLR refused its step \(Tried to step 8 times"):
        trainer.run()
    assert trainer.step == 7 and trainer.checkpoints.steps() == [5]  # the 8th did not end


def test_schedulers_that_the_trial_must_not_refuse_or_change(tmp_path):
    """A one-step cycle (the trial takes one step); an optimizer whose learning rate is a tensor
    (a step writes it in place: the trial's must not reach the real one); a scheduler of the
    user's own, whose steps may do more than the optimizer's (not tried)."""
    from phalanx.build import _try_schedule
    from phalanx.trainer import Trainer

    scheduler = {"class": "OneCycleLR", "max_lr": 0.1, "total_steps": 1, "interval": "epoch"}
    raw = toy.regression_config(scheduler=scheduler, main_loop={"epochs": 1})
    Trainer(config.validate(raw), tmp_path, [str(Path(toy.__file__).parent)])
    cfg = config.validate(toy.regression_config(scheduler={"class": "StepLR", "step_size": 1}))
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    _try_schedule(cfg, torch.optim.lr_scheduler.StepLR, optimizer, {"step_size": 1, "gamma": 0.5})
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.1)

    class Counting(torch.optim.lr_scheduler.LRScheduler):
        steps = 0

        def step(self, epoch=None):
            Counting.steps += 1
            raise RuntimeError("a step of the user's own")

    _try_schedule(cfg, Counting, optimizer, {})
    assert Counting.steps == 0


def test_a_scheduler_as_long_as_the_run_is_not_refused(tmp_path):
    from phalanx.trainer import Trainer

    for total in ("auto", 10):
        scheduler = {"class": "OneCycleLR", "max_lr": 0.1, "total_steps": total, "interval": "step"}
        cfg = config.validate(toy.regression_config(scheduler=scheduler))
        (tmp_path / str(total)).mkdir()
        trainer = Trainer(cfg, tmp_path / str(total), [str(Path(toy.__file__).parent)])
        assert trainer.run() == 0 and trainer.step == 10


def test_build_value_builds_nested_class_mappings():
    spec = {
        "class": "torch.nn.Sequential",
        "args": [
            {"class": "torch.nn.Linear", "in_features": 3, "out_features": 5},
            {"class": "torch.nn.Tanh"},
            {"class": "torch.nn.Linear", "in_features": 5, "out_features": 1, "bias": False},
        ],
    }
    built = construct.build_value(spec, "model.net", [])
    assert isinstance(built, nn.Sequential) and len(built) == 3
    assert isinstance(built[0], nn.Linear) and built[0].weight.shape == (5, 3)
    assert isinstance(built[1], nn.Tanh)
    assert built[2].bias is None
    plain = construct.build_value({"a": [1, {"b": 2}], "c": "torch.nn.Linear"}, "x", [])
    assert plain == {"a": [1, {"b": 2}], "c": "torch.nn.Linear"}


def test_build_value_nested_error_names_where():
    spec = {
        "class": "torch.nn.Sequential",
        "args": [{"class": "torch.nn.Linear", "in_feat": 3, "out_features": 1}],
    }
    with pytest.raises(ConfigError) as info:
        construct.build_value(spec, "model.net", [])
    assert "model.net.args.0" in str(info.value) and "'in_feat'" in str(info.value)


def test_a_config_inside_its_package_finds_the_package_from_any_working_directory(
    tmp_path, monkeypatch
):
    """A config at <root>/zoo_pkg/models/config.yaml naming zoo_pkg.models.net.Net imports it with
    the working directory elsewhere: the package's root is found from the config's folder."""
    folder = tmp_path / "root" / "zoo_pkg" / "models"
    folder.mkdir(parents=True)
    (folder / "net.py").write_text("class Net:\n    pass\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert construct.import_object("zoo_pkg.models.net.Net", [folder]).__name__ == "Net"
    with pytest.raises(ConfigError, match="cannot import 'zoo_pkg.other'"):
        construct.import_object("zoo_pkg.other.Thing", [folder])


@pytest.mark.parametrize(
    "section, raw",
    [
        ("hooks.0.StopAfter", {"hooks": [{"StopAfter": {"epochs": True}}]}),
        ("hooks.0.SaveEvery", {"hooks": [{"SaveEvery": {"steps": False}}]}),
        ("optimizer", {"optimizer": {"class": "SGD", "lr": True}}),
    ],
)
def test_a_boolean_for_a_constructor_number_is_an_error(section, raw):
    """Constructor keywords are not in the schema; their annotations say which take numbers."""
    from phalanx.build import build_optimizer
    from phalanx.hooks import build_hooks

    cfg = config.validate(toy.regression_config(**raw))
    with pytest.raises(ConfigError, match=f"{section}: .* takes a number, got (true|false)"):
        build_hooks(cfg, []) if "hooks" in raw else build_optimizer(
            cfg.optimizer, torch.nn.Linear(3, 1), [], 8
        )


def test_the_gpu_switches_reach_torch():
    """cudnn_benchmark and matmul_precision are set when the run is built (they act on GPUs)."""
    from phalanx.trainer import Trainer

    raw = toy.regression_config(cudnn_benchmark=True, matmul_precision="high", hooks=[])
    try:
        Trainer(config.validate(raw), None, [Path(toy.__file__).parent])
        assert (
            torch.backends.cudnn.benchmark is True
            and torch.get_float32_matmul_precision() == "high"
        )
        Trainer(config.validate(toy.regression_config(hooks=[])), None, [Path(toy.__file__).parent])
        assert (
            torch.backends.cudnn.benchmark is False
            and torch.get_float32_matmul_precision() == "highest"
        )
    finally:
        torch.backends.cudnn.benchmark = False
        torch.set_float32_matmul_precision("highest")
    with pytest.raises(ConfigError, match="matmul_precision"):
        config.validate(toy.regression_config(matmul_precision="fast"))


def test_the_dataloader_options_reach_the_loader():
    from phalanx.trainer import Trainer

    search = [Path(toy.__file__).parent]
    raw = toy.regression_config(
        dataset={
            "class": "toy.Regression",
            "batch_size": 8,
            "num_workers": 1,
            "prefetch_factor": 4,
            "pin_memory": False,
        },
        hooks=[],
    )
    trainer = Trainer(config.validate(raw), None, search)
    assert trainer.feed.loader_options == {
        "num_workers": 1,
        "pin_memory": False,
        "prefetch_factor": 4,
    }
    assert trainer.run() == 0  # a worker process that prepares 4 batches ahead
    raw["dataset"]["num_workers"] = 0
    with pytest.raises(ConfigError, match="dataset.prefetch_factor=4 is for DataLoader workers"):
        Trainer(config.validate(raw), None, search)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_workers", "past", r"num_workers=\d+ would start \d+ loader processes .* or fewer"),
        ("num_workers", 1000, r"num_workers=1000 .* CPU core\(s\); give \d+ or fewer"),
        ("prefetch_factor", 10**9, r"prefetch_factor=1000000000 .*; give 1 to 64"),
    ],
    ids=["workers-one-past", "workers-1000", "prefetch-1e9"],
)
def test_loader_workers_and_batches_ahead_are_bounded_by_the_config_check(key, value, message):
    """A thousand workers would all be forked before anything stopped them: the config's check,
    the first thing a run does, refuses it in one error (only the check runs here: a regression
    must not fork them in the test)."""
    from phalanx.environment import cpu_cores

    most = max(32, 4 * cpu_cores())
    dataset = {"class": "toy.Regression", "batch_size": 8, "num_workers": most}
    assert config.validate(toy.regression_config(dataset=dataset)).dataset.num_workers == most
    dataset[key] = most + 1 if value == "past" else value
    with pytest.raises(ConfigError, match=f"^dataset.{key}: .*{message}") as refused:
        config.validate(toy.regression_config(dataset=dataset))
    assert "\n" not in str(refused.value)


def test_the_constructor_decides_which_keywords_it_takes():
    """A signature is a hint: transformers' configs take keywords their signatures do not name."""
    import transformers

    built = construct.build_value(
        {"class": "transformers.BertConfig", "num_labels": 3, "hidden_size": 32},
        "model.config",
        [],
    )
    assert isinstance(built, transformers.BertConfig) and built.num_labels == 3

    class Narrow:  # declares one keyword, takes any
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    Narrow.__signature__ = inspect.Signature(
        [inspect.Parameter("size", inspect.Parameter.KEYWORD_ONLY)]
    )
    assert construct.instantiate("model", Narrow, size=1, extra=2).kwargs == {"size": 1, "extra": 2}


def test_a_keyword_the_constructor_refuses_is_one_did_you_mean_line():
    with pytest.raises(ConfigError) as info:
        construct.instantiate("model", nn.Linear, in_features=3, out_featurs=2)
    message = str(info.value)
    assert message.startswith("model: Linear takes no argument 'out_featurs'")
    assert 'did you mean "out_features"' in message and "in_features, out_features" in message


def test_a_fraction_for_an_integer_is_an_error_before_the_call():
    built = []

    class Blocks:
        def __init__(self, block_size: int, scale: float = 1.0, heads: int | None = None):
            built.append(block_size)

    with pytest.raises(ConfigError, match="model: .*Blocks's block_size takes an integer, got 8.5"):
        construct.instantiate("model", Blocks, block_size=8.5)
    with pytest.raises(ConfigError, match="heads takes an integer, got 2.0"):
        construct.instantiate("model", Blocks, block_size=8, heads=2.0)
    assert built == []
    construct.instantiate("model", Blocks, block_size=8, scale=2)  # an int for a float is fine
    assert built == [8]


def test_a_string_for_a_number_is_an_error_before_the_call():
    """A quoted number, or a word, where the constructor takes only a number; a string is taken
    where the annotation also names one (or names nothing)."""
    built = []

    class Blocks:
        def __init__(self, size: int, scale: float = 1.0, mode: int | str = 0, free=None):
            built.append(size)

    with pytest.raises(ConfigError, match="Blocks's size takes an integer, got the string '8'"):
        construct.instantiate("model", Blocks, size="8")
    with pytest.raises(ConfigError, match="Blocks's scale takes a number, got the string 'half'"):
        construct.instantiate("model", Blocks, size=8, scale="half")
    assert built == []
    construct.instantiate("model", Blocks, size=8, mode="auto", free="anything")
    assert built == [8]


def test_a_yaml_alias_bomb_and_deep_nesting_are_refused_quickly(tmp_path):
    path = toy.write_config(tmp_path, toy.regression_config())
    levels = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 12)
    )
    (tmp_path / "bomb.yaml").write_text(path.read_text() + levels)  # 10**12 values
    with pytest.raises(ConfigError, match="bomb.yaml is refused: it expands to more than 200,000"):
        config.load(tmp_path / "bomb.yaml")
    (tmp_path / "deep.yaml").write_text("model: " + "{a: " * 70 + "1" + "}" * 70 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml is refused: it is nested more than 64"):
        config.load(tmp_path / "deep.yaml")
    shared = {"x": list(range(1000))}
    raw = {**toy.regression_config(), "model": {"class": "toy.Linear", "a": [shared] * 300}}
    with pytest.raises(ConfigError, match="the config is refused: it expands"):
        config.validate(raw)  # a dict from Python is bounded too
    loop: list = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="holds itself"):
        config.validate({**raw, "model": {"class": "toy.Linear", "a": loop}})


def test_a_key_given_twice_is_one_error_naming_it_and_its_lines(tmp_path):
    """YAML's loaders keep the last of two equal keys, silently: the first lr would be lost."""
    (tmp_path / "twice.yaml").write_text(
        "name: toy\noptimizer:\n  class: SGD\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.01\n"
    )
    with pytest.raises(ConfigError) as info:
        config.load(tmp_path / "twice.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'twice.yaml'} is refused: the key 'lr' is given twice in one mapping, on "
        "lines 4 and 6; keep one of them"
    )
    with pytest.raises(ConfigError, match="the key 'a' is given twice in one mapping"):
        config.apply_overrides({"model": {}}, ["model.extra={a: 1, a: 2}"])
    # a merge's keys may be given again: that is what a merge is for
    merged = "base: &base {lr: 0.1, momentum: 0.9}\noptimizer:\n  <<: *base\n  lr: 0.01\n"
    (tmp_path / "merged.yaml").write_text(merged)
    assert yaml.safe_load(merged)["optimizer"] == {"lr": 0.01, "momentum": 0.9}
    assert config.read_yaml(tmp_path / "merged.yaml", "")["optimizer"] == {
        "lr": 0.01,
        "momentum": 0.9,
    }


@pytest.mark.parametrize(
    ("schedule", "given", "held", "refused"),
    [
        ("1f1b", None, 1, None),
        ("gpipe", 2, None, "schedule gpipe runs one stage per process"),
        ("interleaved", None, 2, None),
        ("zero_bubble", 3, 3, None),
        ("zbv", None, 2, None),
        ("dualpipev", 2, 2, None),
        ("zbv", 3, None, "schedule zbv runs two stages per process, in a V"),
    ],
)
def test_each_schedule_holds_its_stages_per_process(schedule, given, held, refused):
    pipeline = {"split": ["net.2"], "schedule": schedule}
    if given is not None:
        pipeline["stages_per_process"] = given
    raw = toy.regression_config(parallel={"strategy": "pipeline", "pipeline": pipeline})
    if refused:
        assert refused in _error(raw)
    else:
        assert config.validate(raw).parallel.pipeline.stages_per_process == held


def test_split_auto_may_name_its_stage_count_and_a_list_may_not():
    pipeline = {"split": "auto", "stages": 3}
    raw = toy.regression_config(parallel={"strategy": "pipeline", "pipeline": pipeline})
    assert config.validate(raw).parallel.pipeline.stages == 3
    raw["parallel"]["pipeline"] = {"split": ["net.2"], "stages": 3}
    assert "stages goes with split: auto" in _error(raw)
    raw["parallel"]["pipeline"] = {"split": "balanced"}
    assert "parallel.pipeline.split" in _error(raw)


def test_a_strategy_registers_its_own_section_checked_as_every_section(monkeypatch):
    """`parallel.<strategy>` is whatever type the strategy registered: validated, with its
    defaults, and an unknown key in it or beside it is a did-you-mean error."""
    from pydantic import Field, StrictInt

    from phalanx import settings
    from phalanx.strategies import registry
    from phalanx.strategies.single import build

    class Rings(settings.StrategySettings):
        rings: StrictInt = Field(2, ge=1)

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry.families()))
    registry.register(
        registry.Family("ring", build, "a ring", settings=Rings, field=Field(default_factory=Rings))
    )
    raw = toy.regression_config(parallel={"strategy": "ring", "ring": {"rings": 3}})
    assert config.validate(raw).parallel.section("ring", Rings).rings == 3
    assert config.validate(toy.regression_config()).parallel.section("ring", Rings).rings == 2
    raw["parallel"]["ring"] = {"ringz": 3}
    assert """unknown key 'parallel.ring.ringz' (did you mean "rings"?)""" in _error(raw)
    raw["parallel"] = {"rign": {"rings": 3}}
    assert """unknown key 'parallel.rign' (did you mean "ring"?)""" in _error(raw)
    del registry.families()["ring"]
    assert "unknown key 'parallel.ring'" in _error(
        toy.regression_config(parallel={"ring": {"rings": 3}})
    )


def test_gradient_accumulation_is_a_count_or_auto_which_a_run_resolves():
    cfg = config.validate(toy.regression_config(parallel={"gradient_accumulation": "auto"}))
    with pytest.raises(config.ConfigError, match="gradient_accumulation=auto is chosen when"):
        cfg.parallel.accumulation  # noqa: B018 - what every consumer reads
    assert (
        config.validate(
            toy.regression_config(parallel={"gradient_accumulation": 3})
        ).parallel.accumulation
        == 3
    )
    message = _error(toy.regression_config(parallel={"gradient_accumulation": 0}))
    assert "gradient_accumulation" in message and "1 or more, or auto" in message
    message = _error(toy.regression_config(parallel={"device_memory_gb": -1.0}))
    assert "parallel.device_memory_gb" in message
