"""The GPU tier: the CUDA paths of `single`, `ddp`, `placement` and `param_server`, on whatever CUDA
GPU is visible (`pipeline` sends GPU activations over NCCL, one GPU a process: it needs two GPUs,
and the lent machines have one).

Every test here skips, saying so, on a machine without one (CI has none). Two ranks share the one
GPU over gloo (`parallel.backend: gloo`): NCCL refuses two ranks on one device, and the lent
machines have one GPU. float64 on the GPU uses other kernels than on the CPU, so the comparisons
allow 1e-10 relative, as the CPU invariance suite does.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist"))
import toy  # noqa: E402
import workers  # noqa: E402
from procs import PHALANX  # noqa: E402

from phalanx import commands  # noqa: E402
from phalanx.checkpoint import WEIGHTS, Checkpoints  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible"),
    pytest.mark.timeout(600),
]

N_TRAIN, N_VALID = 41, 10  # the last batch of 1 is smaller than the world size


def scenario(accelerator: str, model: str = "toy.Linear", **parallel) -> dict:
    return toy.regression_config(
        model={"class": model, "features": 3, "hidden": 4 if model == "toy.Linear" else 6},
        optimizer={"class": "AdamW", "lr": 0.01, "warmup_steps": 3},
        dataset={
            "class": "toy.Regression",
            "batch_size": 10,
            "n_train": N_TRAIN,
            "n_valid": N_VALID,
        },
        parallel={"accelerator": accelerator, "devices": 1, "gradient_accumulation": 2, **parallel},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_same_run(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        if not name.endswith("num_batches_tracked"):
            assert rel(got["params"][name], value) < 1e-10, name
    assert len(got["losses"]) == len(want["losses"]) > 0
    assert rel(got["losses"], want["losses"]) < 1e-10
    for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):
        assert mine["valid"]["loss_count"] == theirs["valid"]["loss_count"] == N_VALID
        assert abs(mine["valid"]["loss"] - theirs["valid"]["loss"]) <= 1e-10 * abs(
            theirs["valid"]["loss"]
        )


@pytest.fixture(scope="module")
def one_gpu() -> dict[str, dict]:
    return {"toy.Linear": workers.train(scenario("cuda"))}


def test_float64_on_the_gpu_trains_as_on_the_cpu(one_gpu):
    assert_same_run(one_gpu["toy.Linear"], workers.train(scenario("cpu")))


@pytest.mark.parametrize(
    "through_autograd", [False, True], ids=["carrier-direct", "carrier-autograd"]
)
def test_two_ranks_sharing_the_gpu_train_as_one_process(one_gpu, through_autograd):
    ranks = workers.run_ranks(
        2,
        workers.train_all,
        [scenario("cuda")],
        through_autograd,
        timeout=300,
        env={"LOCAL_RANK": "0"},
    )
    for [got] in ranks:
        assert_same_run(got, one_gpu["toy.Linear"])
        assert (
            got["ids"] == one_gpu["toy.Linear"]["ids"]
        )  # the same samples in the same order, gathered


def test_a_model_compiled_to_replay_as_cuda_graphs_trains_as_the_plain_one(one_gpu):
    """compile mode reduce-overhead replays the model as CUDA graphs, each replay writing its
    outputs over the last one's: the statistics, which keep each batch's losses until the epoch's
    end, and the evaluation read copies, and the run is the plain one's (inductor's kernels)."""
    got = workers.train({**scenario("cuda"), "compile": {"mode": "reduce-overhead"}})
    want = one_gpu["toy.Linear"]
    assert len(got["losses"]) == len(want["losses"]) > 0
    assert rel(got["losses"], want["losses"]) < 1e-9
    for mine, theirs in zip(got["epochs"], want["epochs"], strict=True):
        for stream in ("train", "valid"):
            assert mine[stream]["loss"] == pytest.approx(theirs[stream]["loss"], rel=1e-9)
            assert mine[stream]["loss_count"] == theirs[stream]["loss_count"]


def test_dropout_keyed_by_sample_on_the_gpu_draws_the_cpus_masks_in_one_kernel():
    """On the GPU each dropout runs compiled (`phalanx.random._dropout`: its forward and its
    backward each one kernel), bit for bit the CPU's eager hash: the run with dropout is the
    CPU's."""
    from phalanx import random

    want = workers.train(scenario("cpu", "toy.Dropped"))
    got = workers.train(scenario("cuda", "toy.Dropped"))
    assert random._fused_drop.usable and random._fused_drop._compiled is not None
    assert_same_run(got, want)


@pytest.mark.parametrize("compiled", [{"backend": "inductor"}, {"mode": "reduce-overhead"}])
def test_a_compiled_model_with_dropout_on_the_gpu_draws_the_cpus_masks_in_its_graph(compiled):
    """Compiled, each keyed dropout is one operation of the model's graph that reads the step's
    draws where the graph runs; replayed as CUDA graphs, the graphs are split around it, so no
    replay draws a step's masks again: the run is the CPU's eager one, to inductor's rounding."""
    want = workers.train(scenario("cpu", "toy.Dropped"))
    got = workers.train({**scenario("cuda", "toy.Dropped"), "compile": compiled})
    assert len(got["losses"]) == len(want["losses"]) > 0
    assert rel(got["losses"], want["losses"]) < 1e-9
    for name, value in want["params"].items():
        assert rel(got["params"][name], value) < 1e-9, name


def test_sync_batchnorm_on_the_gpu_trains_as_one_process(one_gpu):
    raw = scenario("cuda", "toy.BatchNormNet", sync_batchnorm=True)
    raw["dataset"] = {
        **raw["dataset"],
        "n_train": 40,
    }  # torch's SyncBatchNorm refuses an empty shard
    raw["optimizer"] = {
        "class": "SGD",
        "lr": 0.05,
        "momentum": 0.9,
    }  # Adam's 1/sqrt(v) magnifies rounding
    want = workers.train({**raw, "parallel": {**raw["parallel"], "sync_batchnorm": False}})
    for [got] in workers.run_ranks(
        2, workers.train_all, [raw], timeout=300, env={"LOCAL_RANK": "0"}
    ):
        assert_same_run(got, want)


def _latest_weights(run_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    ckpts = Checkpoints(run_dir / "checkpoints")
    step = ckpts.latest_valid()
    return step, load_file(str(ckpts.path(step) / WEIGHTS))


def test_resume_on_the_gpu_mid_epoch_is_bit_identical(tmp_path):
    raw = toy.regression_config(
        parallel={"accelerator": "cuda"}, main_loop={"epochs": 3, "extra_streams": []}
    )
    raw["hooks"] = [{"ComputeStats": {"variables": ["loss"]}}, "SaveLatest"]
    assert commands.train(str(toy.write_config(tmp_path / "whole", raw)), []) == 0
    [whole_dir] = (tmp_path / "whole" / "runs").iterdir()
    end, whole = _latest_weights(whole_dir)
    assert end == 15  # 40 samples, batch 8, 3 epochs

    stopped = {**raw, "hooks": [*raw["hooks"], {"StopAfter": {"steps": 7}}]}
    assert commands.train(str(toy.write_config(tmp_path / "parts", stopped)), []) == 0
    [run_dir] = (tmp_path / "parts" / "runs").iterdir()
    assert _latest_weights(run_dir)[0] == 7
    assert commands.resume(str(run_dir), ["hooks.2.StopAfter.steps=1000"]) == 0
    end, resumed = _latest_weights(run_dir)
    assert end == 15
    for key, value in whole.items():
        assert (
            value.device.type == "cpu" and value.dtype == torch.float64
        )  # checkpoints load anywhere
        assert torch.equal(resumed[key], value), key


def test_gpt_in_bf16_with_compile_learns_on_the_gpu(tmp_path):
    """examples/gpt/tiny.yaml on the GPU in bf16 autocast with torch.compile: it learns, keeps
    float32 weights, and `phalanx eval` of its checkpoint gives the logged validation loss."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [
            *PHALANX,
            "train",
            "examples/gpt/tiny.yaml",
            f"output_root={tmp_path}",
            "parallel.accelerator=cuda",
            "precision=bf16",
            "compile=true",
            "main_loop.epochs=1",
            "dataset.max_bytes=300000",
        ],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = list(tmp_path.iterdir())
    with open(run / "metrics.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert float(row["valid.loss"]) < 0.55 * math.log(256), row
    _, weights = _latest_weights(run)
    assert {w.dtype for w in weights.values()} == {torch.float32}
    result = subprocess.run(
        [*PHALANX, "eval", str(run), "--stream", "valid"],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [saved] = list(run.glob("eval-valid-step-*.json"))
    assert json.loads(saved.read_text())["metrics"]["loss"] == pytest.approx(
        float(row["valid.loss"]), rel=2e-2
    )


class _NegativeWeights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        prediction = self.layer(x).squeeze(-1)
        return {"loss": (prediction - y) ** 2, "loss_weight": torch.full_like(y, -1.0)}


def test_negative_loss_weights_on_the_gpu_are_refused(tmp_path, monkeypatch):
    """On the GPU the check is not read every micro-batch (that would wait for the device), but
    the run still fails with its cause: at the first step's gradient check, which reads the device
    anyway (the negative weights left no gradient), or else at the end of the first epoch."""
    import phalanx
    from phalanx.errors import ModelError

    monkeypatch.chdir(tmp_path)
    raw = scenario("cuda")
    raw["hooks"] = []
    streams = toy.Regression(n_train=N_TRAIN).streams()
    with pytest.raises(ModelError, match="'loss_weight' holds negative weights"):
        phalanx.fit(raw, model=_NegativeWeights(), dataset=streams)


def test_placement_on_the_cpu_and_the_gpu_trains_as_one_gpu(one_gpu):
    """toy.Linear's first layer in host memory and its last on cuda:0: the batch follows the first
    to the CPU, its output the last back to the GPU, and the run is one GPU's."""
    raw = scenario("cuda", strategy="placement", placement={"net.0": "cpu", "net.2": "cuda:0"})
    assert_same_run(workers.train(raw), one_gpu["toy.Linear"])


def test_a_forward_that_mixes_placed_devices_is_one_error():
    """toy.Linear's last layer in host memory: its prediction (CPU) meets the target (GPU) in the
    model's own forward, which placement leaves to the model; the error says so."""
    from phalanx.errors import ModelError

    raw = scenario("cuda", strategy="placement", placement={"net.0": "cuda:0", "net.2": "cpu"})
    with pytest.raises(ModelError, match=r"combines tensors on different devices \(net.0 on cuda"):
        workers.train(raw)


def test_param_server_workers_on_the_gpu_train_as_one_gpu(one_gpu):
    """Two workers sharing the GPU, one server holding the parameters in host memory: gradients
    leave the GPU for the server over gloo and the pulled parameters come back, at staleness 0 the
    run of one GPU."""
    raw = scenario("cuda", strategy="param_server", backend="gloo")
    raw["parallel"]["param_server"] = {"servers": 1, "staleness": 0}
    for [got] in workers.run_ranks(
        3, workers.train_all, [raw], timeout=300, env={"LOCAL_RANK": "0"}
    )[:2]:
        assert_same_run(got, one_gpu["toy.Linear"])


class _SlowKernels(torch.nn.Module):
    """toy.Linear's shape, whose forward also queues a kernel that keeps the GPU busy ~20 ms."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        torch.cuda._sleep(20_000_000)  # clock cycles: about 10-20 ms on a current GPU
        return {"loss": (self.layer(x).squeeze(-1) - y) ** 2}


def test_the_time_split_on_the_gpu_charges_the_steps_not_the_hook_that_reads_the_loss(
    tmp_path, monkeypatch
):
    """A hook that reads each step's loss waits there for the GPU; the host's clock would charge
    the step's kernels to it. The split follows the GPU's timeline: the steps get that time."""
    import phalanx
    from phalanx.hooks import Hook

    class ReadsTheLoss(Hook):
        def after_batch(self, stream: str, batch: dict) -> None:
            if self.trainer.training:
                float(self.trainer.last_loss)

        def after_epoch_profile(self, epoch: int, profile: dict, *streams) -> None:
            seen.append(dict(profile))

    seen: list[dict] = []
    monkeypatch.chdir(tmp_path)
    raw = scenario("cuda")
    raw["parallel"]["gradient_accumulation"] = 1
    raw["main_loop"] = {"epochs": 1, "extra_streams": []}
    streams = toy.Regression(n_train=N_TRAIN).streams()
    phalanx.fit(raw, model=_SlowKernels(), dataset=streams, hooks=[ReadsTheLoss()])
    [profile] = seen
    assert profile["forward_backward"] > 5 * profile["hooks"], profile


def test_a_model_built_on_the_gpu_trains_alike_on_one_rank_and_two():
    """parallel.build=device: the model is built and its values drawn on the GPU; two ranks start
    from rank 0's draws, which are one process's, and train as it does."""
    raw = scenario("cuda", build="device")
    one = workers.train(raw)
    assert (
        rel(
            one["params"]["net.0.weight"], workers.train(scenario("cuda"))["params"]["net.0.weight"]
        )
        > 0
    )
    for [got] in workers.run_ranks(
        2, workers.train_all, [raw], timeout=300, env={"LOCAL_RANK": "0"}
    ):
        assert_same_run(got, one)


_ENDS: list = []  # each forward's event, recorded after its long kernel (see _LongKernels)


class _LongKernels(torch.nn.Module):
    """toy.Linear's shape, whose forward first queues a kernel that keeps the GPU busy for about
    half a second, then records an event: done once the GPU is past that kernel."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        torch.cuda._sleep(1_000_000_000)  # clock cycles: about 0.5-0.7 s on a current GPU
        end = torch.cuda.Event()
        end.record()
        _ENDS.append(end)
        return {"loss": (self.layer(x).squeeze(-1) - y) ** 2}


@pytest.mark.parametrize(
    "strategy, clipped, nan_check",
    [("single", False, False), ("fsdp", False, False), ("single", True, False)]
    + [("single", False, True)],
)
def test_a_step_on_the_gpu_returns_before_its_kernels_have_run(
    tmp_path, monkeypatch, strategy, clipped, nan_check
):
    """A step queues its kernels and returns: nothing it reads back waits for them. `single` reads
    nothing at all from the device, also where it clips the gradients for a fused optimizer (which
    skips a non-finite step on the device); fsdp reads the step before's stop flag (its agreement
    runs behind the step), so it waits for that step, never for its own; so does StopOnNaN, which
    reads the step before's loss (and waits for the epoch's last step). The first steps are left
    out (the first step's gradient check reads the gradients)."""
    import phalanx
    from phalanx.hooks import Hook, StopOnNaN

    asked: list[tuple[bool, bool]] = []

    class Asks(Hook):
        def after_batch(self, stream: str, batch: dict) -> None:
            if self.trainer.training:  # (this step's forward done, the step before's)
                asked.append((_ENDS[-1].query(), _ENDS[-2].query() if len(_ENDS) > 1 else True))

    monkeypatch.chdir(tmp_path)
    _ENDS.clear()
    raw = scenario("cuda", strategy=strategy)
    raw["parallel"]["gradient_accumulation"] = 1
    raw["main_loop"] = {"epochs": 1, "extra_streams": []}
    raw["dataset"]["n_train"] = 60  # 6 steps of 10
    if clipped:
        raw["optimizer"] = {"class": "AdamW", "lr": 0.01, "fused": True, "max_grad_norm": 1.0}
    streams = toy.Regression(n_train=60).streams()
    hooks = [StopOnNaN(), Asks()] if nan_check else [Asks()]
    phalanx.fit(raw, model=_LongKernels(), dataset=streams, hooks=hooks)
    assert len(asked) == 6
    # StopOnNaN waits for the epoch's last step, which the epoch's end evaluates and saves
    later = asked[2:-1] if nan_check else asked[2:]
    assert not any(mine for mine, _ in later), asked
    if strategy == "single" and not nan_check:
        assert not any(before for _, before in later), asked


@pytest.mark.parametrize("bad_step, failed_at", [(3, 4), (6, 6)])
def test_stop_on_nan_on_the_gpu_names_the_step_a_check_later(tmp_path, bad_step, failed_at):
    """On a GPU StopOnNaN reads each step's loss at the next step's check, and the epoch's last
    step's at once (the epoch's end evaluates and saves): the run fails there, naming the step
    whose loss was infinite."""
    from phalanx import config, logs
    from phalanx.hooks import StopOnNaN
    from phalanx.trainer import Trainer

    raw = scenario("cuda")
    raw["model"] = {"class": "toy.InfAt", "features": 3, "step": bad_step}
    raw["parallel"]["gradient_accumulation"] = 1
    raw["dataset"]["n_train"] = 60  # 6 steps of 10 an epoch
    logs.setup(tmp_path)
    try:
        trainer = Trainer(config.validate(raw), tmp_path, [str(REPO / "tests")], [StopOnNaN()])
        assert trainer.run() == 1
    finally:
        logs.setup(None)
    assert trainer.step == failed_at
    log = (tmp_path / "log.txt").read_text()
    assert f"the training loss is not finite (inf) at step {bad_step} (StopOnNaN)" in log


def test_a_loader_without_workers_pins_its_batches_as_a_dataloader_would():
    """Without workers the process reads its batches itself; with pinned memory asked for (a GPU
    run's default), they come pinned, and hold what a DataLoader gives."""
    from torch.utils.data import DataLoader

    from phalanx import data, loading

    items = [{"x": torch.full((3,), float(i)), "y": i} for i in range(10)]
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]
    made = loading.loader(items, data.Plan(order, 4), pin_memory=True)
    assert not isinstance(made, DataLoader)
    batches = list(made)
    assert [len(b["y"]) for b in batches] == [4, 4, 2]
    assert all(b["x"].is_pinned() and b["y"].is_pinned() for b in batches)
    assert torch.equal(torch.cat([b["y"] for b in batches]), torch.tensor(order))


def test_classification_metrics_count_on_the_gpu_without_reading_it_back():
    """The confusion matrix of GPU outputs is counted on the GPU (torch's sync debug mode raises on
    any read back during the batches) and scores as the same batches counted on the host."""
    from phalanx.hooks import ClassificationMetrics

    generator = torch.Generator().manual_seed(0)
    batches = [
        {"logits": torch.randn(32, 5, generator=generator), "label": torch.randint(0, 5, (32,))}
        for _ in range(3)
    ]
    names = ["accuracy", "precision", "recall", "f1"]
    on_host, on_gpu = (ClassificationMetrics("logits", "label", metrics=names) for _ in range(2))
    moved = [{k: v.cuda() for k, v in batch.items()} for batch in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in moved:
            on_gpu.after_batch("valid", batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for batch in batches:
        on_host.after_batch("valid", batch)
    want, got = {}, {}
    on_host.after_epoch(1, want)
    on_gpu.after_epoch(1, got)
    assert got == want and set(got["valid"]) == set(names)
