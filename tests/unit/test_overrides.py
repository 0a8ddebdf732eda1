"""Overrides beyond KEY=VALUE: list items named by their name, `+` to append or add, `~` to delete,
and the default hooks edited where a config lists none."""

from __future__ import annotations

import pytest
import toy

from phalanx import config, overrides
from phalanx.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _apply(*items: str, **sections) -> dict:
    return config.apply_overrides(toy.regression_config(**sections), list(items))


def test_a_hook_is_named_by_its_name_as_well_as_its_index():
    raw = toy.regression_config(hooks=["SaveLatest", {"StopAfter": {"epochs": 2}}])
    by_name = config.apply_overrides(raw, ["hooks.StopAfter.epochs=5"])
    by_index = config.apply_overrides(raw, ["hooks.1.StopAfter.epochs=5"])
    assert by_name["hooks"] == by_index["hooks"] == ["SaveLatest", {"StopAfter": {"epochs": 5}}]
    assert raw["hooks"][1] == {"StopAfter": {"epochs": 2}}  # the given config is not changed


def test_a_hook_given_by_name_alone_takes_keys_by_name_or_index():
    for key in ("hooks.SaveLatest.every_n_steps", "hooks.2.SaveLatest.every_n_steps"):
        out = _apply(f"{key}=4")
        assert out["hooks"][2] == {"SaveLatest": {"every_n_steps": 4}}
        config.validate(out)


def test_plus_appends_to_a_list_and_adds_a_key_that_is_not_set():
    out = _apply("+hooks={StopAfter: {steps: 3}}", "+main_loop.extra_streams=test", "+profile={}")
    assert out["hooks"][-1] == {"StopAfter": {"steps": 3}}
    assert out["main_loop"]["extra_streams"] == ["valid", "test"]
    assert out["profile"] == {}
    assert config.validate(out).hooks[-1] == {"StopAfter": {"steps": 3}}


def test_plus_on_a_set_value_that_is_not_a_list_is_refused():
    with pytest.raises(
        ConfigError, match=r"main_loop.epochs is set already \(2\).*main_loop.epochs="
    ):
        _apply("+main_loop.epochs=3")


def test_tilde_deletes_a_hook_by_name_or_index_and_a_key():
    out = _apply("~hooks.LogVariables", "~hooks.0", "~main_loop.extra_streams")
    assert out["hooks"] == ["SaveLatest"]
    assert "extra_streams" not in out["main_loop"]
    out = _apply("~hooks.ComputeStats.variables")
    assert out["hooks"][0] == {"ComputeStats": {}}


@pytest.mark.parametrize(
    "item, words",
    [
        (
            "~hooks.StopAfter",
            ["hooks has no item 'StopAfter'", "ComputeStats, LogVariables", "+hooks="],
        ),
        ("~main_loop.max_epochs", ["no 'main_loop.max_epochs' to delete"]),
        ("~hooks.0=1", ["takes no value"]),
        ("hooks.first.x=1", ["hooks has no item 'first'", "by its index, 0 to 2"]),
        ("a..b=1", ["empty part"]),
    ],
)
def test_bad_edits_name_the_problem(item, words):
    with pytest.raises(ConfigError) as info:
        _apply(item)
    for word in [item, *words]:
        assert word in str(info.value)


def test_a_name_that_two_items_share_needs_the_index():
    raw = toy.regression_config(hooks=["SaveLatest", {"SaveBest": None}, "SaveLatest"])
    with pytest.raises(
        ConfigError, match=r"2 items named 'SaveLatest' \(at 0, 2\).*hooks\.0\.SaveLatest"
    ):
        config.apply_overrides(raw, ["~hooks.SaveLatest"])


def test_editing_the_hooks_of_a_config_without_hooks_edits_the_default_ones():
    raw = toy.regression_config()
    del raw["hooks"]
    defaults = overrides.default_hooks(raw["main_loop"]["extra_streams"])
    added = config.apply_overrides(raw, ["+hooks=StopOnNaN"])
    assert added["hooks"] == [*defaults, "StopOnNaN"]
    assert any(h == {"SaveBest": {"variable": "valid.loss", "mode": "min"}} for h in defaults)
    dropped = config.apply_overrides(raw, ["~hooks.LogThroughput"])
    assert dropped["hooks"] == [h for h in defaults if h != "LogThroughput"]
    assert config.apply_overrides(raw, ["hooks=[SaveLatest]"])["hooks"] == ["SaveLatest"]


def test_one_string_is_one_override_and_other_types_are_refused():
    assert config.apply_overrides({"a": 1}, "b.c=2") == {"a": 1, "b": {"c": 2}}
    with pytest.raises(ConfigError, match="override 3 is a int; give strings"):
        config.apply_overrides({"a": 1}, [3])
