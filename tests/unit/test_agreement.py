"""An agreement that runs behind its step (`Behind`, `LastAgreement`): its values are read and
checked once, when the loss is read or when the next step takes the stop flag, and the last one of
an epoch is checked at the epoch's end, where no next step takes it."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ModelError
from phalanx.strategies.distributed import LastAgreement
from phalanx.strategies.windows import StepAgreements, StepsAgreement, Window


class Finished:
    """A collective's work that has completed: `wait` returns at once, and is counted."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def agreement(weighted: float, stop: float) -> StepsAgreement:
    # (loss part, weight sum, weighted, stop), as the pipeline sums them
    return StepsAgreement(torch.tensor([0.5, 0.0, weighted, stop]), Finished())


def test_the_next_step_takes_the_stop_flag_of_the_step_before():
    behind = LastAgreement()
    assert behind.swap(agreement(0.0, 1.0)) is False  # nothing before the first step
    assert behind.swap(agreement(0.0, 0.0)) is True  # the first step's flag, a step late
    assert behind.swap(None) is False


def test_the_epochs_last_agreement_is_checked_at_its_end():
    """A loss that became weighted in the epoch's last step is refused at the epoch's end, though
    no step follows to take its stop flag."""
    behind = LastAgreement()
    behind.swap(agreement(0.0, 0.0))
    behind.swap(agreement(1.0, 0.0))
    with pytest.raises(ModelError, match="became weighted"):
        behind.check()


def test_the_pipeline_checks_its_last_agreement_at_the_epochs_end():
    """The steps' agreements as the pipeline runs them, on one process (a send sums nothing): the
    first step's waited for (it says the loss is not weighted), the second's sent in a window of
    its own, its loss weighted; no step takes its flag, and the epoch's end refuses it."""
    agreements = StepAgreements(torch.device("cpu"), 8, lambda values: Finished())
    values, window = agreements.step(False, [torch.tensor(0.5)])
    assert window is None and agreements.weighted is False and float(values[0]) == 0.5
    agreements.when(lambda: True)  # every step ends its window
    _, window = agreements.step(False, [torch.tensor([1.0, 2.0])])
    assert window is not None and window.sent is not None
    with pytest.raises(ModelError, match="became weighted"):
        agreements.check()


def test_on_the_cpu_an_agreement_is_read_once():
    """Checked at the epoch's end after the loss was read (which read it on the CPU), it is not
    read again."""
    work, behind = Finished(), LastAgreement()
    last = StepsAgreement(torch.tensor([0.5, 0.0, 0.0, 0.0]), work)
    behind.swap(last)
    last.settled()
    behind.check()
    behind.check()
    assert work.waits == 1
    LastAgreement().check()  # no step yet: nothing to check


def _window(size: int) -> tuple[Window, list[torch.Tensor]]:
    sent: list[torch.Tensor] = []

    def dispatch(window: Window) -> None:
        rows = window.rows()
        sent.append(rows)
        rows.mul_(2)  # as two processes' sum would
        window.sent_as(Finished())

    return Window(size, torch.device("cpu"), dispatch), sent


def test_a_window_sends_its_steps_rows_as_one_message_and_its_stop_flag_is_any_steps():
    window, sent = _window(4)
    parts = [[torch.tensor(k + 0.25), torch.tensor(0.75)] for k in range(3)]  # two micro-batches
    losses = [window.next(stop, p) for stop, p in zip((False, True, False), parts, strict=True)]
    assert not window.full and window.sent is None
    assert [float(loss) for loss in losses] == [0.0, 0.0, 0.0]  # nothing written a step
    window.settled()  # read before a step ended the window: sent now
    assert len(sent) == 1 and sent[0].shape == (12,)  # three steps' rows, one message
    assert [float(loss) for loss in losses] == [2.0, 4.0, 6.0]  # each step's parts, summed
    assert sent[0].view(3, 4)[:, 3].tolist() == [0.0, 2.0, 2.0]  # stop: any step's so far
    assert window.sent is not None and window.sent.stopped()  # the last row's: any step's
    window.settled()
    assert len(sent) == 1  # sent once


def test_a_window_sums_each_steps_parts_as_the_step_alone_would():
    torch.manual_seed(0)
    # as many parts a step (one sum for the window), and a step with fewer (each its own)
    for counts in ([4, 4, 4], [4, 2, 4]):
        window, sent = _window(4)
        parts = [list(torch.randn(n) * 1e3) for n in counts]
        losses = [window.next(False, p) for p in parts]
        window.settled()
        for p, loss in zip(parts, losses, strict=True):
            assert float(loss) == 2 * float(torch.stack(p).sum(0).to(torch.float64))


def test_a_window_of_a_process_without_the_last_stage_sends_zero_losses():
    window, sent = _window(2)
    window.next(False, [])
    window.next(True, [])
    assert window.full
    window.settled()
    assert sent[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]


def test_a_dropped_window_is_never_sent():
    window, sent = _window(8)
    window.next(False, [torch.tensor(1.0)])
    window.drop()  # the run failed: no other process will come to its message
    window.settled()
    assert sent == []


def test_a_window_refuses_a_loss_that_became_weighted_in_any_of_its_steps():
    window, _ = _window(4)
    window.next(False, [torch.tensor(1.0)])
    window.next(False, [torch.tensor([1.0, 2.0])])  # the second step's loss came weighted: pairs
    with pytest.raises(ModelError, match="became weighted"):
        window.settled()  # read on the host, and checked, where the loss is read
