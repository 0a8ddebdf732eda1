"""A Hugging Face model through the config alone: a tiny GPT-2 with random weights (nothing
downloaded), whose per-token loss phalanx computes from its logits, shifted as the model's own loss
is, so that it is exact across devices and micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import data  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (pip install .[dev])"
)
pytestmark = pytest.mark.timeout(600)
GPT2 = {
    "class": "transformers.GPT2LMHeadModel",
    "config": {
        "class": "transformers.GPT2Config",
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 16,
        "vocab_size": 50,
        "n_positions": 8,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}
N_TRAIN, BATCH = 21, 8


def config(devices: int = 1, accumulation: int = 1, strategy: str = "auto") -> dict:
    return {
        "name": "gpt2",
        "model": GPT2,
        "optimizer": {"class": "AdamW", "lr": 0.01},
        "precision": "fp64",
        "dataset": {"class": "toy.CausalSequences", "batch_size": BATCH, "n_train": N_TRAIN},
        "parallel": {
            "accelerator": "cpu",
            "devices": devices,
            "gradient_accumulation": accumulation,
            "strategy": strategy,
        },
        "main_loop": {"epochs": 2, "extra_streams": ["valid"]},
        "hooks": [],
    }


def own_losses() -> list[float]:
    """The model's own loss (the mean over the batch's real tokens, shifted), step by step, trained
    by a hand loop in the contract's sample order."""
    torch.manual_seed(0)
    cfg = {k: v for k, v in GPT2["config"].items() if k != "class"}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    items = toy.CausalSequences(n_train=N_TRAIN).streams()["train"]
    losses = []
    for epoch in (1, 2):
        order = data.permutation(0, epoch, N_TRAIN)
        for start in range(0, N_TRAIN, BATCH):
            batch = {
                k: torch.stack([items[i][k] for i in order[start : start + BATCH]])
                for k in items[0]
                if k != "id"
            }
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_a_tiny_gpt2_trains_from_the_config_alone_exactly_across_world_sizes():
    one = workers.train(config())
    want = own_losses()
    assert len(one["losses"]) == len(want) == 6
    # the model's own objective (which it computes in float32, whatever the model's dtype)
    assert max(abs(a - b) / b for a, b in zip(one["losses"], want, strict=True)) < 1e-6
    for raw in (config(2, 2), config(2, 1, "fsdp")):
        per_rank = workers.run_ranks(2, workers.train_all, [raw])
        got = per_rank[0][0]
        assert (
            max(abs(a - b) / b for a, b in zip(got["losses"], one["losses"], strict=True)) < 1e-10
        )
        for name, value in one["params"].items():
            a, b = (
                torch.tensor(got["params"][name], dtype=torch.float64),
                torch.tensor(value, dtype=torch.float64),
            )
            assert float((a - b).abs().max()) <= 1e-10 * max(1.0, float(b.abs().max())), name
        assert abs(got["epochs"][-1]["valid"]["loss"] - one["epochs"][-1]["valid"]["loss"]) < 1e-10
