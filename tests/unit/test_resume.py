"""Resuming (contract 7): a run stopped mid-epoch and resumed ends bit-identical, in float64, to the
same run trained without a stop; the sample order, optimizer, schedulers and RNGs all continue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import toy
import yaml
from safetensors.torch import load_file, save

from phalanx import commands, rundir
from phalanx.checkpoint import TRAINER, WEIGHTS, Checkpoints
from phalanx.errors import CheckpointError, CheckpointMismatch, ConfigError, ModelError
from phalanx.hooks import SaveBest, StopOnPlateau

pytestmark = pytest.mark.timeout(120)

STOP = 3  # index of the StopAfter hook in the configs below


def _config(epochs: int = 3, stop_steps: int = 1000, **sections) -> dict:
    raw = toy.regression_config(main_loop={"epochs": epochs, "extra_streams": ["valid"]})
    raw["hooks"] = [
        {"ComputeStats": {"variables": ["loss"]}},
        "LogVariables",
        "SaveLatest",
        {"StopAfter": {"steps": stop_steps}},
    ]
    raw.update(sections)
    return raw


def _run_dir(folder: Path) -> Path:
    runs = [p for p in (folder / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def _latest(run_dir: Path) -> tuple[int, dict, dict[str, torch.Tensor]]:
    ckpts = Checkpoints(run_dir / "checkpoints")
    step = ckpts.latest_valid()
    assert step is not None
    state = json.loads((ckpts.path(step) / TRAINER).read_text())
    return step, state, load_file(str(ckpts.path(step) / WEIGHTS))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == torch.float64
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max().item())


def _uninterrupted(tmp_path: Path, raw: dict) -> tuple[int, dict, dict]:
    assert commands.train(str(toy.write_config(tmp_path / "whole", raw)), []) == 0
    return _latest(_run_dir(tmp_path / "whole"))


def _stopped(tmp_path: Path, raw: dict, stop: int) -> Path:
    raw = {**raw, "hooks": [*raw["hooks"][:STOP], {"StopAfter": {"steps": stop}}]}
    assert commands.train(str(toy.write_config(tmp_path / "parts", raw)), []) == 0
    return _run_dir(tmp_path / "parts")


def _check_mid_epoch_stop(run_dir: Path, stop: int, steps_per_epoch: int) -> dict:
    step, state, weights = _latest(run_dir)
    assert step == stop
    assert state["step"] == stop and 0 < state["step_in_epoch"] < steps_per_epoch
    assert state["epoch"] == stop // steps_per_epoch
    return weights


@pytest.mark.parametrize("accumulation", [1, 3])
def test_resume_mid_epoch_matches_uninterrupted_training(tmp_path, accumulation):
    raw = _config(parallel={"gradient_accumulation": accumulation})
    end, state, whole = _uninterrupted(tmp_path, raw)
    assert end == 15 and state["epoch"] == 3  # 40 samples, batch 8: 5 steps per epoch

    run_dir = _stopped(tmp_path, raw, stop=7)
    stopped = _check_mid_epoch_stop(run_dir, 7, 5)
    assert any(not torch.equal(stopped[k], whole[k]) for k in whole)

    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    assert _run_dir(tmp_path / "parts") == run_dir  # the same run continues
    end, state, resumed = _latest(run_dir)
    assert end == 15 and state["epoch"] == 3 and state["step_in_epoch"] == 0
    _assert_equal(resumed, whole)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["hooks"][STOP] == {"StopAfter": {"steps": 1000}}  # the override is recorded


def test_resume_mid_epoch_with_dropout_restores_the_rng(tmp_path):
    # torch's own generator (keyed draws need nothing restored)
    raw = {**_config(model=toy.dropout_model()), "per_sample_random": False}
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    _check_mid_epoch_stop(run_dir, 7, 5)
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


def test_dropout_draws_differ_between_seeds(tmp_path):
    """Guards the test above: with dropout, training does depend on the RNG stream."""
    _, _, a = _uninterrupted(tmp_path, _config(epochs=1, model=toy.dropout_model()))
    _, _, b = _uninterrupted(
        tmp_path / "other", _config(epochs=1, model=toy.dropout_model(), seed=1)
    )
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_mid_epoch_classes_with_momentum_warmup_and_scheduler(tmp_path):
    """60 samples, batch 7 (last batch 4), accumulation 2; momentum and schedules are restored."""
    raw = _config(
        model={"class": "toy.Classifier", "features": 4, "classes": 3},
        dataset={"class": "toy.Classes", "batch_size": 7},
        optimizer={"class": "SGD", "lr": 0.1, "momentum": 0.9, "warmup_steps": 4},
        scheduler={"class": "StepLR", "step_size": 5, "gamma": 0.7, "interval": "step"},
        parallel={"gradient_accumulation": 2},
    )
    end, _, whole = _uninterrupted(tmp_path, raw)
    assert end == 27  # 9 steps per epoch
    run_dir = _stopped(tmp_path, raw, stop=13)
    _check_mid_epoch_stop(run_dir, 13, 9)
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 27
    _assert_equal(resumed, whole)


def test_resume_falls_back_to_the_previous_valid_checkpoint(tmp_path):
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert ckpts.steps() == [5, 7]  # SaveLatest after epoch 1, and at the stop
    weights = ckpts.path(7) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


def test_a_resume_with_no_checkpoint_to_restore_leaves_the_run_as_it_was(tmp_path):
    """Every checkpoint damaged: one error names the newest one's fault and the older steps, and
    the run's config, trace and log are as they were (no warning appended)."""
    run_dir = _stopped(tmp_path, _config(), stop=7)
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert ckpts.steps() == [5, 7]
    for step in (5, 7):
        weights = ckpts.path(step) / WEIGHTS
        weights.write_bytes(weights.read_bytes()[:-8])
    files = ("config.yaml", "trace.jsonl", "log.txt")
    before = {name: (run_dir / name).read_bytes() for name in files}
    with pytest.raises(CheckpointError, match="no valid checkpoint") as refused:
        commands.resume(str(run_dir), [])
    assert str(ckpts.path(7) / WEIGHTS) in str(refused.value)
    assert "the older step-5 could not be restored either" in str(refused.value)
    assert {name: (run_dir / name).read_bytes() for name in files} == before


def test_resume_mid_epoch_with_another_batch_size_is_a_config_error(tmp_path):
    run_dir = _stopped(tmp_path, _config(), stop=7)
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError) as info:
        commands.resume(
            str(run_dir), ["dataset.batch_size=4", f"hooks.{STOP}.StopAfter.steps=1000"]
        )
    message = str(info.value)
    assert "dataset.batch_size=8" in message and "4" in message
    assert (run_dir / "config.yaml").read_text() == before  # a refused resume changes nothing
    assert Checkpoints(run_dir / "checkpoints").latest_valid() == 7


def test_resume_at_an_epoch_boundary_may_change_the_batch_size(tmp_path):
    raw = _config(
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "LogVariables",
            "SaveLatest",
            {"StopAfter": {"epochs": 1}},
        ]
    )
    assert commands.train(str(toy.write_config(tmp_path / "parts", raw)), []) == 0
    run_dir = _run_dir(tmp_path / "parts")
    step, state, _ = _latest(run_dir)
    assert (step, state["epoch"], state["step_in_epoch"]) == (5, 1, 0)
    assert (
        commands.resume(
            str(run_dir), ["dataset.batch_size=4", f"hooks.{STOP}.StopAfter.epochs=1000"]
        )
        == 0
    )
    step, state, _ = _latest(run_dir)
    assert (step, state["epoch"], state["batch_size"]) == (5 + 2 * 10, 3, 4)


# --- damaged and unparsable checkpoints
# ------------------------------------------------------------


def test_resume_through_a_damaged_step_writes_it_again(tmp_path):
    """Falling back past a damaged step trains through that step again: it is saved anew, so the
    best checkpoint it becomes can be evaluated."""
    raw = _config()
    raw["hooks"] = [
        {"ComputeStats": {"variables": ["loss"]}},
        {"SaveBest": {"variable": "valid.loss", "mode": "min"}},
        "SaveLatest",
        {"StopAfter": {"steps": 1000}},
    ]
    _uninterrupted(tmp_path, raw)
    whole = Checkpoints(_run_dir(tmp_path / "whole") / "checkpoints")
    run_dir = _stopped(tmp_path, raw, stop=10)
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert ckpts.steps() == [5, 10]  # the stop came before step 10's evaluation: the best is step 5
    weights = ckpts.path(10) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    assert ckpts.verify(10)  # written again when training passed step 10
    _assert_equal(load_file(str(weights)), load_file(str(whole.path(10) / WEIGHTS)))
    assert ckpts.verify(ckpts.best())
    assert commands.evaluate(str(run_dir), "valid", "best")["checkpoint"] == ckpts.best()


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace one file of a step and its manifest entry: the step verifies, its content is bad."""
    import hashlib

    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name, content",
    [
        (TRAINER, lambda state: b"{}"),
        (
            TRAINER,
            lambda state: json.dumps({**state, "step_in_epoch": 6}).encode(),
        ),  # an epoch has 5 steps
        ("optimizer.pt", lambda state: bytes(range(256)) * 8),
        (TRAINER, lambda state: b"[" * 100_000 + b"]" * 100_000),  # beyond json's recursion
    ],
    ids=[
        "empty-trainer-state",
        "step-beyond-the-epoch",
        "optimizer-of-random-bytes",
        "trainer-state-nested-too-deep",
    ],
)
def test_resume_falls_back_past_a_step_whose_files_verify_but_do_not_parse(tmp_path, name, content):
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    folder = Checkpoints(run_dir / "checkpoints").path(7)
    _rewrite(folder, name, content(json.loads((folder / TRAINER).read_text())))
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    warning = next(
        line
        for line in (run_dir / "log.txt").read_text().splitlines()
        if "skipping checkpoint" in line
    )
    assert "step-7" in warning and str(folder / name) in warning
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


# --- overrides on resume
# ---------------------------------------------------------------------------


def _final_lr(run_dir: Path) -> float:
    ckpts = Checkpoints(run_dir / "checkpoints")
    saved = torch.load(ckpts.path(ckpts.latest_valid()) / "optimizer.pt", weights_only=True)
    return saved["optimizer"]["param_groups"][0]["lr"]


def test_resume_applies_a_new_learning_rate_through_warmup_and_schedule(tmp_path):
    """optimizer.lr=0.2 on resume: from then on the rate is the new config's at that step, as a run
    configured with 0.2 from the start has it."""
    raw = _config(
        optimizer={"class": "SGD", "lr": 0.05, "momentum": 0.9, "warmup_steps": 3},
        scheduler={"class": "StepLR", "step_size": 4, "gamma": 0.5},
    )
    _uninterrupted(tmp_path / "at-0.2", {**raw, "optimizer": {**raw["optimizer"], "lr": 0.2}})
    _uninterrupted(tmp_path / "at-0.05", raw)
    want, old = (
        _final_lr(_run_dir(tmp_path / "at-0.2" / "whole")),
        _final_lr(_run_dir(tmp_path / "at-0.05" / "whole")),
    )
    assert want != old
    run_dir = _stopped(tmp_path, raw, stop=7)
    assert (
        commands.resume(str(run_dir), ["optimizer.lr=0.2", f"hooks.{STOP}.StopAfter.steps=1000"])
        == 0
    )
    assert _latest(run_dir)[0] == 15
    assert _final_lr(run_dir) == want
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer"]["lr"] == 0.2


@pytest.mark.parametrize(
    "override, words",
    [
        ("seed=1", "seed=1 would change the samples of the epoch in progress"),
        ("dataset.n_train=30", "dataset.n_train=30 would change the samples"),
        ("optimizer.class=AdamW", "optimizer.class=AdamW cannot take over on resume"),
    ],
)
def test_resume_refuses_an_override_the_checkpoint_cannot_take(tmp_path, override, words):
    run_dir = _stopped(tmp_path, _config(), stop=7)
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=words):
        commands.resume(str(run_dir), [override, f"hooks.{STOP}.StopAfter.steps=1000"])
    assert (run_dir / "config.yaml").read_text() == before
    assert Checkpoints(run_dir / "checkpoints").latest_valid() == 7


@pytest.mark.parametrize(
    "bad, words",
    [
        # refused by a hook's check before the first step
        (
            "+hooks={SaveBest: {variable: test.loss}}",
            "stream 'test' of test.loss is not evaluated",
        ),
        # refused at the first batch
        ("hooks.0.ComputeStats.variables=[nosuch]", "variable 'nosuch' is not in the batch"),
    ],
)
def test_a_resume_refused_before_its_first_step_keeps_the_runs_config(tmp_path, bad, words):
    """A resume's overrides are written into the run's config once its first step has gone
    through: one refused before that leaves the config as it was, and the next resume goes on."""
    run_dir = _stopped(tmp_path, _config(), stop=7)
    before = (run_dir / "config.yaml").read_text()
    go_on = f"hooks.{STOP}.StopAfter.steps=1000"
    with pytest.raises((ConfigError, ModelError), match=words):
        commands.resume(str(run_dir), [go_on, bad])
    assert (run_dir / "config.yaml").read_text() == before
    assert Checkpoints(run_dir / "checkpoints").latest_valid() == 7
    assert commands.resume(str(run_dir), [go_on]) == 0
    assert _latest(run_dir)[0] == 15
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["hooks"][STOP] == {"StopAfter": {"steps": 1000}}


def test_a_refused_pipeline_resume_leaves_the_run_as_it_was(tmp_path):
    """Overrides whose strategy cannot run (1f1b with fewer micro-batches than stages) are refused
    before any process starts: the config, the trace and the log are as they were, and a plain
    resume goes on."""
    raw = _config(model={"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 3})
    run_dir = _stopped(tmp_path, raw, stop=7)
    files = ("config.yaml", "trace.jsonl", "log.txt")
    before = {name: (run_dir / name).read_bytes() for name in files}
    pipeline = [
        "parallel.strategy=pipeline",
        "parallel.accelerator=cpu",
        "parallel.devices=3",
        "parallel.pipeline={split: [net.2, net.4], microbatches: 2}",
    ]
    with pytest.raises(ConfigError, match="1f1b needs at least as many micro-batches as stages"):
        commands.resume(str(run_dir), [*pipeline, f"hooks.{STOP}.StopAfter.steps=1000"])
    assert {name: (run_dir / name).read_bytes() for name in files} == before
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    assert _latest(run_dir)[0] == 15


def test_resume_at_an_epoch_boundary_may_change_the_seed(tmp_path):
    raw = _config(
        hooks=[
            {"ComputeStats": {"variables": ["loss"]}},
            "LogVariables",
            "SaveLatest",
            {"StopAfter": {"epochs": 1}},
        ]
    )
    assert commands.train(str(toy.write_config(tmp_path / "parts", raw)), []) == 0
    run_dir = _run_dir(tmp_path / "parts")
    assert commands.resume(str(run_dir), ["seed=1", f"hooks.{STOP}.StopAfter.epochs=1000"]) == 0
    assert _latest(run_dir)[0] == 15


def test_a_checkpoint_after_an_epochs_last_step_resumes_with_that_epochs_end(tmp_path):
    """Stopped right after step 5, the last of epoch 1, before its evaluation: the checkpoint says 5
    steps into epoch 1, and resuming ends that epoch (its evaluation, its schedulers) and goes
    on."""
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=5)
    step, state, _ = _latest(run_dir)
    assert (step, state["epoch"], state["step_in_epoch"]) == (5, 0, 5)
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    end, state, resumed = _latest(run_dir)
    assert (end, state["epoch"]) == (15, 3)
    _assert_equal(resumed, whole)


def test_a_run_from_before_the_feistel_order_keeps_its_own(tmp_path):
    """A checkpoint whose trainer state names no order was saved by a run that visits each epoch in
    torch.randperm's order: it resumes, and saves again, in that order."""
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    step, state, _ = _latest(run_dir)
    assert state["order"] == "feistel"
    del state["order"]
    _rewrite(Checkpoints(run_dir / "checkpoints").path(step), TRAINER, json.dumps(state).encode())
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    assert "keeps the sample order it started with (randperm" in (run_dir / "log.txt").read_text()
    end, state, resumed = _latest(run_dir)
    assert end == 15 and state["order"] == "randperm"
    assert any(not torch.equal(resumed[k], whole[k]) for k in whole)  # another order, other weights


# --- steps a resume cannot continue from, though their files verify
# ---------------------------------------------------------------------------


def test_a_step_whose_weights_are_not_finite_is_not_saved(tmp_path):
    """SGD at 1e150 overflows the weights within a few steps: every step is saved (SaveEvery comes
    before StopOnNaN) until the one whose weights are not finite, which is not, and StopOnNaN fails
    the run there."""
    raw = _config(optimizer={"class": "SGD", "lr": 1e150})
    raw["hooks"] = [{"SaveEvery": {"steps": 1}}, "StopOnNaN"]
    assert commands.train(str(toy.write_config(tmp_path / "run", raw)), []) == 1
    run_dir = _run_dir(tmp_path / "run")
    failed = next(e["step"] for e in rundir.read_trace(run_dir) if e["event"] == "failed")
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert failed > 1 and ckpts.steps() == list(range(1, failed))
    for step in ckpts.steps():
        weights = load_file(str(ckpts.path(step) / WEIGHTS))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert (
        f"the weights are not finite at step {failed}: it is not saved; a resume goes on from "
        f"step {failed - 1}"
    ) in (run_dir / "log.txt").read_text()


def test_a_run_that_diverges_without_stop_on_nan_fails_at_its_end_and_says_so_once(tmp_path):
    """Without StopOnNaN a diverged run trains to its end; that end is not saved (its weights are
    not finite), so the run did not finish: it fails, naming the last sound step, and the refused
    save is said once a step however many hooks ask for it."""
    raw = _config(epochs=2, optimizer={"class": "SGD", "lr": 1e150})
    raw["hooks"] = [{"SaveEvery": {"steps": 1}}, "SaveLatest"]
    assert commands.train(str(toy.write_config(tmp_path / "run", raw)), []) == 1
    run_dir = _run_dir(tmp_path / "run")
    log = (run_dir / "log.txt").read_text()
    saved = Checkpoints(run_dir / "checkpoints").steps()
    assert saved and saved[-1] < 10
    assert log.count("the weights are not finite at step 10: it is not saved") == 1
    assert (
        "training diverged: the weights are not finite at the last step, 10, so the run's end is "
        f"not saved (the last sound step saved is {saved[-1]})"
    ) in log
    end = rundir.read_trace(run_dir)[-1]
    assert end["event"] == "failed" and end["error"] == "the weights are not finite"


def test_resume_falls_back_past_a_step_whose_weights_are_not_finite(tmp_path):
    """A step saved with weights that are not finite (by an older version): a resume would only
    diverge again, so it goes on from the step before, as the run trained whole did."""
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=7)
    folder = Checkpoints(run_dir / "checkpoints").path(7)
    weights = load_file(str(folder / WEIGHTS))
    _rewrite(
        folder, WEIGHTS, save({k: torch.full_like(v, float("nan")) for k, v in weights.items()})
    )
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    log = (run_dir / "log.txt").read_text()
    assert f"skipping checkpoint step-7: {folder} holds weights that are not finite" in log
    assert f"resuming {run_dir} from step 5" in log
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)


def test_a_newest_step_of_another_model_is_passed_and_saved_again_when_training_reaches_it(
    tmp_path,
):
    """The newest step holds weights of another shape (a step copied from another run): the resume
    names the mismatch, goes on from the step before, and when training reaches that step again it
    is replaced, though its files verify. Where no step fits (an override that changes the model),
    one error names the mismatch and the fix, and changes nothing."""
    raw = _config()
    _, _, whole = _uninterrupted(tmp_path, raw)
    run_dir = _stopped(tmp_path, raw, stop=10)
    ckpts = Checkpoints(run_dir / "checkpoints")
    assert ckpts.steps() == [5, 10]
    _rewrite(ckpts.path(10), WEIGHTS, save(toy.Linear(features=4).double().state_dict()))
    assert commands.resume(str(run_dir), [f"hooks.{STOP}.StopAfter.steps=1000"]) == 0
    log = (run_dir / "log.txt").read_text()
    assert f"skipping checkpoint step-10: {ckpts.path(10) / WEIGHTS} does not fit this model" in log
    assert "size mismatch for net.weight: copying a param with shape torch.Size([1, 4])" in log
    assert f"resuming {run_dir} from step 5" in log
    _assert_equal(load_file(str(ckpts.path(10) / WEIGHTS)), _weights_at(tmp_path, 10))
    end, _, resumed = _latest(run_dir)
    assert end == 15
    _assert_equal(resumed, whole)

    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(CheckpointMismatch) as info:
        commands.resume(str(run_dir), ["model.hidden=4"])
    message = str(info.value)
    assert f"no checkpoint of {run_dir} fits the model its config builds" in message
    assert "step-15" in message and "resume without the overrides that change the model" in message
    assert (run_dir / "config.yaml").read_text() == before
    assert ckpts.steps() == [5, 10, 15]
    # the same model change made in the run's config.yaml by hand: the fix is the file's
    edited = yaml.safe_load(before)
    edited["model"]["hidden"] = 4
    (run_dir / "config.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    with pytest.raises(CheckpointMismatch) as info:
        commands.resume(str(run_dir), [])
    message = str(info.value)
    assert "overrides" not in message
    assert f"put back in {run_dir / 'config.yaml'} the model settings the run was" in message
    assert ckpts.steps() == [5, 10, 15]


def _weights_at(tmp_path: Path, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s weights in the run trained whole."""
    ckpts = Checkpoints(_run_dir(tmp_path / "whole") / "checkpoints")
    return load_file(str(ckpts.path(step) / WEIGHTS))


@pytest.mark.parametrize(
    "hook, state, words",
    [
        (SaveBest(), {"best": "0.5"}, "SaveBest's saved best is '0.5', not float or int"),
        (StopOnPlateau(), {"best": 0.5, "waited": [1]}, "saved waited is \\[1\\], not int"),
    ],
)
def test_a_hooks_saved_state_of_another_shape_is_refused_before_training_meets_it(
    hook, state, words
):
    """A ValueError, which a resume takes for a damaged step (it would fail a step much later)."""
    with pytest.raises(ValueError, match=words):
        hook.load_state_dict(state)
