"""Where the pipeline strategy splits a model, found by one forward of it: the chain of blocks, the
modules before and after it, and the splits it refuses with a line that names the valid ones."""

from __future__ import annotations

import pytest
import torch
import toy
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.cutting import Active, keep_stages, probe

pytestmark = pytest.mark.timeout(60)


class Tower(nn.Module):
    """embed -> blocks (a ModuleList called in a loop) -> head, the loss per sample."""

    def __init__(self, residual: bool = False, tied: bool = False):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        self.head = self.embed if tied else nn.Linear(4, 1)
        self.residual, self.tied = residual, tied

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) + h if self.residual else block(h)
        out = (self.embed(h[:, :3]) if self.tied else self.head(h)).sum(-1)
        return {"loss": (out - y) ** 2}


def call(model: nn.Module):
    return lambda batch: model(batch["x"], batch["y"])


BATCH = {"x": torch.randn(5, 3), "y": torch.randn(5)}
CPU = torch.device("cpu")


def test_the_probe_finds_the_blocks_the_modules_around_them_and_the_activations_shapes():
    model = Tower()
    split = probe(model, call(model), BATCH, ["blocks.1"], 2)
    assert (split.trunk, split.cuts, split.size) == ("blocks", [1], 3)
    assert (split.before, split.after) == (["embed"], ["head"])
    assert split.shapes == [(torch.Size([5, 4]), torch.float32)]


def test_each_stage_keeps_its_modules_and_the_stages_together_compute_the_model():
    torch.manual_seed(0)
    whole = Tower()
    want = whole(BATCH["x"], BATCH["y"])["loss"]
    split = probe(whole, call(whole), BATCH, ["blocks.2"], 2)
    first, last = Tower(), Tower()
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    a, b = Active(lo=0, hi=2, stage=0), Active(lo=2, hi=3, stage=1)
    keep_stages(first, split, [0], 2, a, torch.device("cpu"))
    keep_stages(last, split, [1], 2, b, torch.device("cpu"))
    assert sorted(first.state_dict()) == [
        "blocks.0.0.bias", "blocks.0.0.weight", "blocks.1.0.bias", "blocks.1.0.weight",
        "embed.bias", "embed.weight",
    ]  # fmt: skip
    assert sorted(last.state_dict()) == [
        "blocks.2.0.bias", "blocks.2.0.weight", "head.bias", "head.weight"
    ]  # fmt: skip
    from phalanx.strategies.cutting import Cut

    with pytest.raises(Cut) as cut:
        first(BATCH["x"], BATCH["y"])
    b.received = cut.value.activation
    assert torch.equal(last(BATCH["x"], BATCH["y"])["loss"], want)


class Chain(nn.Module):
    """embed -> blocks (an nn.Sequential called whole, or looped over; `whole=None`: whole when
    evaluating, looped over when training) -> head."""

    def __init__(self, whole: bool | None):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
        self.head = nn.Linear(4, 1)
        self.whole = whole

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        if self.whole or (self.whole is None and not self.training):
            h = self.blocks(h)
        else:
            for block in self.blocks:
                h = block(h)
        return {"loss": (self.head(h).sum(-1) - y) ** 2}


@pytest.mark.parametrize(
    ("whole", "probed"),
    [(True, True), (False, False), (None, True)],
    ids=["called-whole", "looped-over", "whole-in-evaluation-looped-over-in-training"],
)
def test_a_sequential_called_whole_runs_each_stages_blocks_alone(whole, probed):
    """Called whole, the trunk runs the stage's blocks and never calls another stage's; looped
    over, the model's loop calls every block and those of other stages pass their input on. Both
    compute the model, also where the probe (evaluating) saw it called whole and training loops
    over it."""
    from phalanx.strategies.cutting import Cut

    torch.manual_seed(0)
    model = Chain(whole)
    want = model(BATCH["x"], BATCH["y"])["loss"]
    split = probe(model, call(model), BATCH, ["blocks.1"], 2)
    assert split.whole is probed
    first, last = Chain(whole), Chain(whole)
    first.load_state_dict(model.state_dict())
    last.load_state_dict(model.state_dict())
    a, b = Active(lo=0, hi=1, stage=0), Active(lo=1, hi=3, stage=1)
    keep_stages(first, split, [0], 2, a, torch.device("cpu"))
    keep_stages(last, split, [1], 2, b, torch.device("cpu"))
    called: list[int] = []
    for i, block in enumerate(last.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: called.append(i))
    with pytest.raises(Cut) as cut:
        first(BATCH["x"], BATCH["y"])
    b.received = cut.value.activation
    assert torch.equal(last(BATCH["x"], BATCH["y"])["loss"], want)
    assert called == ([1, 2] if whole else [0, 1, 2])


def test_a_trunk_with_a_forward_of_its_own_is_not_run_whole():
    """A wrapper's forward on the trunk (activation checkpointing puts one there) would be lost
    to the stage's own: such a trunk keeps the per-block path."""
    model = Chain(True)
    plain = model.blocks.forward
    model.blocks.forward = lambda h: plain(h)  # type: ignore[method-assign]
    assert probe(model, call(model), BATCH, ["blocks.1"], 2).whole is False


def test_a_steps_outputs_join_when_read_and_index_as_a_list_does():
    from phalanx.strategies.padding import Joined

    a, b = {"loss": torch.tensor([1.0])}, {"loss": torch.tensor([2.0])}
    joined = Joined([[a, b], None])
    assert len(joined) == 2 and joined[1] is None and joined[-1] is None
    assert torch.equal(joined[0]["loss"], torch.tensor([1.0, 2.0])) and joined[0] is joined[-2]
    assert joined[:1] == [joined[0]] and list(joined) == [joined[0], None]
    for outside in (2, -3):
        with pytest.raises(IndexError):
            joined[outside]


def test_a_name_that_is_not_a_block_is_an_error_that_lists_the_blocks():
    model = Tower()
    with pytest.raises(ConfigError, match=r"'head'.*blocks\.1, blocks\.2"):
        probe(model, call(model), BATCH, ["head"], 2)


def test_a_split_where_the_forward_adds_to_the_blocks_output_is_an_error():
    model = Tower(residual=True)
    with pytest.raises(ConfigError, match="does not pass one tensor from blocks.0 to it"):
        probe(model, call(model), BATCH, ["blocks.1"], 2)


def test_a_module_used_before_and_after_the_blocks_is_an_error_naming_it():
    model = Tower(tied=True)
    with pytest.raises(ConfigError, match="cannot place embed"):
        probe(model, call(model), BATCH, ["blocks.1"], 2)


def test_a_parameter_the_model_holds_itself_is_an_error():
    model = toy.Scaled(features=3)
    model.net = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    with pytest.raises(ConfigError, match=r"holds \['scale'\] itself"):
        probe(model, call(model), BATCH, ["net.2"], 2)


# --- split: auto ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "stages", "valid", "holds", "cuts"),
    [
        ([1, 1, 1, 1], 2, {1, 2, 3}, [True] * 4, [2]),
        ([8, 1, 1, 1, 1], 2, {1, 2, 3, 4}, [True] * 5, [1]),
        ([1, 1, 1, 1, 1, 1], 3, {1, 2, 3, 4, 5}, [True] * 6, [2, 4]),
        ([1, 1, 1, 1], 2, {1, 3}, [True] * 4, [1]),  # 2 is no valid point: 1 | 3 and 3 | 1 tie
        ([1, 5, 1, 1], 2, {1, 2, 3}, [True, False, True, True], [2]),  # [1] alone would be 1 | 7
        ([4, 1, 1], 2, {1, 2}, [False, True, True], [2]),  # block 0 holds nothing: not alone
        ([1, 1], 3, {1}, [True, True], None),  # two blocks make no three stages
        ([1, 1, 1], 2, {1, 2}, [False, False, True], None),  # one block holds all the parameters
    ],
)
def test_auto_cuts_the_slowest_stage_as_short_as_it_can_be(times, stages, valid, holds, cuts):
    from phalanx.costs import partition

    assert partition([float(t) for t in times], stages, valid, holds) == cuts


class Lopsided(nn.Module):
    """A chain whose first block is far slower than the others, then a loss per sample."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Sequential(
                nn.Linear(3, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)
            ),
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            nn.Linear(4, 1),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x).squeeze(1) - y) ** 2}


def test_auto_times_the_blocks_on_copies_and_isolates_the_slow_one(monkeypatch):
    import time
    from types import SimpleNamespace

    from phalanx.strategies import cutting
    from phalanx.strategies.cutting import balance

    # timed by this thread's CPU: a busy machine's pauses in a small block's timing would make it
    # look as slow as the large one (wall time is what a run measures, on a machine it has alone)
    monkeypatch.setattr(cutting, "time", SimpleNamespace(perf_counter=time.thread_time))
    torch.manual_seed(0)
    model = Lopsided()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"x": torch.randn(256, 3), "y": torch.randn(256)}
    before = torch.random.get_rng_state()
    names, times = balance(model, call(model), batch, 2, lambda t: t)
    assert names == ["net.1"] and len(times) == 4
    assert times[0] > max(times[1:])
    assert torch.equal(torch.random.get_rng_state(), before)  # the random numbers are untouched
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_auto_without_a_chain_long_enough_says_to_name_the_points():
    model = Tower()
    with pytest.raises(ConfigError, match="none of 5 blocks or more; name the split points"):
        from phalanx.strategies.cutting import balance

        balance(model, call(model), BATCH, 5, lambda t: t)


def test_the_models_own_error_is_taken_from_the_stages_wrapper():
    """torch's stage wraps a module's error in one whose message is the stage's arguments: the
    step raises the module's own instead; any other error is left as it is."""
    from phalanx.strategies.stages import stage_error

    own = ValueError("the block's own mistake")
    try:
        try:
            raise own
        except ValueError as e:
            raise RuntimeError(
                "\n            [Stage 1] failed to run forward:\n            args: ('Tensor',)"
            ) from e
    except RuntimeError as wrapped:
        assert stage_error(wrapped) is own
    other = RuntimeError("[Stage 1] something else")
    assert stage_error(other) is other
    plain = RuntimeError("a shape mismatch")
    plain.__cause__ = own
    assert stage_error(plain) is plain


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (
            torch.tensor(1.0),
            r"loss per sample \(a vector of the batch's size, 5\), but it returned one of shape "
            r"\(\)",
        ),
        (torch.ones(4), r"size, 5\), but it returned one of shape \(4,\)"),
        ("1.0", "the model's 'loss' is a str, not a tensor"),
    ],
    ids=["a-mean", "another-length", "not-a-tensor"],
)
def test_a_last_stage_whose_loss_is_not_one_per_sample_is_an_error_that_says_so(loss, message):
    from phalanx.errors import ModelError
    from phalanx.precision import Precision
    from phalanx.strategies.stages import Stage

    active = Active(lo=0, hi=1, stage=0)
    stage = Stage([], (0, 1, 0), lambda batch: {"loss": loss}, active, Precision("fp32", CPU))
    active.batch, active.rows = BATCH, 5
    with pytest.raises(ModelError, match=message):
        stage()


def test_a_last_stages_outputs_are_kept_detached_with_the_batch_for_the_hooks():
    from phalanx.precision import Precision
    from phalanx.strategies.stages import Stage

    weight = torch.ones(3, requires_grad=True)
    active = Active(lo=0, hi=1, stage=0)

    def forward(batch: dict) -> dict:
        prediction = batch["x"] @ weight
        return {"prediction": prediction, "loss": (prediction - batch["y"]) ** 2, "name": "kept"}

    stage = Stage([], (0, 1, 0), forward, active, Precision("fp32", CPU))
    active.batch, active.rows = BATCH, 5
    loss = stage()
    assert loss.requires_grad and loss.shape == (5,)  # the schedule's, to back-propagate
    (kept,) = active.captured
    assert set(kept) == {"x", "y", "prediction", "loss", "name"} and kept["name"] == "kept"
    assert not kept["prediction"].requires_grad and not kept["loss"].requires_grad
    assert torch.equal(kept["loss"], loss.detach()) and kept["x"] is BATCH["x"]
