"""Two of torch's calls that every step makes, without the Python torch wraps them in where it adds
nothing to phalanx's step: backward handed straight to the autograd engine, and the gradients
cleared without `zero_grad`'s profiler range. Each keeps torch's own path where it does matter (a
tensor subclass or mode, a gradient of another shape, an optimizer's own `zero_grad`, a profiler
that records), and training gives the same numbers either way."""

from __future__ import annotations

import collections

import pytest
import torch
import toy
from torch.overrides import TorchFunctionMode

from phalanx import config, precision
from phalanx.engine import clear_gradients
from phalanx.precision import Precision
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def _trained(epochs: int = 2) -> dict[str, torch.Tensor]:
    raw = toy.regression_config(
        model={"class": "toy.Linear", "hidden": 4},
        dataset={"n_train": 40, "batch_size": 8},
        optimizer={"class": "AdamW", "lr": 0.05},
        main_loop={"epochs": epochs, "extra_streams": []},
    )
    trainer = Trainer(config.validate(raw), None, [], hooks=[])
    trainer.run()
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def _counting_backward(monkeypatch) -> list[int]:
    calls: list[int] = []
    public = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        calls.append(1)
        return public(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    return calls


def test_a_step_backpropagates_through_the_engine_with_the_public_paths_numbers(monkeypatch):
    calls = _counting_backward(monkeypatch)
    lean = _trained()
    assert calls == []  # no step went through Tensor.backward
    monkeypatch.setattr(precision, "_engine_run_backward", None)  # a torch without the entry
    public = _trained()
    assert len(calls) == 10  # 2 epochs of 5 steps, each through Tensor.backward
    assert lean.keys() == public.keys()
    for name in lean:
        assert torch.equal(lean[name], public[name]), name


class _Logged(torch.Tensor):
    """A tensor subclass with a `__torch_function__` of its own: torch's path must see it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _loss() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    return layer, (layer(torch.randn(4, 3)).squeeze(-1) ** 2)


def test_a_plain_loss_goes_to_the_engine_with_the_same_gradients():
    layer, loss = _loss()
    assert precision._plain_backward(loss, torch.full((4,), 0.25))
    lean = [p.grad.clone() for p in layer.parameters()]
    layer, loss = _loss()
    loss.backward(torch.full((4,), 0.25))
    assert all(torch.equal(a, p.grad) for a, p in zip(lean, layer.parameters(), strict=True))


@pytest.mark.parametrize(
    "case", ["another shape", "another dtype", "a subclass", "a mode", "a scalar's None"]
)
def test_what_the_engine_is_not_handed_goes_through_torchs_checks(case):
    layer, loss = _loss()
    gradient: torch.Tensor | None = torch.full((4,), 0.25)
    if case == "another shape":
        gradient = torch.full((5,), 0.25)
    elif case == "another dtype":
        gradient = gradient.double()
    elif case == "a subclass":
        loss = loss.as_subclass(_Logged)
    elif case == "a scalar's None":
        loss, gradient = loss.sum(), None
    if gradient is not None:
        if case == "a mode":
            with _Mode():
                assert not precision._plain_backward(loss, gradient)
        else:
            assert not precision._plain_backward(loss, gradient)
        assert all(p.grad is None for p in layer.parameters())  # nothing was run
    backward = Precision("fp32", torch.device("cpu")).backward
    if case == "another shape":  # torch's own error, from its own check
        with pytest.raises(RuntimeError, match="Mismatch in shape"):
            backward(loss, gradient)
        return
    backward(loss, gradient)
    assert all(p.grad is not None for p in layer.parameters())


class _Ranges:
    """Counts the profiler ranges torch opens (`record_function`), as torch opens them."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        opened = torch.autograd.profiler.record_function
        ranges = self

        class Counted(opened):
            def __init__(self, name, args=None):
                ranges.names.append(name)
                super().__init__(name, args)

        monkeypatch.setattr(torch.autograd.profiler, "record_function", Counted)


def _with_gradients(
    optimizer_class=torch.optim.SGD,
) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    layer, loss = _loss()
    optimizer = optimizer_class(layer.parameters(), lr=0.1)
    loss.sum().backward()
    return layer, optimizer


def test_gradients_are_cleared_without_zero_grads_profiler_range(monkeypatch):
    ranges = _Ranges(monkeypatch)
    layer, optimizer = _with_gradients()
    clear_gradients(optimizer)
    assert all(p.grad is None for p in layer.parameters())
    assert ranges.names == []
    optimizer.zero_grad(set_to_none=True)  # what the check counts: torch's method opens one
    assert ranges.names == ["Optimizer.zero_grad#SGD.zero_grad"]


def test_a_profiler_that_records_sees_the_optimizers_own_zero_grad():
    layer, optimizer = _with_gradients()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as recorded:
        clear_gradients(optimizer)
    assert all(p.grad is None for p in layer.parameters())
    assert "Optimizer.zero_grad#SGD.zero_grad" in {e.name for e in recorded.events()}


class _OwnZeroGrad(torch.optim.SGD):
    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).calls += 1
        super().zero_grad(set_to_none)


def test_an_optimizers_own_zero_grad_is_called():
    layer, optimizer = _with_gradients(_OwnZeroGrad)
    clear_gradients(optimizer)
    assert _OwnZeroGrad.calls == 1
    assert all(p.grad is None for p in layer.parameters())
    # one set on the instance, as a wrapper would
    layer, optimizer = _with_gradients()
    seen: list[bool] = []
    optimizer.zero_grad = lambda set_to_none=True: seen.append(set_to_none)  # type: ignore[method-assign]
    clear_gradients(optimizer)
    assert seen == [True]
    assert all(p.grad is not None for p in layer.parameters())  # the optimizer's call decides


class _Wrapping(torch.optim.Optimizer):
    """A wrapper that skips `Optimizer.__init__` (as some do): torch's `zero_grad` wraps its `step`
    on first call, and only then do its step hooks run."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner, self.param_groups, self.defaults = inner, inner.param_groups, inner.defaults
        self.state: dict = {}
        self._optimizer_step_pre_hooks: dict = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict = collections.OrderedDict()

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_wrapper_that_skipped_optimizer_init_still_runs_its_step_hooks():
    layer, inner = _with_gradients()
    optimizer = _Wrapping(inner)
    ran: list[str] = []
    optimizer.register_step_post_hook(lambda *_: ran.append("post"))
    for _ in range(2):
        clear_gradients(optimizer)
        assert all(p.grad is None for p in layer.parameters())
        layer(torch.randn(2, 3)).sum().backward()
        optimizer.step()
    assert ran == ["post", "post"]
