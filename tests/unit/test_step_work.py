"""What a training step asks of the device, counted on the CPU: the tensor operators that on a GPU
would each be a kernel launch, and the reads of a tensor's value that on a GPU would each wait for
it. The training loop with the default hooks (a run directory, TensorBoard, the CSV, the saved
checkpoints) runs no more of either than a hand-written loop that keeps the epoch's loss, but for
the step losses that the TensorBoard writer reads every `every_n_steps`."""

from __future__ import annotations

import collections
from collections import Counter

import pytest
import torch
import toy
from torch.utils.data import DataLoader, default_collate

from phalanx import config, overrides
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(240)
TESTS = toy.__file__.rsplit("/", 1)[0]
STEPS, BATCH, EVERY = 120, 8, 50


def _phalanx(tmp_path) -> Trainer:
    raw = toy.regression_config(
        model={"class": "toy.Classifier", "features": 4, "classes": 3},
        optimizer={"class": "AdamW", "lr": 0.01},
        dataset={"class": "toy.Classes", "batch_size": BATCH, "n_train": STEPS * BATCH},
        precision="fp32",
        main_loop={"epochs": 3, "extra_streams": ["valid"]},
    )
    hooks = overrides.default_hooks(["valid"])
    # ShowProgress reads the epoch's loss on its clock (a time), which no count can foresee
    raw["hooks"] = [
        {"WriteTensorBoard": {"every_n_steps": EVERY}} if h == "WriteTensorBoard" else h
        for h in hooks
        if h != "ShowProgress"
    ]
    return Trainer(config.validate(raw), tmp_path, [TESTS])


def _hand_epoch(model, optimizer, loader) -> torch.Tensor:
    total = torch.zeros(())
    for batch in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch["x"], batch["y"])["loss"].mean()
        loss.backward()
        optimizer.step()
        total += loss.detach()
    return total / len(loader)


def _bare_step(model, optimizer, items: list) -> None:
    """What any step of the model must do: its batch collated, its forward, backward from each
    sample's loss with the gradient the mean gives it, the optimizer's step."""
    batch = default_collate(items)
    optimizer.zero_grad(set_to_none=True)
    loss = model(batch["x"], batch["y"])["loss"]
    loss.backward(torch.full_like(loss, 1 / len(loss)))
    optimizer.step()


def test_the_loop_asks_no_more_of_the_device_than_a_hand_written_one(tmp_path):
    trainer = _phalanx(tmp_path)
    trainer.begin_training()
    trainer.train_epoch()  # the optimizer's state made, the hooks' first epoch
    with toy.Operators() as phalanx:
        trainer.train_epoch(end=False)  # the step loop: its steps and their hooks
    trainer.end_training()
    assert trainer.step == 2 * STEPS

    torch.manual_seed(0)
    model = toy.Classifier(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(toy.Classes(n_train=STEPS * BATCH).streams()["train"], BATCH, shuffle=True)
    _hand_epoch(model, optimizer, loader)
    with toy.Operators() as hand:
        float(_hand_epoch(model, optimizer, loader))  # the epoch's loss, read once
    items = [loader.dataset[i] for i in range(BATCH)]
    with toy.Operators() as bare:
        _bare_step(model, optimizer, items)

    # against the hand loop: no more kernels, and no reads but the optimizer's own (AdamW reads
    # its step count) and the TensorBoard writer's step loss every EVERY steps, where the hand
    # loop reads its epoch's loss once
    written = STEPS // EVERY
    assert phalanx.kernels <= hand.kernels, _difference(phalanx.counts, hand.counts)
    assert phalanx.reads <= hand.reads - 1 + written, (phalanx.reads, hand.reads)
    # against the step's own work: no kernel a step more (the loss part's dot product takes the
    # place of the gradient that the bare step makes), and an eighth of one for what the loop does
    # now and then (the epoch's order, the losses added up a group at a time); no read but the
    # optimizer's and the writer's
    assert phalanx.kernels <= STEPS * bare.kernels + STEPS // 8, (
        phalanx.kernels,
        bare.kernels,
        _difference(phalanx.counts, Counter({k: STEPS * n for k, n in bare.counts.items()})),
    )
    assert phalanx.reads <= STEPS * bare.reads + written, (phalanx.reads, bare.reads)


def _difference(ours: collections.Counter, theirs: collections.Counter) -> dict[str, int]:
    """The operators each loop ran more often: what a failing assertion should name."""
    return {name: ours[name] - theirs[name] for name in ours | theirs if ours[name] != theirs[name]}
