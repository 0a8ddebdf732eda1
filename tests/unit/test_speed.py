"""Speed switches change how a step runs, never what it computes: compile, channels_last, loader
workers, fused optimizers; and the profiler's trace."""

from __future__ import annotations

import math

import pytest
import torch
import toy

from phalanx import config
from phalanx.build import build_optimizer
from phalanx.errors import ConfigError
from phalanx.hooks import ComputeStats, Hook
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(240)
TESTS = toy.__file__.rsplit("/", 1)[0]


def train(tmp_path, hooks=None, model=None, **sections) -> Trainer:
    raw = toy.regression_config(**{"main_loop": {"epochs": 2, "extra_streams": []}, **sections})
    raw["model"] = model or raw["model"]
    cfg = config.validate(raw)
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, tmp_path, [TESTS], hooks=hooks)
    assert trainer.run() == 0
    return trainer


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in b:
        assert torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-12), k


def test_compile_trains_the_same_and_saves_the_plain_module(tmp_path):
    plain = train(tmp_path / "plain", hooks=[ComputeStats()])
    compiled = train(tmp_path / "compiled", hooks=[ComputeStats()], compile={"backend": "eager"})
    assert isinstance(compiled.module, torch._dynamo.eval_frame.OptimizedModule)
    assert_close(params(compiled), params(plain))
    compiled.save_checkpoint()
    from safetensors.torch import load_file

    saved = load_file(
        tmp_path / "compiled" / "checkpoints" / f"step-{compiled.step}" / "model.safetensors"
    )
    assert set(saved) == set(
        params(plain)
    )  # no "_orig_mod." prefix: the checkpoint fits the plain model


def test_outputs_of_a_model_replayed_as_cuda_graphs_are_copied_before_the_hooks_keep_them(
    tmp_path, monkeypatch
):
    """Compiled to replay as CUDA graphs, a model's outputs are overwritten by its next call; the
    statistics of the epoch, which keep each batch's losses until its end, read copies. (On the
    CPU torch replays no graphs: `toy.Overwritten`, not compiled, overwrites its outputs as a
    replay would, and the run is told that its model replays them; the GPU tier runs the real
    thing.)"""
    from phalanx import parts

    linear = {"class": "toy.Linear", "features": 3}
    overwritten = {"class": "toy.Overwritten", "features": 3}
    runs = {}
    for name, model, copies in [
        ("plain", linear, False),
        ("not copied", overwritten, False),
        ("copied", overwritten, True),
    ]:
        monkeypatch.setattr(parts, "replays_graphs", lambda compiled, device, c=copies: c)
        stats = toy.Record()
        train(tmp_path / name, hooks=[ComputeStats(), stats], model=model)
        runs[name] = [epoch["train"]["loss"] for epoch in stats.epochs]
    assert len(runs["plain"]) == 2 and all(math.isfinite(v) for v in runs["plain"])
    assert all(math.isnan(v) for v in runs["not copied"])  # what a replay would do to them
    assert runs["copied"] == runs["plain"]


def test_a_model_replayed_as_cuda_graphs_is_told_where_each_step_and_evaluation_starts(
    tmp_path, monkeypatch
):
    """Replayed as CUDA graphs, a model's first micro-batch's gradients live in its backward
    graph's memory, which torch frees at the next forward after a backward unless told that the
    step goes on: the step start is marked once per step, not per micro-batch (a mark before the
    second would free the first's gradients), and before each evaluation batch, whose outputs are
    copied; a model that replays no graphs gets no marks. (The GPU tier trains such a model with
    accumulation.)"""
    from phalanx import parts

    events: list[str] = []  # "mark", and each batch's stream once the batch is done

    class Batches(Hook):
        def after_batch(self, stream, batch):
            events.append(stream)

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    sections = dict(
        parallel={"accelerator": "cpu", "devices": 1, "gradient_accumulation": 2},
        dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 40, "n_valid": 12},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
    )
    for copies in (False, True):
        events.clear()
        monkeypatch.setattr(parts, "replays_graphs", lambda compiled, device, c=copies: c)
        trainer = train(tmp_path / str(copies), hooks=[ComputeStats(), Batches()], **sections)
        if not copies:
            assert "mark" not in events
    assert trainer.step == 10  # 5 steps of 2 micro-batches an epoch
    batches = events[1::2]
    assert events[0::2] == ["mark"] * len(batches)  # one mark before each batch, no more
    assert batches == (["train"] * 5 + ["valid"] * 2) * 2  # 12 samples in batches of 8


def test_a_compile_backend_or_mode_torch_does_not_know_is_one_config_error(tmp_path):
    for compiled, named in [({"mode": "fastest"}, "'fastest'"), ({"backend": "nope"}, "'nope'")]:
        with pytest.raises(ConfigError, match=rf"compile \(backend .*{named}.*compile: false"):
            train(tmp_path / named.strip("'"), compile=compiled)


def test_which_compiled_models_replay_as_cuda_graphs():
    from phalanx.parts import replays_graphs

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    compiled = config.CompileConfig
    assert replays_graphs(compiled(mode="reduce-overhead"), gpu)
    assert replays_graphs(compiled(mode="max-autotune"), gpu)
    assert replays_graphs(compiled(backend="cudagraphs"), gpu)
    assert not replays_graphs(compiled(mode="max-autotune-no-cudagraphs"), gpu)
    assert not replays_graphs(compiled(), gpu)
    assert not replays_graphs(compiled(backend="eager", mode="reduce-overhead"), gpu)
    assert not replays_graphs(compiled(mode="reduce-overhead"), cpu)
    assert not replays_graphs(None, gpu)


def test_channels_last_trains_the_same(tmp_path):
    sections = dict(
        model={"class": "toy.ConvNet"}, dataset={"class": "toy.ImageRegression", "batch_size": 8}
    )
    plain = train(tmp_path / "plain", hooks=[ComputeStats()], **sections)
    last = train(tmp_path / "last", hooks=[ComputeStats()], channels_last=True, **sections)
    assert last.model.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert_close(params(last), params(plain))


def test_loader_workers_give_the_same_batches(tmp_path):
    assert train(tmp_path / "auto", hooks=[]).feed.loader_options == {
        "num_workers": 0,
        "pin_memory": False,
    }
    zero = train(tmp_path / "zero", hooks=[ComputeStats()], dataset={"num_workers": 0})
    two = train(tmp_path / "two", hooks=[ComputeStats()], dataset={"num_workers": 2})
    assert two.feed.loader_options["num_workers"] == 2
    assert_close(params(two), params(zero))


_INHERITED_GROUP = """
import gc, os, sys
import torch, torch.distributed as dist
from phalanx import data, loading

class Collecting(torch.utils.data.Dataset):  # a worker whose reads run its garbage collector
    def __len__(self):
        return 8

    def __getitem__(self, i):
        gc.collect()
        return {"x": torch.tensor([float(i)])}

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
group = dist.new_group([0])
dist.all_reduce(torch.ones(1), group=group)

class Holder:
    pass

holder = Holder()
holder.group, holder.me = group, holder  # garbage in a cycle, once dropped
del group, holder
dist.destroy_process_group()
gc.disable()  # as a busy process may not have collected it yet
batches = loading.loader(Collecting(), data.Plan(range(8), 4), num_workers=1)
print(sum(float(b["x"].sum()) for b in batches))
"""


def test_a_forked_worker_inherits_no_garbage_that_hangs_it(tmp_path):
    """A loader worker forked from a process that holds an unreachable, destroyed process group
    would free it with its first collection, and wait for threads it does not have: the loader
    collects before it forks."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "inherited.py"
    script.write_text(_INHERITED_GROUP)
    done = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "28.0"


class Pids(Hook):
    """The processes that read each epoch's training batches."""

    gather_keys = ("pid",)

    def __init__(self) -> None:
        self.epochs: list[set[int]] = [set()]
        self.valid: list[float] = []

    def after_batch(self, stream, batch) -> None:
        if stream == "train":
            self.epochs[-1].update(batch["pid"].tolist())

    def after_epoch(self, epoch, epoch_data) -> None:
        self.epochs.append(set())
        self.valid.append(epoch_data.get("valid", {}).get("loss"))


def test_persistent_workers_read_and_augment_as_fresh_ones(tmp_path):
    """Workers kept for the whole run (the default where there are workers) are the same processes
    every epoch, and draw the same augmentation as workers started afresh each epoch: without
    per-sample streams (per_sample_random: false), seeded at each epoch as a new DataLoader seeds
    them (torch, numpy, random)."""
    noisy = {"class": "toy.NoisyRegression", "batch_size": 8, "num_workers": 2}
    runs = {}
    for persistent in (True, False):
        pids = Pids()
        trainer = train(
            tmp_path / str(persistent),
            hooks=[ComputeStats(), pids],
            main_loop={"epochs": 2, "extra_streams": ["valid"]},
            dataset={**noisy, "persistent_workers": persistent},
            per_sample_random=False,
        )
        runs[persistent] = trainer, [epoch for epoch in pids.epochs if epoch], pids.valid
    (kept, kept_pids, kept_valid), (fresh, fresh_pids, fresh_valid) = runs[True], runs[False]
    assert (
        kept_valid == fresh_valid
    )  # the evaluation stream's workers too, seeded alike at each evaluation
    assert len(kept_pids) == 2 and all(len(epoch) == 2 for epoch in kept_pids)
    assert kept_pids[0] == kept_pids[1]  # the same two workers in both epochs
    assert not (fresh_pids[0] & fresh_pids[1])  # new workers each epoch
    assert_close(params(kept), params(fresh))
    zero = train(
        tmp_path / "zero",
        hooks=[ComputeStats()],
        dataset={**noisy, "num_workers": 0},
        per_sample_random=False,
    )
    assert any(
        not torch.allclose(a, b)
        for a, b in zip(params(zero).values(), params(fresh).values(), strict=True)
    )  # noise drawn, in other processes
    with pytest.raises(
        ConfigError, match="dataset.persistent_workers=true is for DataLoader workers"
    ):
        train(tmp_path / "none", dataset={**noisy, "num_workers": 0, "persistent_workers": True})


def test_persistent_workers_resume_in_mid_epoch_and_serve_a_stream_trained_and_evaluated(tmp_path):
    """The training stream evaluated every 3 steps, in the middle of its own epochs, and a run
    stopped at step 7 (mid-epoch) and resumed: persistent workers give what fresh ones give, and
    are gone when the run ends (torch's per-worker seeding: per_sample_random false)."""
    import os

    import phalanx
    from phalanx.hooks import StopAfter

    noisy = {"class": "toy.NoisyRegression", "batch_size": 8, "num_workers": 2}
    ends = {}
    for persistent in (True, False):
        raw = toy.regression_config(
            dataset={**noisy, "persistent_workers": persistent},
            parallel={"accelerator": "cpu"},
            main_loop={"epochs": 3, "extra_streams": ["valid", "train"], "eval_every_n_steps": 3},
            output_root=str(tmp_path / str(persistent)),
            hooks=[{"ComputeStats": {"variables": ["loss"]}}, "SaveLatest"],
            per_sample_random=False,
        )
        pids = Pids()
        first = phalanx.fit(raw, hooks=[StopAfter(steps=7), pids])
        assert first.code == 0
        resumed = phalanx.resume(first.run_dir)
        ends[persistent] = resumed
        for pid in set().union(*pids.epochs):  # the workers ended with the run
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    kept, fresh = ends[True], ends[False]
    assert kept.metrics == fresh.metrics and "train.loss" in kept.metrics
    assert_close(params_of(kept.model), params_of(fresh.model))


def test_persistent_workers_keep_a_datasets_batched_read(tmp_path):
    class Reads(Hook):
        gather_keys = ("batched",)

        def __init__(self):
            self.seen = set()

        def after_batch(self, stream, batch):
            self.seen.update(batch["batched"].tolist())

    reads = Reads()
    train(
        tmp_path,
        hooks=[ComputeStats(), reads],
        dataset={
            "class": "toy.BatchedRegression",
            "batch_size": 8,
            "num_workers": 2,
            "persistent_workers": True,
        },
    )
    assert reads.seen == {1}  # every item came through __getitems__


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fused_optimizer_where_the_class_has_one():
    model = torch.nn.Linear(3, 1)
    opt = config.validate(toy.regression_config(optimizer={"class": "AdamW", "lr": 1e-3})).optimizer
    assert build_optimizer(opt, model, [], 8, fused=True).defaults["fused"] is True
    assert not build_optimizer(opt, model, [], 8, fused=False).defaults.get("fused")
    sgd = config.validate(
        toy.regression_config(optimizer={"class": "SGD", "lr": 0.1, "foreach": False})
    ).optimizer
    assert not build_optimizer(sgd, model, [], 8, fused=True).defaults.get(
        "fused"
    )  # the config chose
    # SGD with momentum under fp16's scaler: not fused (its fused kernel would keep uninitialised
    # momentum from a skipped first step); without momentum, or without the scaler, fused
    momentum = config.validate(
        toy.regression_config(optimizer={"class": "SGD", "lr": 0.1, "momentum": 0.9})
    ).optimizer
    assert build_optimizer(momentum, model, [], 8, fused=True).defaults["fused"] is True
    assert not build_optimizer(momentum, model, [], 8, fused=True, scaled=True).defaults["fused"]
    assert build_optimizer(opt, model, [], 8, fused=True, scaled=True).defaults["fused"] is True


def test_a_fused_sgd_with_momentum_under_fp16_is_warned_of(caplog):
    import logging

    model = torch.nn.Linear(3, 1)
    chosen = config.validate(
        toy.regression_config(optimizer={"class": "SGD", "lr": 0.1, "momentum": 0.9, "fused": True})
    ).optimizer
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        build_optimizer(chosen, model, [], 8, fused=True, scaled=False)
        assert not caplog.records
        assert build_optimizer(chosen, model, [], 8, fused=True, scaled=True).defaults["fused"]
    assert "fused: true with momentum under fp16" in caplog.text


def test_profile_writes_a_trace_and_logs_the_top_operations(tmp_path, caplog):
    import logging

    logging.getLogger("phalanx").propagate = True
    try:
        cfg = config.validate(
            toy.regression_config(
                main_loop={"epochs": 2, "extra_streams": []},
                hooks=None,
                profile={"start_step": 2, "steps": 3},
            )
        )
        trainer = Trainer(cfg, tmp_path, [TESTS])
        with caplog.at_level(logging.INFO, logger="phalanx"):
            assert trainer.run() == 0
    finally:
        logging.getLogger("phalanx").propagate = False
    trace = tmp_path / "profile" / "trace-rank0.json"
    assert trace.is_file() and '"traceEvents"' in trace.read_text()[:2000]
    assert any(
        "profile of steps 2-4" in r.message and "aten::" in r.message for r in caplog.records
    )


def test_compile_of_a_model_with_dropout_trains_the_same_without_compiling_again(tmp_path):
    """Keyed dropout is read where the compiled graph runs: the graph is not compiled again at each
    step for the step's draws, and the run is the plain one's."""
    from torch._dynamo.utils import counters

    model = {"class": "toy.Dropped", "features": 3, "hidden": 8}
    data = {"class": "toy.Regression", "batch_size": 8, "n_train": 64}
    plain = train(tmp_path / "plain", model=model, dataset=data)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(tmp_path / "compiled", model=model, dataset=data, compile={"backend": "eager"})
    assert_close(params(compiled), params(plain))
    assert counters["frames"]["total"] <= 4, dict(counters["frames"])  # 16 steps: not one a step


@pytest.mark.parametrize("model", ["toy.Linear", "toy.Dropped"])
def test_compile_with_activation_checkpointing_trains_as_the_plain_model(tmp_path, model):
    """torch.compile takes a recomputed module only with a selective-checkpoint policy: compiled,
    the checkpointed net recomputes its layers and keeps the forward's dropout masks, and the run
    ends where the plain one does."""
    spec = {"class": model, "features": 3, "hidden": 8}
    data = {"class": "toy.Regression", "batch_size": 8, "n_train": 64}
    plain = train(tmp_path / "plain", model=spec, dataset=data)
    compiled = train(
        tmp_path / "compiled",
        model=spec,
        dataset=data,
        compile={"backend": "aot_eager"},
        activation_checkpointing=["Sequential"],
    )
    assert_close(params(compiled), params(plain))
