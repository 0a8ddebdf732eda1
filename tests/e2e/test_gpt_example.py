"""The GPT example (examples/gpt): the model is a causal language model that starts at chance, the
byte-level standard-library corpus is cut as documented, and `phalanx train examples/gpt/tiny.yaml`
learns in a real process, from the repository root so that `examples.gpt...` imports."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

import forks
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt.data import StdlibBytes, read_corpus, source_files, stdlib_dir  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LN_VOCAB = math.log(256)  # the loss of a uniform guess over bytes, about 5.545
TINY = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0, bias=True)


# --- the model
# -------------------------------------------------------------------------------------


def test_the_loss_at_initialisation_is_that_of_a_uniform_guess():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    tokens = torch.randint(0, 256, (8, 64))
    targets = torch.randint(0, 256, (8, 64))
    out = model(tokens, targets)
    assert out["logits"].shape == (8, 64, 256)
    assert out["loss"].shape == (8,)  # one value per sequence: its mean over positions
    assert abs(out["loss"].mean().item() - LN_VOCAB) < 0.1, out["loss"]
    manual = torch.nn.functional.cross_entropy(out["logits"][3], targets[3])
    assert torch.allclose(out["loss"][3], manual, atol=1e-6)


def test_the_head_is_tied_to_the_token_embedding():
    model = GPT(**TINY)
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == model.num_params(non_embedding=False)


@pytest.mark.parametrize("t", [0, 17, 63])
def test_a_token_changes_no_logit_before_it(t):
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    tokens = torch.randint(0, 256, (2, 64))
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens)["logits"], model(changed)["logits"]
    assert torch.allclose(
        before[:, :t], after[:, :t], rtol=0, atol=1e-6
    )  # the past does not see it
    assert not torch.allclose(before[:, t], after[:, t])  # its own position does


# --- the data
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return read_corpus(max_bytes=40_000)


@pytest.fixture(scope="module")
def dataset():
    return StdlibBytes(block_size=32, max_bytes=40_000, valid_fraction=0.25)


def test_the_corpus_is_the_standard_library_source_in_sorted_order(corpus):
    files = source_files(stdlib_dir())
    relative = [f.relative_to(stdlib_dir()).as_posix() for f in files]
    assert relative == sorted(relative) and "os.py" in relative
    assert not any(
        r.startswith(("site-packages/", "dist-packages/", "_sysconfigdata")) for r in relative
    )
    expected = b""
    for f in files:
        expected += f.read_bytes()
        if len(expected) >= 40_000:
            break
    assert corpus == expected[:40_000]


def test_the_dataset_is_deterministic(dataset):
    again = StdlibBytes(block_size=32, max_bytes=40_000, valid_fraction=0.25)
    for name in ("train", "valid"):
        a, b = dataset.streams()[name], again.streams()[name]
        assert len(a) == len(b) > 0
        for i in (0, len(a) // 2, len(a) - 1):
            assert torch.equal(a[i]["tokens"], b[i]["tokens"]) and torch.equal(
                a[i]["targets"], b[i]["targets"]
            )


def test_windows_are_contiguous_non_overlapping_and_targets_are_shifted(dataset, corpus):
    train, valid = dataset.streams()["train"], dataset.streams()["valid"]
    n_train = len(corpus) - int(len(corpus) * 0.25)
    assert len(train) == (n_train - 1) // 32 and len(valid) == (len(corpus) - n_train - 1) // 32
    assert dataset.tokens_per_sample == 32 and dataset.tokens("train") == 32 * len(train)
    for stream, offset in ((train, 0), (valid, n_train)):
        for i in range(len(stream)):
            item = stream[i]
            assert item["tokens"].dtype == torch.long and item["tokens"].shape == (32,)
            start = offset + 32 * i  # window i covers bytes [32 i, 32 i + 33) of its stream
            assert bytes(item["tokens"].tolist()) == corpus[start : start + 32]
            assert bytes(item["targets"].tolist()) == corpus[start + 1 : start + 33]
            assert torch.equal(item["targets"][:-1], item["tokens"][1:])
            if i + 1 < len(stream):  # the next window starts where this one's tokens end
                assert item["targets"][-1] == stream[i + 1]["tokens"][0]
    with pytest.raises(IndexError):
        train[len(train)]


def test_train_and_valid_do_not_overlap(dataset, corpus):
    train, valid = dataset.streams()["train"], dataset.streams()["valid"]
    n_train = len(corpus) - int(len(corpus) * 0.25)
    # the split is contiguous: train is the first n_train bytes, valid the rest
    assert (
        bytes(train.data.tolist()) == corpus[:n_train]
        and bytes(valid.data.tolist()) == corpus[n_train:]
    )
    assert 32 * len(train) + 1 <= n_train  # the last train window's last target is a train byte


# --- end to end
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny.yaml for one epoch on a 300 kB corpus (132 steps): about 20 s on one thread."""
    root = tmp_path_factory.mktemp("gpt")
    args = ["train", "examples/gpt/tiny.yaml", f"output_root={root}", "main_loop.epochs=1"]
    result = forks.run([*args, "dataset.max_bytes=300000"], REPO, ENV, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list(root.iterdir())
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return run, rows


def _unigram_entropy(data: torch.Tensor) -> float:
    p = torch.bincount(data.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def test_tiny_learns_well_below_chance_and_below_byte_frequencies(trained):
    run, rows = trained
    [row] = rows
    assert int(row["epoch"]) == 1 and int(row["step"]) == 132  # 270,000 train bytes / 64 / 32
    valid_loss = float(row["valid.loss"])
    valid = StdlibBytes(block_size=64, max_bytes=300_000, valid_fraction=0.1).streams()["valid"]
    # ln 256 = 5.55 at initialisation; predicting bytes by their frequency alone gives ~3.2 here
    assert valid_loss < 0.55 * LN_VOCAB, row
    assert valid_loss < _unigram_entropy(valid.data) - 0.5, row
    assert float(row["train.tokens_per_s"]) == pytest.approx(64 * float(row["train.samples_per_s"]))
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["variable"] == "valid.loss" and best["value"] == pytest.approx(valid_loss)


def test_the_tied_checkpoint_evaluates_to_the_logged_loss(trained):
    run, rows = trained
    result = forks.run(["eval", str(run), "--stream", "valid"], REPO, ENV, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    [saved] = list(run.glob("eval-valid-step-*.json"))
    assert json.loads(saved.read_text())["metrics"]["loss"] == pytest.approx(
        float(rows[0]["valid.loss"]), rel=1e-5
    )
