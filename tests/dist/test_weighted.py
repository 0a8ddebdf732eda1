"""Token-weighted losses on real gloo processes: the objective sum(w_i l_i) / sum(w_i) over the
global batch, exact across world sizes, micro-batches, empty shards and a short last window, and
equal to a hand-written loop that divides the sum of real-token losses by the count of real tokens.
Gradient clipping on the global norm, likewise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import data  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# the last batch of each epoch holds 2 samples: 2 micro-batches of 3, and
N_TRAIN, BATCH, EPOCHS = 32, 10, 2
# an empty shard for the third process
CROSS_ENTROPY = {"function": "cross_entropy", "output": "logits", "target": "labels"}


def lm(
    accumulation: int = 1, model: str = "toy.TinyLM", max_grad_norm: float | None = None, **parallel
) -> dict:
    model_cfg = {"class": model, "outputs": "logits"}
    if model == "toy.TinyLM":
        model_cfg["loss"] = CROSS_ENTROPY
    optimizer = {"class": "SGD", "lr": 0.5, "momentum": 0.9}
    if max_grad_norm is not None:
        optimizer["max_grad_norm"] = max_grad_norm
    return {
        "name": "lm",
        "model": model_cfg,
        "optimizer": optimizer,
        "precision": "fp64",
        "dataset": {"class": "toy.Sequences", "batch_size": BATCH, "n_train": N_TRAIN},
        "parallel": {
            "accelerator": "cpu",
            "devices": 1,
            "gradient_accumulation": accumulation,
            **parallel,
        },
        "main_loop": {"epochs": EPOCHS, "extra_streams": ["valid"]},
        "hooks": [],
    }


SCENARIOS = {
    "config-loss-accum1": lm(1),
    "config-loss-accum3": lm(3),
    "model-weights-accum3": lm(3, model="toy.WeighingLM"),
    "clipped": lm(2, max_grad_norm=0.3),
}


def hand_loop(max_grad_norm: float | None = None) -> dict:
    """What the configs must compute: every step's loss is the sum of its real tokens' losses over
    their count; the epoch's train loss the same over every step's tokens, the valid loss over the
    valid stream's."""
    torch.manual_seed(0)
    model = toy.TinyLM().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    streams = toy.Sequences(n_train=N_TRAIN).streams()
    train, valid = streams["train"], streams["valid"]

    def token_losses(items, index):
        labels = items.labels[index]
        return F.cross_entropy(
            model(items.tokens[index]).transpose(1, 2), labels, reduction="sum"
        ), (labels != -100).sum()

    losses, epochs = [], []
    for epoch in range(1, EPOCHS + 1):
        order, summed, tokens = data.permutation(0, epoch, N_TRAIN), 0.0, 0
        for start in range(0, N_TRAIN, BATCH):
            total, count = token_losses(train, torch.tensor(order[start : start + BATCH]))
            loss = total / count
            optimizer.zero_grad()
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            summed, tokens = summed + total.item(), tokens + count.item()
        with torch.no_grad():
            total, count = token_losses(valid, torch.arange(len(valid)))
        epochs.append({"train": summed / tokens, "valid": (total / count).item()})
    return {
        "params": {k: v.detach() for k, v in model.state_dict().items()},
        "losses": losses,
        "epochs": epochs,
    }


@pytest.fixture(scope="module")
def hand() -> dict:
    return {"plain": hand_loop(), "clipped": hand_loop(max_grad_norm=0.3)}


def close(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_as_hand_loop(got: dict, want: dict, rank: int = 0) -> None:
    if rank and not got["params"]:  # a sharded model's whole state is gathered to rank 0 alone
        got = {**got, "params": {}}
        want = {**want, "params": {}}
    for name, value in want["params"].items():
        assert close(got["params"][name], value) < 1e-10, name
    assert close(got["losses"], want["losses"]) < 1e-10
    for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):
        assert (
            close(mine["train"]["loss"], theirs["train"]) < 1e-10
        )  # ComputeStats: the weighted mean
        assert close(mine["valid"]["loss"], theirs["valid"]) < 1e-10


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_weighted_losses_equal_the_hand_loop_on_every_world_size(world_size, hand):
    raws = [
        {**raw, "parallel": {**raw["parallel"], "devices": world_size}}
        for raw in SCENARIOS.values()
    ]
    names = list(SCENARIOS)
    # and one process driving three towers, each with its share of every micro-batch
    if world_size == 1:
        for name in ("config-loss-accum3", "clipped"):
            raw = SCENARIOS[name]
            raws.append(
                {**raw, "parallel": {**raw["parallel"], "devices": 3, "strategy": "towers"}}
            )
            names.append(f"towers-{name}")
        per_rank = [workers.train_all(0, raws)]
    # fsdp too: its sharded gradients divided by the global weight, and clipped on their global norm
    else:
        for name in ("config-loss-accum3", "clipped"):
            raw = SCENARIOS[name]
            raws.append(
                {**raw, "parallel": {**raw["parallel"], "devices": world_size, "strategy": "fsdp"}}
            )
            names.append(f"fsdp-{name}")
        per_rank = workers.run_ranks(world_size, workers.train_all, raws)
    for rank, results in enumerate(per_rank):
        for name, got in zip(names, results, strict=True):
            assert_as_hand_loop(got, hand["clipped" if name.endswith("clipped") else "plain"], rank)
    clipped = per_rank[0][names.index("clipped")]["epochs"]
    assert all(epoch["train"]["grad_norm_max"] > 0.3 for epoch in clipped)  # the clipping did clip
    assert [epoch["train"]["grad_norm_nonfinite"] for epoch in clipped] == [0, 0]
