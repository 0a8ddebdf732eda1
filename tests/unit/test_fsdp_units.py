"""Which parts of a model `fsdp` shards as units of their own by default (no processes needed)."""

from __future__ import annotations

import blocks
import pytest
import toy
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.fsdp import find_shard_units

pytestmark = pytest.mark.timeout(60)


def names(model: nn.Module, classes: list[str] | None = None) -> list[str]:
    where = {id(m): name for name, m in model.named_modules()}
    return sorted(where[id(unit)] for unit in find_shard_units(model, classes))


def test_each_block_of_a_module_list_or_sequential_is_a_unit_then_the_other_parts():
    parts = ["blocks.0", "blocks.1", "blocks.2", "embed", "head", "norm"]
    assert names(blocks.TinyTransformer()) == parts
    assert names(blocks.TinyTransformer(sequential=True)) == parts
    # a Sequential's layers, each a unit; its Tanh holds no parameters
    assert names(toy.Linear(hidden=4)) == ["net.0", "net.2"]


def test_tied_parts_stay_with_the_root():
    assert names(blocks.TinyTransformer(tied=True)) == ["blocks.0", "blocks.1", "blocks.2", "norm"]


def test_named_classes_and_the_model_as_one_unit():
    assert names(blocks.TinyTransformer(), ["Block"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(blocks.TinyTransformer(), []) == []
    with pytest.raises(
        ConfigError, match="names ModuleDict, ModuleList: a container that is never"
    ):
        find_shard_units(blocks.TinyTransformer(), ["ModuleList", "ModuleDict"])


def test_blocks_are_found_inside_a_wrapper_as_in_a_hugging_face_model():
    """GPT-2: its blocks sit in `transformer.h`, and its head is tied to the token embedding."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    assert names(transformers.GPT2LMHeadModel(config)) == [
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "transformer.wpe",
    ]
