"""`fsdp` on real gloo processes: the sharded model trains as one process does (float64, to 1e-10),
with uneven and empty shards, accumulation, CPU offload and activation checkpointing; its
checkpoints resume with fsdp on another process count, with ddp and on one process."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

from phalanx import cli, config, rundir, worker  # noqa: E402
from phalanx.checkpoint import SHARDS, WEIGHTS, Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(600)
N_TRAIN, N_VALID = 37, 10  # batch 7: a last batch of 2, smaller than 3 processes; batch 10: of 7


def scenario(batch: int, accumulation: int, **parallel) -> dict:
    return toy.contract_config(batch, accumulation, N_TRAIN, N_VALID, **parallel)


VARIANTS = {  # name -> (batch, accumulation, fsdp settings, activation checkpointing)
    "batch7": (7, 1, {}, []),
    "batch10-accum3": (10, 3, {}, []),
    "batch7-accum3-offload": (7, 3, {"offload": True}, []),
    "batch10-checkpointed-units": (10, 1, {"shard": ["Linear"]}, ["Tanh"]),
    "batch7-meta-init-offload": (7, 1, {"init": "meta", "offload": True}, []),
    "batch10-meta-init-units": (10, 1, {"init": "meta", "shard": ["Linear"]}, []),
}


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_trains_as_one_process(world_size):
    raws, want = [], []
    for batch, accumulation, fsdp, checkpointed in VARIANTS.values():
        want.append(workers.train(scenario(batch, accumulation)))
        raw = scenario(batch, accumulation, devices=world_size, strategy="fsdp", fsdp=fsdp)
        raws.append({**raw, "activation_checkpointing": checkpointed})
    main, *others = workers.run_ranks(world_size, workers.train_all, raws, timeout=400)
    for name, got, expected in zip(VARIANTS, main, want, strict=True):
        assert got["params"].keys() == expected["params"].keys()
        for key, value in expected["params"].items():  # the whole model, gathered to rank 0
            assert rel(got["params"][key], value) < 1e-10, (name, key)
        assert (
            len(got["losses"]) == len(expected["losses"])
            and rel(got["losses"], expected["losses"]) < 1e-10
        ), name
        for mine, theirs in zip(got["epochs"], expected["epochs"], strict=True):
            assert mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID, name
            assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
                theirs["valid"]["loss"]
            )
        assert got["ids"] == expected["ids"], name  # hooks see every batch whole, in dataset order
    for rank_results in others:  # every rank agrees on every step's loss
        for got, expected in zip(rank_results, want, strict=True):
            assert rel(got["losses"], expected["losses"]) < 1e-10


def test_a_fused_optimizer_clips_sharded_gradients_and_skips_a_non_finite_step_as_one_process():
    """Clipping for a fused AdamW hands it the non-finite flag on the device, beside sharded
    (DTensor) parameters: step 3's infinite loss is skipped on every rank, and the run is one
    process's."""
    raw = toy.regression_config(
        model={"class": "toy.InfAt", "features": 3, "step": 3},
        optimizer={"class": "AdamW", "lr": 0.05, "fused": True, "max_grad_norm": 1.0},
        main_loop={"epochs": 2, "extra_streams": []},
        hooks=[],
    )
    want = workers.train(raw)
    sharded = {**raw, "parallel": {"accelerator": "cpu", "devices": 2, "strategy": "fsdp"}}
    got, _ = workers.run_ranks(2, workers.train_all, [sharded], timeout=120)
    got = got[0]
    for key, value in want["params"].items():
        assert rel(got["params"][key], value) < 1e-10, key
    assert [e["train"]["grad_norm_nonfinite"] for e in got["epochs"]] == [1, 0]
    assert [e["train"]["grad_norm"] for e in got["epochs"]] == pytest.approx(
        [e["train"]["grad_norm"] for e in want["epochs"]], rel=1e-10
    )


def test_a_stop_asked_on_one_rank_is_taken_a_step_late_on_every_rank():
    """fsdp agrees on a plain loss behind the step: a stop asked on rank 1 alone after step 3 rides
    on step 4's agreement, read at step 5's end on every rank alike, which then save and exit with
    SIGTERM's code; each rank's losses up to there are one process's."""
    want = workers.train(scenario(7, 1))["losses"]
    raw = scenario(7, 1, devices=2, strategy="fsdp")
    ends = workers.run_ranks(2, workers.stop_on_one_rank, raw, 1, 3, timeout=120)
    assert [end["code"] for end in ends] == [143, 143]
    assert [end["step"] for end in ends] == [5, 5]
    for end in ends:
        assert rel(end["losses"], want[:5]) < 1e-10


def test_the_epoch_loss_that_no_step_waited_for_is_the_mean_of_the_steps():
    """No hook reads a step's loss, so each step's agreement runs behind it unread; each epoch's
    mean, read at its end, is the mean of one process's step losses, on every rank."""
    want = torch.tensor(workers.train(scenario(10, 1))["losses"], dtype=torch.float64)
    per_epoch = want.reshape(-1, 4).mean(1)  # 37 samples: 4 steps an epoch
    raw = scenario(10, 1, devices=2, strategy="fsdp")
    for means in workers.run_ranks(2, workers.epoch_losses, raw, timeout=120):
        assert rel(means, per_epoch.tolist()) < 1e-10


def test_a_meta_build_refuses_a_module_that_cannot_draw_its_values_again():
    raw = scenario(7, 1, devices=2, strategy="fsdp", fsdp={"init": "meta"})
    raw["model"] = {"class": "toy.Scaled", "features": 3}
    with pytest.raises(
        AssertionError,
        match=r"init: meta draws .* reset_parameters\(\), which Scaled does not "
        r"define; define it, or use parallel.fsdp.init: full",
    ):
        workers.run_ranks(2, workers.train_all, [raw], timeout=120)


def test_each_rank_holds_its_share_of_parameters_gradients_and_adam_state():
    """32 bytes a parameter in float64 with AdamW (the value, its gradient, two moments), over 2 ranks."""
    raw = scenario(8, 1, devices=2, strategy="fsdp")
    raw["model"] = {"class": "toy.Linear", "features": 64, "hidden": 64}  # 4,225 parameters
    raw["dataset"] = {**raw["dataset"], "features": 64, "n_train": 16}
    raw["main_loop"] = {"epochs": 1, "extra_streams": []}
    one = workers.train(
        {**raw, "parallel": {**raw["parallel"], "devices": 1, "strategy": "single"}}
    )
    ranks = workers.run_ranks(2, workers.train_all, [raw], timeout=200)
    n = 64 * 64 + 64 + 64 + 1
    assert one["state_bytes"]["parameters"] == 8 * n
    for (got,) in ranks:
        state = got["state_bytes"]
        assert state["parameters"] == state["gradients"]
        assert abs(sum(state.values()) - 32 * n / 2) <= 0.05 * 32 * n / 2, state
    # shards: each value once
    assert sum(got["state_bytes"]["parameters"] for (got,) in ranks) == 8 * n


def _new_run(folder: Path, raw: dict) -> Path:
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    return rundir.create(cfg, path)


def test_a_checkpoint_saved_by_fsdp_on_three_resumes_with_fsdp_on_two_ddp_and_one_process(tmp_path):
    raw = scenario(7, 1, devices=3, strategy="fsdp")
    raw["main_loop"] = {"epochs": 3, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]  # 6 steps an epoch: mid-epoch 2
    whole = workers.train({**scenario(7, 1), "main_loop": raw["main_loop"]})
    run = _new_run(tmp_path / "fsdp3", raw)
    codes = workers.run_ranks(3, workers.run_dir_worker, str(run), False, [], timeout=300)
    assert codes == [0, 0, 0]
    checkpoints = Checkpoints(run / "checkpoints")
    assert checkpoints.steps() == [6, 8]
    shards = checkpoints.path(8) / SHARDS  # each rank's shards, written by each rank; no whole copy
    assert sorted(p.name for p in shards.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]
    assert not (checkpoints.path(8) / WEIGHTS).exists()
    more = ["hooks.1.StopAfter.steps=1000"]
    resumed = {
        "fsdp2": (2, ["parallel.devices=2"]),
        "ddp2": (2, ["parallel.devices=2", "parallel.strategy=ddp"]),
        "single": (1, ["parallel.devices=1", "parallel.strategy=single"]),
        "fsdp2-after-a-damaged-shard": (2, ["parallel.devices=2"]),
    }
    for name, (processes, overrides) in resumed.items():
        copy = tmp_path / name
        shutil.copytree(run, copy)
        if "damaged" in name:  # resume falls back to step 6, and ends the same
            shard = copy / "checkpoints" / "step-8" / SHARDS / "__1_0.distcp"
            shard.write_bytes(shard.read_bytes()[:-8])
        if processes == 1:
            assert worker.run_worker(copy, True, [*more, *overrides]) == 0
        else:
            assert (
                workers.run_ranks(
                    processes,
                    workers.run_dir_worker,
                    str(copy),
                    True,
                    [*more, *overrides],
                    timeout=300,
                )
                == [0] * processes
            )
        log = (copy / "log.txt").read_text()
        resumed_from = 6 if "damaged" in name else 8
        assert f"resuming {copy} from step {resumed_from} " in log, name
        if "damaged" in name:
            assert "__1_0.distcp has" in log and "falling back to the previous one" in log
        out = tmp_path / f"{name}.safetensors"  # the command a user runs, for any layout
        assert cli.main(["export", str(copy), "--checkpoint", "latest", "--output", str(out)]) == 0
        got = load_file(str(out))
        assert Checkpoints(copy / "checkpoints").latest_valid() == 18, name
        for key, value in whole["params"].items():
            assert rel(got[key].tolist(), value) < 1e-10, (name, key)
        model = toy.Linear(features=3, hidden=4).double()
        model.load_state_dict(got)  # plain PyTorch, strict


def test_a_run_whose_optimizer_keeps_no_state_resumes_with_fsdp(tmp_path):
    """Plain SGD keeps no tensor of its own: its saved state is its groups' settings alone, which
    a sharded optimizer takes as well (torch's loader wants a tensor to place the state by)."""
    raw = scenario(7, 1)
    raw["optimizer"] = {"class": "SGD", "lr": 0.05}
    raw["main_loop"] = {"epochs": 2, "extra_streams": []}
    raw["hooks"] = ["SaveLatest", {"StopAfter": {"steps": 8}}]
    whole = workers.train({**raw, "hooks": []})
    run = _new_run(tmp_path / "single", raw)
    assert worker.run_worker(run, False, []) == 0
    go_on = ["hooks.1.StopAfter.steps=1000", "parallel.strategy=fsdp", "parallel.devices=2"]
    assert workers.run_ranks(2, workers.run_dir_worker, str(run), True, go_on) == [0, 0]
    assert f"resuming {run} from step 8 " in (run / "log.txt").read_text()
    out = tmp_path / "resumed.safetensors"
    assert cli.main(["export", str(run), "--checkpoint", "latest", "--output", str(out)]) == 0
    got = load_file(str(out))
    for key, value in whole["params"].items():
        assert rel(got[key].tolist(), value) < 1e-10, key


def transformer(**model) -> dict:
    """A transformer-like language model (tests/blocks.py) on toy.Sequences: 37 samples, batch 7,
    a last batch of 2; float64, one epoch and a validation stream."""
    raw = toy.regression_config(
        model={"class": "blocks.TinyTransformer", **model},
        optimizer={"class": "AdamW", "lr": 0.01},
        dataset={"class": "toy.Sequences", "batch_size": 7},
        parallel={"accelerator": "cpu", "devices": 1},
        main_loop={"epochs": 1, "extra_streams": ["valid"]},
        hooks=[],
    )
    raw["model"] = {"class": "blocks.TinyTransformer", **model}  # its own keys, not toy.Linear's
    return raw


LAYOUTS = {  # name -> (model settings, parallel.fsdp)
    "blocks-in-a-module-list": ({}, {}),
    "blocks-in-a-sequential": ({"sequential": True}, {}),
    "tied-embedding-and-head": ({"tied": True}, {}),
    "parts-called-past-their-block-as-one-unit": ({"class": "blocks.Shortcut"}, {"shard": []}),
}


def test_the_default_shards_a_transformer_with_its_blocks_in_a_module_list():
    """Each block of a ModuleList or Sequential is a unit of its own; the model trains on 2
    processes as on one, to 1e-10."""
    want = [workers.train(transformer(**model)) for model, _ in LAYOUTS.values()]
    raws = []
    for model, fsdp in LAYOUTS.values():
        raw = transformer(**model)
        raws.append(
            {**raw, "parallel": {**raw["parallel"], "devices": 2, "strategy": "fsdp", "fsdp": fsdp}}
        )
    main, other = workers.run_ranks(2, workers.train_all, raws, timeout=200)
    for name, got, expected in zip(LAYOUTS, main, want, strict=True):
        assert got["params"].keys() == expected["params"].keys(), name
        for key, value in expected["params"].items():
            assert rel(got["params"][key], value) < 1e-10, (name, key)
        assert len(got["losses"]) == 6 and rel(got["losses"], expected["losses"]) < 1e-10, name
        valid, theirs = got["epochs"][0]["valid"], expected["epochs"][0]["valid"]
        assert abs(valid["loss"] - theirs["loss"]) <= 1e-10 * abs(theirs["loss"]), name
    for got, expected in zip(other, want, strict=True):
        assert rel(got["losses"], expected["losses"]) < 1e-10


@pytest.mark.parametrize(
    ("model", "fsdp", "message"),
    [
        (
            {"class": "blocks.Shortcut"},
            {},
            r"parallel.fsdp.shard: the model uses parameters of a sharded unit without calling the "
            r"unit .*; set parallel.fsdp.shard to the classes of the modules the model calls whole",
        ),
        (
            {},
            {"shard": ["ModuleList"]},
            r"parallel.fsdp.shard names ModuleList: a container that is never called itself cannot "
            r"be a unit .*; "
            r"name the class of the blocks it holds instead, such as \[Block\]",
        ),
    ],
    ids=["parts-called-past-their-block", "a-module-list-named"],
)
def test_a_layout_fsdp_cannot_shard_is_one_line_naming_the_setting(model, fsdp, message):
    raw = transformer(**model)
    raw["parallel"] = {**raw["parallel"], "devices": 2, "strategy": "fsdp", "fsdp": fsdp}
    with pytest.raises(AssertionError, match=message) as failure:
        workers.run_ranks(2, workers.train_all, [raw], timeout=120)
    last = str(failure.value).strip().splitlines()[-1]  # what the command line prints, alone
    assert last.startswith("phalanx.errors.ConfigError: parallel.fsdp.shard")
