"""An agreement that runs behind its step (`Behind`, `LastAgreement`): its values are read and
checked once, when the loss is read or when the next step takes the stop flag, and the last one of
an epoch is checked at the epoch's end, where no next step takes it."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ModelError
from phalanx.strategies.distributed import LastAgreement
from phalanx.strategies.pipeline import Pipeline, _Agreement


class Finished:
    """A collective's work that has completed: `wait` returns at once, and is counted."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def agreement(weighted: float, stop: float) -> _Agreement:
    # (loss part, weight sum, weighted, stop), as the pipeline sums them
    return _Agreement(torch.tensor([0.5, 0.0, weighted, stop]), Finished())


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
    behind = LastAgreement()
    behind.swap(agreement(1.0, 0.0))
    holder = type("Holder", (), {"_behind": behind})()  # the one attribute end_epoch reads
    with pytest.raises(ModelError, match="became weighted"):
        Pipeline.end_epoch(holder)  # type: ignore[arg-type]


def test_on_the_cpu_an_agreement_is_read_once():
    """Checked at the epoch's end after the loss was read (which read it on the CPU), it is not
    read again."""
    work, behind = Finished(), LastAgreement()
    last = _Agreement(torch.tensor([0.5, 0.0, 0.0, 0.0]), work)
    behind.swap(last)
    last.settled()
    behind.check()
    behind.check()
    assert work.waits == 1
    LastAgreement().check()  # no step yet: nothing to check
