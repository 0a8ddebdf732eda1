"""What `phalanx resume RUN KEY=VALUE ...` may change, and how each change takes effect.

A resumed run continues from a checkpoint's state, so an override either reaches that state or is
refused: the optimizer's settings and the learning-rate schedule are re-derived from the new config
at the checkpoint's step; what would change the samples of the epoch in progress is refused
mid-epoch; a different optimizer class is refused, since the saved state belongs to the old one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from phalanx.config import flat_keys
from phalanx.errors import ConfigError

# dataset keys that change neither the data nor its order
_DATA_NEUTRAL = {"dataset.num_workers", "dataset.eval_batch_size"}


def changed_keys(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ between two resolved configs: (before, after)."""
    old, new = flat_keys(before), flat_keys(after)
    return {
        k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    }


def check(changed: dict[str, tuple[Any, Any]], state: dict[str, Any], batch_size: int) -> None:
    """Refuse the changes that the checkpoint's state cannot take, with the reason and the fix.
    `batch_size`: the resumed run's global batch."""
    if "optimizer.class" in changed:
        old, new = changed["optimizer.class"]
        raise ConfigError(
            f"optimizer.class={new} cannot take over on resume: the checkpoint holds {old}'s "
            "state. Resume without it, or start a new run with phalanx train"
        )
    if not state["step_in_epoch"]:
        return
    where = (
        f"the checkpoint at step {state['step']} is {state['step_in_epoch']} steps into epoch "
        f"{state['epoch'] + 1}"
    )
    if state["batch_size"] != batch_size:
        raise ConfigError(
            f"{where} with dataset.batch_size={state['batch_size']}; resuming with {batch_size} "
            f"would skip or repeat samples. Resume with dataset.batch_size={state['batch_size']}, "
            "or from a checkpoint at an epoch's end"
        )
    order = [
        k
        for k in changed
        if k == "seed"
        or (k.startswith("dataset.") and k not in _DATA_NEUTRAL and k != "dataset.batch_size")
    ]
    if order:
        shown = ", ".join(f"{k}={changed[k][1]}" for k in order)
        raise ConfigError(
            f"{shown} would change the samples of the epoch in progress: {where}. Resume "
            "without it, or from a checkpoint at an epoch's end"
        )


def affects_schedule(changed: dict[str, tuple[Any, Any]]) -> bool:
    """Whether the optimizer's settings or the learning-rate schedule change (the scaled rate
    depends on the global batch too)."""
    # the epochs: the length a scheduler argument given as auto takes
    return any(
        k.startswith(("optimizer.", "scheduler")) or k in ("dataset.batch_size", "main_loop.epochs")
        for k in changed
    )


def replay_schedule(
    schedulers: list[tuple[Any, str]], steps: int, epochs: int, steps_per_epoch: int | None
) -> None:
    """Step freshly built schedulers as training did up to `steps` optimizer steps and `epochs`
    finished epochs: each epoch's steps, then the epoch's end. Where the epochs' length is not known
    (an iterable stream), the epoch schedulers step after every step scheduler has."""
    by_step = [s for s, interval in schedulers if interval == "step"]
    by_epoch = [s for s, interval in schedulers if interval == "epoch"]
    if steps_per_epoch is None:
        steps_per_epoch = steps
    done = 0
    # stepping a scheduler before its optimizer has stepped warns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs):
            for _ in range(min(steps_per_epoch, steps - done)):
                for scheduler in by_step:
                    scheduler.step()
            done = min(steps, done + steps_per_epoch)
            for scheduler in by_epoch:
                scheduler.step()
        for _ in range(steps - done):
            for scheduler in by_step:
                scheduler.step()


def check_epochs_left(epochs: int, done: int, overrides: Sequence[str]) -> None:
    """A resume with `overrides` of a run that has trained `done` of its `epochs` already would
    only rewrite its config: one error instead, before anything is written."""
    if done < epochs:
        return
    raise ConfigError(
        f"main_loop.epochs={epochs}: the run has trained {done} epoch{'' if done == 1 else 's'} "
        f"already (its latest checkpoint), so resuming it with {' '.join(overrides)} would train "
        f"nothing; to train longer, give more epochs than {done}, such as "
        f"main_loop.epochs={2 * done}"
    )
