"""Training driven from Python through the Trainer's public methods: epochs begun, trained and ended
by the caller train exactly what run() trains, with the same hook events; a step's outputs handed to
the hooks reach them as the loop's do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import toy

from phalanx import batching, config, data
from phalanx.hooks import Hook, TrainingTerminated
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
TESTS = toy.__file__.rsplit("/", 1)[0]


class Record(Hook):
    """Every event, with what the hook sees of the run at it."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def before_training(self) -> None:
        self.events.append(("before_training",))

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        loss = batch["loss"].detach().clone()
        self.events.append(("after_batch", stream, self.trainer.training, self.trainer.step, loss))

    def after_epoch(self, epoch: int, epoch_data: dict[str, dict[str, Any]]) -> None:
        self.events.append(("after_epoch", epoch, self.trainer.step))

    def after_training(self, success: bool) -> None:
        self.events.append(("after_training", success))


class Stop(Hook):
    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        raise TrainingTerminated("enough")


def _trainer(hooks: list[Hook]) -> Trainer:
    raw = toy.regression_config(
        main_loop={"epochs": 2, "extra_streams": ["valid"], "skip_zeroth_epoch": True}, hooks=[]
    )
    return Trainer(config.validate(raw), None, [TESTS], hooks=hooks)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Whether two event lists are equal, tensors and all."""
    return len(a) == len(b) and all(
        len(x) == len(y)
        and all(
            torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
            for u, v in zip(x, y, strict=True)
        )
        for x, y in zip(a, b, strict=True)
    )


def test_epochs_driven_from_python_train_what_run_trains():
    ran = Record()
    reference = _trainer([ran])
    assert reference.run() == 0
    driven, seen = _trainer([]), Record()
    driven.add_hook(seen)  # added to a built trainer: called at every event all the same
    driven.begin_training()
    for _ in range(2):
        driven.train_epoch()
    assert driven.end_training()
    assert (driven.epoch, driven.step) == (reference.epoch, reference.step) == (2, 10)
    weights, expected = _weights(driven), _weights(reference)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert _same(seen.events, ran.events)
    kinds = [e[0] for e in seen.events]
    assert kinds[0] == "before_training" and kinds[-1] == "after_training"
    assert [e[1] for e in seen.events if e[0] == "after_epoch"] == [1, 2]
    assert {(e[1], e[2]) for e in seen.events if e[0] == "after_batch"} == {
        ("train", True),
        ("valid", False),
    }


def test_an_epoch_without_its_end_trains_the_same_steps_and_calls_no_epoch_hook():
    whole, steps_only = Record(), Record()
    ended, bare = _trainer([whole]), _trainer([steps_only])
    for _ in range(2):
        ended.train_epoch()
        bare.train_epoch(end=False)
    assert bare.epoch == ended.epoch == 2 and bare.step_in_epoch == 0
    weights, expected = _weights(bare), _weights(ended)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    trained = [e for e in whole.events if e[0] == "after_batch" and e[1] == "train"]
    assert len(trained) == 10 and _same(steps_only.events, trained)


def test_a_step_handed_to_the_hooks_reaches_them_as_the_loops_do():
    seen = Record()
    trainer = _trainer([seen])
    stream = data.get_stream(trainer.dataset, "train")
    plan = data.Plan(range(len(stream)), 8)
    fetched = [(m, batching.collate([stream[i] for i in m.shard])) for m in plan.step(0)]
    outcome = trainer.train_step(fetched)
    trainer.call_after_batch("train", outcome.parts, training=True)
    outputs = trainer.eval_step(fetched[0][1])
    trainer.call_after_batch("valid", [outputs], training=False)
    assert [e[:3] for e in seen.events] == [
        ("after_batch", "train", True),
        ("after_batch", "valid", False),
    ]
    assert torch.allclose(seen.events[0][4].mean(), outcome.loss.detach())
    assert not trainer.training  # as it was before the call


def test_a_hook_that_stops_training_stops_the_caller_after_the_later_hooks():
    seen = Record()
    trainer = _trainer([Stop(), seen])
    outputs = trainer.eval_step(batching.collate([data.get_stream(trainer.dataset, "valid")[0]]))
    with pytest.raises(TrainingTerminated, match="enough"):
        trainer.call_after_batch("valid", [outputs], training=False)
    assert len(seen.events) == 1


class _Copies(torch.nn.Module):
    """Computes with a copy of its weight: the loss has a gradient, the parameter never does (as
    a model whose layers read weights of their own, wrapped by a strategy that swaps them)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        copy = self.weight.detach().clone().requires_grad_()
        return {"loss": (x @ copy - y) ** 2}


def test_a_loss_that_reaches_no_trained_parameter_is_one_error_at_the_first_step(tmp_path):
    import phalanx
    from phalanx.errors import ModelError

    raw = toy.regression_config(output_root=str(tmp_path), hooks=[])
    streams = toy.Regression().streams()
    with pytest.raises(ModelError, match="no parameter that the optimizer trains got a gradient"):
        phalanx.fit(raw, model=_Copies(), dataset=streams)


class _Detached(torch.nn.Module):
    """Returns its loss detached from the graph: backward has nothing to differentiate."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((x @ self.weight - y) ** 2).detach()}


def test_a_loss_that_autograd_does_not_track_is_one_error_naming_the_cause(tmp_path):
    import phalanx
    from phalanx.errors import ModelError

    raw = toy.regression_config(output_root=str(tmp_path), hooks=[])
    streams = toy.Regression().streams()
    with pytest.raises(ModelError, match="the loss does not depend on anything autograd tracks"):
        phalanx.fit(raw, model=_Detached(), dataset=streams)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
