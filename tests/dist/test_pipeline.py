"""The pipeline strategy against one process, in float64: stages on real gloo processes, copies of
the pipeline beside them, uneven and short batches padded with samples of weight zero."""

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
from test_invariance import N_VALID, assert_same_run, rel  # noqa: E402

from phalanx import cli, config, rundir, strategies, worker  # noqa: E402
from phalanx.checkpoint import SHARDS, Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(600)
N_TRAIN = 37  # batches of 10 and 12 leave a last batch (7, 1) smaller than the micro-batch count


def scenario(batch: int, accumulation: int = 1, **extra) -> dict:
    raw = toy.regression_config(
        model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 4},
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9},
        dataset={"class": "toy.Regression", "batch_size": batch, "n_train": N_TRAIN},
        parallel={"accelerator": "cpu", "devices": 1, "gradient_accumulation": accumulation},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def piped(raw: dict, devices: int, split: list[str] | str, schedule: str, microbatches: int) -> dict:
    pipeline = {"split": split, "schedule": schedule, "microbatches": microbatches}
    parallel = {**raw["parallel"], "devices": devices, "strategy": "pipeline"}
    return {**raw, "parallel": {**parallel, "pipeline": pipeline}}


SCENARIOS = {
    "batch10": scenario(10),
    "batch12-accum3": scenario(12, 3),
    "batch10-clipped": scenario(10, optimizer={"max_grad_norm": 0.05}),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {name: workers.train(raw) for name, raw in SCENARIOS.items()}


FOUR = ["net.2", "net.4", "net.6"]  # 4 stages: two on each of 2 processes, looped


@pytest.mark.parametrize(
    ("devices", "split", "schedule"),
    [
        *[(2, ["net.4"], s) for s in ("gpipe", "1f1b")],
        *[(3, ["net.2", "net.4"], s) for s in ("gpipe", "1f1b")],
        *[(4, ["net.4"], s) for s in ("gpipe", "1f1b")],
        (2, FOUR, "interleaved"),
        (2, FOUR, "zero_bubble"),
        (4, FOUR, "interleaved"),
        (2, FOUR, "zbv"),
        (2, FOUR, "dualpipev"),
        (2, "auto", "1f1b"),
    ],
    ids=[
        "2-stages-gpipe",
        "2-stages-1f1b",
        "3-stages-gpipe",
        "3-stages-1f1b",
        "2-stages-2-copies-gpipe",
        "2-stages-2-copies-1f1b",
        "4-stages-on-2-interleaved",
        "4-stages-on-2-zero-bubble",
        "4-stages-on-2-2-copies-interleaved",
        "4-stages-on-2-in-a-v-zbv",
        "4-stages-on-2-in-a-v-dualpipev",
        "2-stages-split-auto",
    ],
)
def test_the_pipeline_trains_as_one_process(devices, split, schedule, reference):
    raws = [piped(raw, devices, split, schedule, 4) for raw in SCENARIOS.values()]
    per_rank = workers.run_ranks(devices, workers.train_all, raws)
    # every process counts the same collectives, whichever stages it holds (a middle stage sends
    # and receives twice what a first or last does): a hung one is named by its count
    for name, *results in zip(SCENARIOS, *per_rank, strict=True):
        assert len({got["collectives"] for got in results}) == 1, name
    for rank_results in per_rank:  # every rank logs the same global losses
        for name, got in zip(SCENARIOS, rank_results, strict=True):
            assert len(got["losses"]) == len(reference[name]["losses"])
            assert torch.allclose(
                torch.tensor(got["losses"]), torch.tensor(reference[name]["losses"]), rtol=1e-10
            ), name
    for name, got in zip(SCENARIOS, per_rank[0], strict=True):  # the whole model, on rank 0
        assert_same_run(got, reference[name])
        assert got["epochs"][-1]["valid"]["loss_count"] == N_VALID  # each sample once
        # a gathering hook sees the same batches, in dataset order, and the same outputs
        assert got["ids"] == reference[name]["ids"], name
        for stream, want in reference[name]["predictions"].items():
            mine = got["predictions"][stream]
            assert [len(b) for b in mine] == [len(b) for b in want], (name, stream)
            flat = [v for b in mine for v in b]
            expected = torch.tensor([v for b in want for v in b], dtype=torch.float64)
            assert rel(torch.tensor(flat, dtype=torch.float64), expected) < 1e-10


@pytest.mark.parametrize(
    ("devices", "split", "schedule"),
    [(3, ["net.2", "net.4"], "1f1b"), (2, FOUR, "interleaved")],
    ids=["3-stages-1f1b", "4-stages-on-2-interleaved"],
)
def test_a_model_that_calls_its_blocks_one_by_one_trains_as_one_process(
    devices, split, schedule, reference
):
    """A forward that loops over its blocks, where the stages cannot run the trunk whole: each
    stage's blocks run from inside the model's own loop, the others' pass their input through."""
    raw = scenario(10)
    raw["model"] = {**raw["model"], "class": "toy.Looped"}
    per_rank = workers.run_ranks(devices, workers.train_all, [piped(raw, devices, split, schedule, 4)])
    assert len({got["collectives"] for (got,) in per_rank}) == 1
    for (got,) in per_rank:
        assert torch.allclose(
            torch.tensor(got["losses"]), torch.tensor(reference["batch10"]["losses"]), rtol=1e-10
        )
    assert_same_run(per_rank[0][0], reference["batch10"])


@pytest.mark.parametrize("asking", [0, 1], ids=["first-stage-asks", "last-stage-asks"])
def test_a_stop_asked_on_one_stage_stops_every_stage_a_step_late_alike(asking, reference):
    """The ranks agree on the loss and the stop flag behind the step: a stop asked on one process
    after step 5 (epoch 2's first) is taken by step 6, read at step 7's end on every process
    alike, which then save and exit with SIGTERM's code; the losses up to there are the single
    process's."""
    raw = piped(SCENARIOS["batch10"], 2, ["net.4"], "1f1b", 4)
    ends = workers.run_ranks(2, workers.stop_on_one_rank, raw, asking, 5, timeout=120)
    assert [end["code"] for end in ends] == [143, 143]
    assert [end["step"] for end in ends] == [7, 7]
    want = torch.tensor(reference["batch10"]["losses"][:7])
    for end in ends:
        assert torch.allclose(torch.tensor(end["losses"]), want, rtol=1e-10)


def test_the_epoch_loss_that_no_step_waited_for_is_the_mean_of_the_steps(reference):
    """No hook reads a step's loss, so each step's agreement runs behind it unread; the epoch's
    mean, read at its end, is still the mean of the single process's step losses."""
    raw = piped(SCENARIOS["batch10"], 2, ["net.4"], "1f1b", 4)
    per_rank = workers.run_ranks(2, workers.epoch_losses, raw, timeout=120)
    losses = torch.tensor(reference["batch10"]["losses"], dtype=torch.float64)
    want = losses.reshape(2, -1).mean(1)  # 2 epochs of 4 steps
    for means in per_rank:
        assert torch.allclose(torch.tensor(means, dtype=torch.float64), want, rtol=1e-10)


def _agreeing_every(steps: int, batch: int = 10, **main_loop) -> dict:
    raw = piped(scenario(batch), 2, ["net.4"], "1f1b", 4)
    raw["main_loop"] = {"epochs": 3, "extra_streams": [], **main_loop}
    pipeline = {**raw["parallel"]["pipeline"], "agree_every": steps}
    return {**raw, "parallel": {**raw["parallel"], "pipeline": pipeline}}


def _single_losses(batch: int = 10) -> torch.Tensor:
    """The scenario's step losses over 3 epochs on one process."""
    single = workers.train(_agreeing_every(1, batch) | {"parallel": scenario(batch)["parallel"]})
    return torch.tensor(single["losses"], dtype=torch.float64)


def _mean_to(losses: torch.Tensor, step: int, agreed: int) -> float:
    """The epoch's mean loss at `step` over its steps agreed by `agreed` (NaN: none yet)."""
    first = (step - 1) // 4 * 4  # the epoch's first step, from 0
    return float(losses[first:agreed].mean()) if agreed > first else float("nan")


def test_steps_whose_loss_no_hook_reads_are_agreed_on_in_one_message():
    """A hook reads the step's loss every 3rd step and the epoch's at each evaluation round (every
    2nd step), on rank 0 alone: the processes agree on the steps between in one message (up to
    agree_every of them), so a read that one process makes alone still finds its step agreed (no
    hang), and reads the single process's loss; the display's reading of the epoch so far is the
    mean of the steps agreed by then, sent by no read of its own. Against agreeing every step,
    fewer agreements run."""
    losses = _single_losses()
    runs = {
        k: workers.run_ranks(
            2, workers.losses_read_every, _agreeing_every(k, eval_every_n_steps=2), 3, timeout=120
        )
        for k in (1, 4)
    }
    # agreed at once: the first step (it says whether the loss is weighted), then the windows'
    # last steps: read at 3, 6, 9, 12, evaluated after 2, 4, 6 ..., an epoch's last at 4, 8, 12
    agreed = {1: list(range(1, 13)), 4: [1, 2, 3, 4, 6, 8, 9, 10, 12]}
    for k, (first, _) in runs.items():
        assert first["code"] == 0
        assert sorted(first["losses"]) == [3, 6, 9, 12]
        for step, loss in first["losses"].items():
            assert loss == pytest.approx(float(losses[step - 1]), rel=1e-10)
        rounds = [_mean_to(losses, s, s) for s in range(2, 13, 2)]
        assert first["rounds"] == pytest.approx(rounds, rel=1e-10)
        shown = [_mean_to(losses, s, max(a for a in agreed[k] if a <= s)) for s in range(1, 13)]
        assert first["shown"] == pytest.approx(shown, rel=1e-10, nan_ok=True)
    saved = [a["entered"] - b["entered"] for a, b in zip(runs[1], runs[4], strict=True)]
    assert saved == [12 - 9] * 2


def test_a_run_stopped_inside_a_window_stops_alike_and_sends_what_it_gathered():
    """Batches of 5 (epochs of 8 steps), windows of up to 8 steps ended by a read every 3rd step:
    a stop asked by the last stage after step 2 rides in the window sent at step 3 and is taken
    when the next one goes, at step 6 (agreeing every step: at step 4), on both processes; a hook
    that ends the run at step 7, inside a window, has that window sent as the run ends (every
    process alike). The losses read are the single process's."""
    from phalanx.hooks import StopAfter

    losses = _single_losses(5)
    raw = _agreeing_every(8, 5)
    asked = workers.run_ranks(2, workers.losses_read_every, raw, 3, toy.RequestStopAt(1, 2))
    assert [(r["code"], r["step"]) for r in asked] == [(143, 6)] * 2
    ended = workers.run_ranks(2, workers.losses_read_every, raw, 3, StopAfter(steps=7))
    assert [(r["code"], r["step"]) for r in ended] == [(0, 7)] * 2
    for run in (asked, ended):
        assert run[0]["losses"] == pytest.approx({3: float(losses[2]), 6: float(losses[5])})


def test_a_loop_that_reads_no_loss_sends_its_steps_agreements_together_and_stops_a_window_late():
    """`Trainer.train_step(read=False)` with agree_every 4: after the first step (agreed at once:
    it tells every process whether the loss is weighted), every 4th step sends the window's
    agreements, and its stop flag is the window before's, so that a stop asked by the last stage
    at step 2 (in the first window) comes at step 9 on both processes; the losses are those of a
    loop that reads every step, whose stop comes a step late."""
    raw = _agreeing_every(4)
    late = workers.run_ranks(2, workers.steps_on_one_batch, raw, 10, False, 1, timeout=120)
    each = workers.run_ranks(2, workers.steps_on_one_batch, raw, 10, True, 1, timeout=120)
    for rank in range(2):
        assert late[rank]["agreed"] == [True] + [False, False, False, True] * 2 + [False]
        assert late[rank]["stop"] == [False] * 8 + [True, False]
        assert each[rank]["agreed"] == [True] * 10
        assert each[rank]["stop"] == [False, False, True] + [False] * 7
        assert late[rank]["losses"] == pytest.approx(each[rank]["losses"], rel=1e-12)
    # step 3's loss read before its window ended: the read sends the window (steps 2 and 3), and
    # the next window, sent at step 7, takes its stop flag; no step is sent twice
    read = workers.run_ranks(2, workers.steps_on_one_batch, raw, 10, False, 1, 2, timeout=120)
    for rank in range(2):
        assert read[rank]["agreed"] == [True, False, False, False, False, False, True] + [False] * 3
        assert read[rank]["stop"] == [False] * 6 + [True] + [False] * 3
        assert read[rank]["losses"] == pytest.approx(each[rank]["losses"], rel=1e-12)


def test_stop_on_nan_checks_each_step_once_its_window_is_sent_and_names_that_step():
    """StopOnNaN checks every step's loss (its default) without ending the windows of steps agreed
    on together: step 2's loss is infinite, and the run fails when step 2's window is sent (at
    step 5, agreeing every 4 steps after the first), naming step 2, where agreeing every step fails
    at step 2 (a check that ended the window would fail there too); before the epoch's end
    either way, and no later step's loss is said (the checks after the failing one are not
    read)."""
    from phalanx import data

    raw = _agreeing_every(4, 5)  # epochs of 8 steps
    bad = data.permutation(raw.get("seed", 0), 1, N_TRAIN)[5]  # step 2's first sample
    raw["dataset"] = {**raw["dataset"], "inf_at": bad}
    runs = {k: workers.run_ranks(2, workers.nan_checked, _windows(raw, k)) for k in (1, 4)}
    # StopAfter ends the run at step 4, inside the window: it ends the window there, and the
    # failure stands over its planned end
    runs[0] = workers.run_ranks(2, workers.nan_checked, _windows(raw, 4), 4)
    for k, failed_at in ((1, 2), (4, 5), (0, 4)):
        for run in runs[k]:
            assert (run["code"], run["step"], run["epochs"]) == (1, failed_at, 0)
            said = [e for e in run["errors"] if "(StopOnNaN)" in e]
            assert said == ["training stopped: the training loss is not finite (inf) at step 2 (StopOnNaN)"]


def _windows(raw: dict, steps: int) -> dict:
    pipeline = {**raw["parallel"]["pipeline"], "agree_every": steps}
    return {**raw, "parallel": {**raw["parallel"], "pipeline": pipeline}}


def _new_run(folder: Path, raw: dict) -> Path:
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    return rundir.create(cfg, path)


def _stopping(raw: dict, steps: int) -> dict:
    """The scenario over 3 epochs (4 steps each), checkpointed every epoch, stopped after `steps`."""
    return {
        **raw,
        "main_loop": {"epochs": 3, "extra_streams": []},
        "hooks": ["SaveLatest", {"StopAfter": {"steps": steps}}],
    }


def _resume(run: Path, processes: int, overrides: list[str]) -> None:
    more = ["hooks.1.StopAfter.steps=1000", *overrides]
    if processes == 1:
        assert worker.run_worker(run, True, more) == 0
    else:
        codes = workers.run_ranks(processes, workers.run_dir_worker, str(run), True, more)
        assert codes == [0] * processes


def test_a_run_stopped_mid_epoch_resumes_across_pipelines_ddp_and_one_process(tmp_path):
    """pipeline(2) -> ddp(2), fsdp(2), one process, pipeline(3), 4 stages on 2 (interleaved, in a
    V); fsdp(2) -> pipeline(2); ddp(3) ->
    pipeline(3): each ends as the run without a stop, and its export loads into the plain
    model."""
    raw = _stopping(scenario(10), 6)  # mid-epoch 2
    whole = workers.train({**raw, "hooks": []})
    pipe = _new_run(tmp_path / "pipe2", piped(raw, 2, ["net.4"], "1f1b", 4))
    assert workers.run_ranks(2, workers.run_dir_worker, str(pipe), False, []) == [0, 0]
    # one shard set per stage: each process wrote its own, and its half of the model
    shards = Checkpoints(pipe / "checkpoints").path(6) / SHARDS
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (shards.parent / "model.safetensors").exists()
    ddp = _new_run(tmp_path / "ddp3", {**raw, "parallel": {**raw["parallel"], "devices": 3}})
    assert workers.run_ranks(3, workers.run_dir_worker, str(ddp), False, []) == [0, 0, 0]
    fsdp = _new_run(
        tmp_path / "fsdp2",
        {**raw, "parallel": {**raw["parallel"], "devices": 2, "strategy": "fsdp"}},
    )
    assert workers.run_ranks(2, workers.run_dir_worker, str(fsdp), False, []) == [0, 0]
    three = [
        "parallel.devices=3",
        "parallel.strategy=pipeline",
        "parallel.pipeline={split: [net.2, net.4], microbatches: 3, schedule: gpipe}",
    ]
    resumed = {
        "pipe2-ddp2": (pipe, 2, ["parallel.strategy=ddp"]),
        "pipe2-fsdp2": (pipe, 2, ["parallel.strategy=fsdp"]),
        "pipe2-single": (pipe, 1, ["parallel.strategy=single", "parallel.devices=1"]),
        "pipe2-pipe3": (pipe, 3, three),
        "ddp3-pipe3": (ddp, 3, three),
        "fsdp2-pipe2": (
            fsdp,
            2,
            [
                "parallel.strategy=pipeline",
                "parallel.pipeline={split: [net.4], microbatches: 4, schedule: 1f1b}",
            ],
        ),
        "pipe2-interleaved": (
            pipe,
            2,
            ["parallel.pipeline={split: [net.2, net.4, net.6], schedule: interleaved}"],
        ),
        "pipe2-zbv": (
            pipe,
            2,
            ["parallel.pipeline={split: [net.2, net.4, net.6], schedule: zbv}"],
        ),
    }
    for name, (run, processes, overrides) in resumed.items():
        copy = tmp_path / name
        shutil.copytree(run, copy)
        _resume(copy, processes, overrides)
        assert f"resuming {copy} from step 6 " in (copy / "log.txt").read_text(), name
        out = tmp_path / f"{name}.safetensors"
        assert cli.main(["export", str(copy), "--checkpoint", "latest", "--output", str(out)]) == 0
        assert Checkpoints(copy / "checkpoints").latest_valid() == 12, name
        got = load_file(str(out))
        for key, value in whole["params"].items():
            assert rel(got[key], torch.tensor(value, dtype=torch.float64)) < 1e-10, (name, key)
        model = toy.Deep(features=3, hidden=4, layers=4).double()
        model.load_state_dict(got)  # plain PyTorch, strict


@pytest.mark.parametrize(
    ("devices", "split", "message"),
    [
        (3, ["net.4"], "makes 2 stages, 1 per process, so 2 processes a copy of the pipeline, but"),
        (3, ["net.1", "net.2"], "pipeline stage 1 holds no parameters"),
    ],
)
def test_a_pipeline_the_processes_or_the_model_cannot_make_is_one_error(devices, split, message):
    raw = piped(scenario(10), devices, split, "gpipe", 2)
    with pytest.raises(AssertionError, match=message):
        workers.run_ranks(devices, workers.train_all, [raw], timeout=120)


def test_a_weight_two_stages_share_is_one_error_that_names_it():
    raw = scenario(10)
    raw["model"] = {"class": "toy.Tied", "features": 4}
    raw["dataset"] = {**raw["dataset"], "features": 4}
    raw = piped(raw, 2, ["net.2"], "gpipe", 2)
    codes = workers.run_ranks(2, workers.error_lines, raw, timeout=120)
    for line in codes:  # every process says it, none hangs
        assert "net.4.weight is net.0.weight (a tied weight)" in line


def test_the_pipeline_strategy_without_its_split_points_says_how_to_give_them():
    raw = scenario(10)
    raw["parallel"] = {**raw["parallel"], "strategy": "pipeline"}
    with pytest.raises(config.ConfigError, match=r"needs parallel.pipeline.split.*net\.3"):
        strategies.create(config.validate(raw))


def lm(model: str, accumulation: int, **optimizer) -> dict:
    """Token-weighted losses: the config's cross entropy over real tokens (their count weighs each
    sample), or the model's own loss_weight."""
    raw = toy.regression_config(
        optimizer={"class": "SGD", "lr": 0.5, "momentum": 0.9, **optimizer},
        dataset={"class": "toy.Sequences", "batch_size": 10, "n_train": 32},
        parallel={"accelerator": "cpu", "devices": 1, "gradient_accumulation": accumulation},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )
    raw["model"] = {"class": model, "outputs": "logits", "blocks": 3}
    if model == "toy.ChainLM":
        raw["model"]["loss"] = {"function": "cross_entropy", "output": "logits", "target": "labels"}
    return raw


def test_token_weighted_losses_through_the_pipeline_train_as_one_process():
    raws = {
        "config-loss-accum3": lm("toy.ChainLM", 3),
        "model-weights-clipped": lm("toy.WeighingChainLM", 2, max_grad_norm=0.3),
    }
    want = [workers.train(raw) for raw in raws.values()]
    piped_raws = [piped(raw, 2, ["blocks.2"], "1f1b", 3) for raw in raws.values()]
    got = workers.run_ranks(2, workers.train_all, piped_raws)[0]
    for name, mine, theirs in zip(raws, got, want, strict=True):
        for key, value in theirs["params"].items():
            assert rel(torch.tensor(mine["params"][key]), torch.tensor(value)) < 1e-10, (name, key)
        assert rel(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"])) < 1e-10, name
        for a, b in zip(mine["epochs"], theirs["epochs"], strict=True):
            assert abs(a["valid"]["loss"] - b["valid"]["loss"]) <= 1e-10 * abs(b["valid"]["loss"])


def test_a_run_that_starts_from_trained_weights_does_so_on_every_strategy(tmp_path):
    """model.init_from: one process, the pipeline's stages (each keeping its part) and fsdp's
    shards start from the same weights and train alike."""
    from safetensors.torch import save_file

    torch.manual_seed(7)
    start = toy.Deep(features=3, hidden=4, layers=4).double()
    weights = tmp_path / "start.safetensors"
    save_file({k: v.contiguous() for k, v in start.state_dict().items()}, str(weights))
    raw = scenario(10)
    raw["model"] = {**raw["model"], "init_from": str(weights)}
    fresh = workers.train(scenario(10))
    alone = workers.train(raw)
    assert alone["losses"][0] != fresh["losses"][0]  # the weights were taken
    for name, setup in {
        "pipeline": piped(raw, 2, ["net.4"], "1f1b", 4),
        "fsdp": {**raw, "parallel": {**raw["parallel"], "devices": 2, "strategy": "fsdp"}},
    }.items():
        [got, _] = workers.run_ranks(2, workers.train_all, [setup])
        assert torch.allclose(
            torch.tensor(got[0]["losses"]), torch.tensor(alone["losses"]), rtol=1e-10
        ), name
        assert_same_run(got[0], alone)


def test_the_flops_of_a_step_are_the_whole_models_on_every_stage():
    """Each stage's process holds part of the model and runs only that part: the FLOPs are counted
    on the whole model, on the first stage too (which sees no outputs), as one process counts
    them; and no process warns."""
    raw = scenario(10)
    [alone] = workers.run_ranks(1, workers.counted_flops, raw)
    per_rank = workers.run_ranks(2, workers.counted_flops, piped(raw, 2, ["net.4"], "1f1b", 4))
    assert alone["flops"] is not None
    for got in per_rank:
        assert got["flops"] == pytest.approx(alone["flops"], rel=1e-12)
        assert not [line for line in got["lines"] if "FLOPs" in line], got["lines"]
