"""`towers`: one process, N replicas in threads (here N CPU replicas). The contract holds as for
processes: float64 training equals one device's to 1e-10, whichever of the two homes the variables
have, hooks see the global batch in dataset order, and checkpoints move between strategies."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import commands, config, strategies  # noqa: E402
from phalanx.checkpoint import WEIGHTS, Checkpoints  # noqa: E402
from phalanx.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(120)
N_TRAIN, N_VALID = (
    41,
    10,
)  # the last batch, 1 sample, leaves every tower but the first without a share


def scenario(batch: int, accumulation: int, **parallel) -> dict:
    return toy.contract_config(batch, accumulation, N_TRAIN, N_VALID, **parallel)


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def one_device() -> dict[tuple[int, int], dict]:
    return {(b, k): workers.train(scenario(b, k)) for b in (7, 10) for k in (1, 3)}


@pytest.mark.parametrize("variables_on", ["device0", "cpu"])
@pytest.mark.parametrize("towers", [1, 2, 3])
def test_towers_train_as_one_device(one_device, towers, variables_on):
    for (batch, accumulation), want in one_device.items():
        got = workers.train(
            scenario(
                batch,
                accumulation,
                devices=towers,
                strategy="towers",
                towers={"variables_on": variables_on},
            )
        )
        for name, value in want["params"].items():
            assert rel(got["params"][name], value) < 1e-10, (batch, accumulation, name)
        assert (
            len(got["losses"]) == len(want["losses"]) and rel(got["losses"], want["losses"]) < 1e-10
        )
        for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):
            assert mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID
            assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
                theirs["valid"]["loss"]
            )
        assert (
            got["ids"] == want["ids"]
        )  # every batch's samples reach the hooks whole, in dataset order


def test_towers_need_no_launcher_and_refuse_what_they_cannot_do(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    raw = scenario(8, 1, devices=3, strategy="towers")
    assert not strategies.needs_launch(config.validate(raw))
    assert len(strategies.create(config.validate(raw)).devices) == 3
    for extra, words in (
        (dict(shard_weights=[1, 1, 2]), "parallel.shard_weights"),
        (dict(sync_batchnorm=True), "parallel.sync_batchnorm"),
    ):
        with pytest.raises(ConfigError, match=f"towers does not support {words}") as info:
            strategies.create(
                config.validate(scenario(8, 1, devices=3, strategy="towers", **extra))
            )
        # the hint for fp16 only where fp16 is what is refused
        assert str(info.value).endswith("or use parallel.strategy=ddp")
    with pytest.raises(ConfigError, match='did you mean "variables_on"'):
        config.validate(scenario(8, 1, towers={"variables": "cpu"}))


def test_a_checkpoint_of_towers_resumes_on_another_tower_count_and_on_one_device(tmp_path):
    raw = scenario(7, 1, devices=2, strategy="towers")
    raw["main_loop"] = {"epochs": 3, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]  # 6 steps an epoch: mid-epoch 2
    whole = workers.train({**scenario(7, 1), "main_loop": raw["main_loop"]})
    assert commands.train(str(toy.write_config(tmp_path, raw)), []) == 0
    [run] = (tmp_path / "runs").iterdir()
    for i, more in enumerate(
        (["parallel.devices=3"], ["parallel.devices=1", "parallel.strategy=single"])
    ):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(run, copy)
        assert commands.resume(str(copy), ["hooks.1.StopAfter.steps=1000", *more]) == 0
        ckpts = Checkpoints(copy / "checkpoints")
        assert ckpts.latest_valid() == 18
        got = load_file(str(ckpts.path(18) / WEIGHTS))
        for name, value in whole["params"].items():
            assert rel(got[name].tolist(), value) < 1e-10, (more, name)


def dropout_run(towers: int, epochs: int = 3, stop: int = 1000, **parallel) -> dict:
    """toy.Regression (40 samples, batch 8: 5 steps an epoch) through a model with dropout, saved
    every step; dropout drawn from each tower's own stream (per_sample_random: false; keyed draws
    have no stream to keep)."""
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", "devices": towers, **parallel},
        main_loop={"epochs": epochs, "extra_streams": []},
        hooks=["SaveLatest", {"StopAfter": {"steps": stop}}],
    )
    return {**raw, "model": toy.dropout_model(), "per_sample_random": False}


def test_towers_with_dropout_are_reproducible_and_draw_as_ddp_ranks_do():
    """Each tower draws from its own stream, seeded as ddp's rank of its index: two runs are
    bit-identical, and equal ddp on as many processes (whose gradients add up the same way)."""
    raw = dropout_run(2, epochs=2, strategy="towers")
    first, second = workers.train(raw), workers.train(raw)
    assert first["params"].keys() == second["params"].keys()
    for name, value in first["params"].items():
        assert torch.equal(torch.tensor(second["params"][name]), torch.tensor(value)), name
    assert first["losses"] == second["losses"]
    [(ddp,), _] = workers.run_ranks(2, workers.train_all, [dropout_run(2, epochs=2)], timeout=100)
    for name, value in ddp["params"].items():
        assert rel(first["params"][name], value) < 1e-10, name
    single = workers.train(dropout_run(1, epochs=2))  # guards the above: dropout moves the result
    assert any(rel(first["params"][k], v) > 1e-3 for k, v in single["params"].items())


def test_towers_with_dropout_resume_bit_identical(tmp_path):
    """The towers' streams are saved in each checkpoint and continue on resume; on another tower
    count they are re-derived from the seed, the step and the tower's index, and the log says so."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert commands.train(str(toy.write_config(whole, dropout_run(2, strategy="towers"))), []) == 0
    stopped = dropout_run(2, stop=7, strategy="towers")  # mid-epoch 2
    assert commands.train(str(toy.write_config(parts, stopped)), []) == 0
    [run] = (parts / "runs").iterdir()
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert commands.resume(str(run), ["hooks.1.StopAfter.steps=1000"]) == 0
    [straight] = (whole / "runs").iterdir()
    want = load_file(str(Checkpoints(straight / "checkpoints").path(15) / WEIGHTS))
    got = load_file(str(Checkpoints(run / "checkpoints").path(15) / WEIGHTS))
    for name, value in want.items():
        assert torch.equal(got[name], value), name

    assert commands.resume(str(copy), ["hooks.1.StopAfter.steps=1000", "parallel.devices=3"]) == 0
    assert Checkpoints(copy / "checkpoints").latest_valid() == 15
    log = (copy / "log.txt").read_text()
    assert "each tower's random stream re-derived from the seed, the step and its index" in log
