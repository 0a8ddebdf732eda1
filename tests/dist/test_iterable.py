"""Iterable streams (an IterableDataset: no index, no length): the stream's own order, the same
global batches on every world size (each rank reads every item and keeps its shards), every item of
an evaluation stream once, and resume at the same item, whether the stream says where it stands or
is read again up to there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import commands  # noqa: E402
from phalanx.checkpoint import Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(600)
N_TRAIN, N_VALID, BATCH, EPOCHS = 41, 10, 8, 2


def config(devices: int = 1, accumulation: int = 1, strategy: str = "auto", **dataset) -> dict:
    return toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={
            "class": "toy.IterableRegression",
            "batch_size": BATCH,
            "n_train": N_TRAIN,
            "n_valid": N_VALID,
            **dataset,
        },
        parallel={
            "accelerator": "cpu",
            "devices": devices,
            "gradient_accumulation": accumulation,
            "strategy": strategy,
        },
        main_loop={"epochs": EPOCHS, "extra_streams": ["valid"]},
        hooks=[],
    )


def hand_loop() -> dict:
    """The stream read in its order, B items a step: what every world size must compute."""
    torch.manual_seed(0)
    model = toy.Linear(3, 4).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = toy.IterableRegression(N_TRAIN, N_VALID).streams()["train"]
    losses = []
    for epoch in range(1, EPOCHS + 1):
        stream.set_epoch(epoch)
        items = list(stream)
        for start in range(0, N_TRAIN, BATCH):
            batch = items[start : start + BATCH]
            x = torch.stack([i["x"] for i in batch]).double()
            y = torch.stack([i["y"] for i in batch]).double()
            loss = model(x, y)["loss"].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"params": model.state_dict(), "losses": losses}


def assert_as(got: dict, want: dict) -> None:
    for name, value in want["params"].items():
        a = torch.tensor(got["params"][name], dtype=torch.float64)
        assert float((a - value).abs().max()) <= 1e-10 * max(1.0, float(value.abs().max())), name
    assert len(got["losses"]) == len(want["losses"]) == EPOCHS * 6
    assert (
        max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)) < 1e-10
    )
    for epoch in got["epochs"]:
        assert epoch["valid"]["loss_count"] == N_VALID  # every item of the evaluation stream once
        assert epoch["train"]["loss_count"] == N_TRAIN


def test_an_iterable_stream_trains_in_its_own_order_the_same_on_every_world_size():
    want = hand_loop()
    assert_as(workers.train(config()), want)
    raws = [config(3, 2), config(3, 1, "fsdp")]  # 41 = 5 x 8 + 1: empty shards in the last step
    for rank_results in workers.run_ranks(3, workers.train_all, raws):
        for got in rank_results:
            if got["params"]:  # fsdp gathers the whole model to rank 0
                assert_as(got, want)
            else:
                assert (
                    max(
                        abs(a - b) / abs(b)
                        for a, b in zip(got["losses"], want["losses"], strict=True)
                    )
                    < 1e-10
                )


def _resumed(tmp_path: Path, stateful: bool) -> tuple[dict, list[str]]:
    """Trained whole, and stopped at step 9 (mid-epoch 2) then resumed: both final weights, and the
    positions at which the resumed run began reading the stream."""
    log = tmp_path / "reads.txt"
    raw = config(stateful=stateful, log=str(log))
    raw["hooks"] = [
        {"ComputeStats": {"variables": ["loss"]}},
        "SaveLatest",
        {"StopAfter": {"steps": 1000}},
    ]
    whole = toy.write_config(tmp_path / "whole", raw)
    assert commands.train(str(whole), []) == 0
    raw["hooks"][2] = {"StopAfter": {"steps": 9}}
    parts = toy.write_config(tmp_path / "parts", raw)
    assert commands.train(str(parts), []) == 0
    [run] = list((tmp_path / "parts" / "runs").iterdir())
    log.write_text("")
    assert commands.resume(str(run), ["hooks.2.StopAfter.steps=1000"]) == 0
    [ref] = list((tmp_path / "whole" / "runs").iterdir())
    final = {}
    for name, folder in (("whole", ref), ("resumed", run)):
        checkpoints = Checkpoints(folder / "checkpoints")
        from safetensors.torch import load_file

        final[name] = load_file(checkpoints.path(checkpoints.latest_valid()) / "model.safetensors")
    return final, log.read_text().split("\n")


@pytest.mark.parametrize("stateful", [False, True], ids=["read-again", "stream-state"])
def test_an_iterable_stream_resumes_at_the_same_item(tmp_path, stateful):
    final, reads = _resumed(tmp_path, stateful)
    for key, value in final["whole"].items():
        assert torch.equal(final["resumed"][key], value), key
    # step 9 is 3 steps (24 items) into epoch 2: a stream that says where it stands starts there
    assert reads[0] == ("2 24" if stateful else "2 0")


def test_sync_batchnorm_on_an_iterable_stream_with_an_empty_shard_is_a_clear_error_not_a_hang():
    """41 items, batch 8: the last step has 1 sample for 3 processes. Every rank knows it from the
    shards' sizes and stops with the same error, at that step."""
    raw = config(3)
    raw["model"] = {"class": "toy.BatchNormNet", "features": 3, "hidden": 6}
    raw["parallel"]["sync_batchnorm"] = True
    with pytest.raises(
        AssertionError, match="sync_batchnorm needs a sample for each of the 3 processes .* step 5"
    ):
        workers.run_ranks(3, workers.train_all, [raw], timeout=120)
