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
        with pytest.raises(ConfigError, match=f"towers does not support {words}"):
            strategies.create(
                config.validate(scenario(8, 1, devices=3, strategy="towers", **extra))
            )
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
