"""The steps' losses tallied: the epoch's mean is the same numbers added in the same order however
often it is read and whether the losses were agreed behind the step, and a step adds no work of
its own to the device (the losses are added up a group at a time)."""

from __future__ import annotations

import pytest
import torch
import toy

from phalanx import losses as losses_module
from phalanx.losses import GROUP, UNSUMMED, StepLosses


def _step_losses(steps: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # values of many magnitudes: an order of addition that differed would show in the bits
    return list(torch.rand(steps, generator=generator) * 10.0 ** torch.randint(-3, 4, (steps,)))


class Pending:
    """A loss agreed behind the step: its value is written when it settles, as an all-reduce
    that completes writes its result."""

    def __init__(self, value: torch.Tensor, order: list[int], step: int):
        self.loss, self._value, self._order, self._step = (
            torch.full((), float("nan")),
            value,
            order,
            step,
        )

    def settle(self) -> None:
        if self.loss.isnan():
            self.loss.copy_(self._value)
            self._order.append(self._step)


@pytest.mark.parametrize("steps", [1, GROUP - 1, GROUP, GROUP + 1, 5 * GROUP + 7])
def test_the_epoch_mean_is_the_steps_mean_however_often_it_is_read(steps):
    values = _step_losses(steps)
    read_at_end, read_every_step = StepLosses(), StepLosses()
    for tally in (read_at_end, read_every_step):
        tally.begin_epoch()
    means = []
    for value in values:
        read_at_end.add(value, None)
        read_every_step.add(value, None)
        means.append(read_every_step.epoch_mean())
        assert read_every_step.last is value
    final = read_at_end.epoch_mean()
    assert torch.equal(final, read_every_step.epoch_mean())
    assert torch.allclose(final, torch.stack(values).double().mean().float(), rtol=1e-6)
    # each mean read on the way is the mean of the steps so far
    for k in (0, steps // 2, steps - 1):
        assert torch.allclose(
            means[k], torch.stack(values[: k + 1]).double().mean().float(), rtol=1e-6
        )
    assert read_at_end.steps == steps


def test_losses_agreed_behind_the_step_add_up_to_the_same_bits():
    steps = 3 * UNSUMMED + 5
    values = _step_losses(steps, seed=1)
    at_once, behind = StepLosses(), StepLosses()
    at_once.begin_epoch()
    behind.begin_epoch()
    order: list[int] = []
    pending = []
    for step, value in enumerate(values):
        at_once.add(value, None)
        loss = Pending(value, order, step)
        pending.append(loss)
        behind.add(loss.loss, loss.settle)
        if step == UNSUMMED // 3:  # a hook reads the last loss: it alone is waited for
            assert torch.equal(behind.last, value)
    assert torch.equal(behind.epoch_mean(), at_once.epoch_mean())
    # each settled once, and each holds its own step's value
    assert sorted(order) == list(range(steps))
    assert all(torch.equal(p.loss, v) for p, v in zip(pending, values, strict=True))


def test_a_new_epoch_starts_from_nothing():
    tally = StepLosses()
    tally.begin_epoch()
    for value in _step_losses(GROUP + 3):
        tally.add(value, None)
    tally.begin_epoch()
    assert tally.epoch_mean() is None
    tally.add(torch.tensor(2.0), None)
    tally.add(torch.tensor(4.0), None)
    assert tally.epoch_mean().item() == 3.0


def test_a_step_adds_no_operator_of_its_own():
    """On a GPU each tensor operator is a kernel launch: a running sum would add one to every step.
    Adding up a group takes a stack and a sum (and one addition to the sum after the first)."""
    tally = StepLosses()
    tally.begin_epoch()
    values = _step_losses(4 * GROUP)
    with toy.Operators() as operators:
        for value in values:
            tally.add(value, None)
    groups = len(values) // GROUP
    assert operators.counts == {"stack": groups, "sum": groups, "add": groups - 1}
    assert sum(operators.counts.values()) < len(values) / 8


def test_reading_the_mean_leaves_the_groups_as_they_were():
    """A read adds up the group being filled for itself: the group goes on filling, so a read in
    the middle of a group does not move where the next groups begin."""
    tally = StepLosses()
    tally.begin_epoch()
    values = _step_losses(GROUP + GROUP // 2)
    for value in values[: GROUP // 2]:
        tally.add(value, None)
    tally.epoch_mean()
    with toy.Operators() as operators:
        for value in values[GROUP // 2 :]:
            tally.add(value, None)
    assert operators.counts == {"stack": 1, "sum": 1}  # the first group, whole at step GROUP
    assert losses_module.GROUP == GROUP


@pytest.mark.parametrize(
    "dtype, value, steps", [(torch.bfloat16, 2.0, 20_000), (torch.float16, 100.0, 700)]
)
def test_half_precision_losses_are_added_up_in_single_precision(dtype, value, steps):
    """An epoch of half-precision losses summed in their own precision loses them (bf16: 2.0 a
    step comes to 0.8 over 20,000 steps) or overflows (fp16: 700 steps of 100)."""
    tally = StepLosses()
    tally.begin_epoch()
    loss = torch.tensor(value, dtype=dtype)
    for _ in range(steps):
        tally.add(loss, None)
    mean = tally.epoch_mean()
    assert mean.dtype == torch.float32
    assert mean.item() == value


def test_a_display_reads_the_steps_whose_agreement_was_sent_and_sends_none():
    """The pipeline sends several steps' agreements in one message: `epoch_mean(sent_only=True)`
    settles the losses of the steps sent so far, in order, and no step after them (settling one
    would send its message, a collective a display on one process must not start); the full
    mean then settles them all."""
    values = _step_losses(7)
    order: list[int] = []
    pending = [Pending(v, order, k) for k, v in enumerate(values)]
    tally = StepLosses()
    tally.begin_epoch()
    for k, step in enumerate(pending):
        tally.add(step.loss, step.settle, sent=k in (2, 4))  # steps 0-2 and 3-4 sent together
    shown = tally.epoch_mean(sent_only=True)
    assert order == [4, 3, 2, 1, 0]  # the newest of them first: one request settles a window
    assert shown == pytest.approx(float(torch.stack(values[:5]).mean()), rel=1e-6)
    assert tally.epoch_mean(sent_only=True) == shown  # nothing more was sent
    assert tally.epoch_mean() == pytest.approx(float(torch.stack(values).mean()), rel=1e-6)
    assert sorted(order) == list(range(7))


def test_a_display_before_any_step_was_sent_shows_none():
    tally = StepLosses()
    tally.begin_epoch()
    tally.add(torch.tensor(1.0), lambda: pytest.fail("a display sent a step's agreement"), False)
    assert tally.epoch_mean(sent_only=True) is None


def test_a_loss_kept_for_later_says_when_its_agreement_was_sent_and_reads_without_sending():
    """`later()`: the last step's loss, kept by a hook that checks it once its agreement has been
    sent (by its window's last step, a read of a later step's loss, or the epoch's end), reading
    it then without sending anything; a loss agreed at once is sent with its step."""
    values = _step_losses(6)
    order: list[int] = []
    pending = [Pending(v, order, k) for k, v in enumerate(values)]
    tally = StepLosses()
    assert tally.later() is None
    tally.begin_epoch()
    assert tally.later() is None  # before the epoch's first step
    kept = []
    for k, step in enumerate(pending[:4]):
        tally.add(step.loss, step.settle, sent=k == 1)  # steps 0-1 sent together, 2-3 not yet
        kept.append(tally.later())
    assert [later.sent for later in kept] == [True, True, False, False]
    assert float(kept[0].read()) == float(values[0]) and order == [0]
    tally.last  # noqa: B018 - a hook reads the last step's loss: its window is sent
    assert [later.sent for later in kept] == [True] * 4
    assert float(kept[2].read()) == float(values[2])
    tally.add(pending[4].loss, pending[4].settle, sent=False)
    kept.append(tally.later())
    assert not kept[-1].sent
    tally.begin_epoch()  # the epoch ended: the loop's end sent every step's
    assert kept[-1].sent and tally.later() is None
    tally.add(torch.tensor(2.5), None)  # agreed at once
    now = tally.later()
    assert now is not None and now.sent and float(now.read()) == 2.5
