"""The engine against plain PyTorch, in float64: one optimizer step is the SGD step of the global
batch's mean loss (contract 4), for accumulation, short last batches and scalar-mean losses
alike."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import toy

from phalanx import batching, config, data
from phalanx.data import Micro
from phalanx.engine import Engine, concat
from phalanx.hooks import Hook
from phalanx.strategies.ddp import DDP
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

LR = 0.05


class MeanLinear(toy.Linear):
    """toy.Linear returning the shard's mean loss (a scalar) instead of per-sample losses."""

    def forward(self, x, y):
        outputs = super().forward(x, y)
        return {"prediction": outputs["prediction"], "loss": outputs["loss"].mean()}


@pytest.fixture(autouse=True)
def _models_module(monkeypatch):
    module = types.ModuleType("unit_engine_models")
    module.MeanLinear = MeanLinear
    monkeypatch.setitem(sys.modules, "unit_engine_models", module)


def _trainer(
    n_train: int = 40,
    batch_size: int = 8,
    accumulation: int = 1,
    epochs: int = 1,
    model: str = "toy.Linear",
    **sections,
) -> Trainer:
    raw = toy.regression_config(
        model={"class": model, "hidden": 4},
        dataset={"n_train": n_train, "batch_size": batch_size},
        optimizer={"lr": LR},
        parallel={"gradient_accumulation": accumulation},
        main_loop={"epochs": epochs, "extra_streams": []},
    )
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    return Trainer(config.validate(raw), None, [], hooks=[])


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float64
        worst = max(worst, ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)).item())
    return worst


def _reference_loss(module: torch.nn.Module, stream: toy.Items, indices: list[int]) -> torch.Tensor:
    """Per-sample squared errors of toy.Linear, computed by hand."""
    x, y = stream.x[indices].double(), stream.y[indices].double()
    return (module.net(x).squeeze(-1) - y) ** 2


def _reference_sgd_step(
    module: torch.nn.Module, stream: toy.Items, indices: list[int], lr: float
) -> torch.Tensor:
    params = list(module.parameters())
    loss = _reference_loss(module, stream, indices).mean()
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= lr * g
    return loss.detach()


def _reference_run(
    module: torch.nn.Module, stream: toy.Items, seed: int, epochs: int, batch_size: int
) -> dict:
    """Plain PyTorch SGD over the contract's sample order: epoch e visits permutation(seed, e)."""
    module = copy.deepcopy(module)
    for epoch in range(1, epochs + 1):
        order = data.permutation(seed, epoch, len(stream))
        for start in range(0, len(order), batch_size):
            _reference_sgd_step(module, stream, order[start : start + batch_size], LR)
    return _params(module)


def _fetch(stream, micros: list[Micro]) -> list[tuple[Micro, dict | None]]:
    return [(m, batching.collate([stream[i] for i in m.shard])) for m in micros]


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("step", [0, 5])  # 43 samples, batch 8: step 5 is the short last batch of 3
def test_one_train_step_is_the_sgd_step_of_the_mean_loss(accumulation, step):
    trainer = _trainer(n_train=43, accumulation=accumulation)
    assert all(p.dtype == torch.float64 for p in trainer.module.parameters())
    stream = data.get_stream(trainer.dataset, "train")
    order = data.permutation(trainer.cfg.seed, 1, len(stream))
    indices = order[step * 8 : (step + 1) * 8]
    assert len(indices) == (8 if step == 0 else 3)

    reference = copy.deepcopy(trainer.module)
    per_sample = _reference_loss(reference, stream, indices).detach()
    ref_loss = _reference_sgd_step(reference, stream, indices, LR)

    plan = data.Plan(order, 8, accumulation)
    assert len(plan.step(step)) == min(accumulation, len(indices))
    result = trainer.train_step(_fetch(stream, plan.step(step)))
    loss, batch = result.loss, concat(result.parts)
    assert _rel_diff(_params(trainer.module), _params(reference)) < 1e-13
    assert torch.allclose(loss, ref_loss, rtol=1e-13, atol=0)
    # hooks see the global batch in dataset order, with each sample's loss before the update
    assert batch["id"].tolist() == indices
    assert torch.allclose(batch["loss"], per_sample, rtol=1e-13, atol=0)


def test_the_update_really_moves_the_parameters():
    """Guards the oracle above: the reference step is not a no-op."""
    trainer = _trainer()
    before = _params(trainer.module)
    stream = data.get_stream(trainer.dataset, "train")
    plan = data.Plan(data.permutation(0, 1, len(stream)), 8)
    trainer.train_step(_fetch(stream, plan.step(0)))
    assert _rel_diff(_params(trainer.module), before) > 1e-4


@pytest.mark.parametrize("n_train", [43, 40])
def test_training_matches_plain_pytorch_with_and_without_accumulation(n_train):
    epochs = 3
    runs = {}
    for accumulation in (1, 3):
        trainer = _trainer(n_train=n_train, accumulation=accumulation, epochs=epochs)
        start = _params(trainer.module)
        reference = _reference_run(
            trainer.module, data.get_stream(trainer.dataset, "train"), trainer.cfg.seed, epochs, 8
        )
        assert trainer.run() == 0
        assert trainer.epoch == epochs and trainer.step == epochs * -(-n_train // 8)
        runs[accumulation] = _params(trainer.module)
        assert _rel_diff(runs[accumulation], reference) < 1e-10
        assert _rel_diff(runs[accumulation], start) > 1e-3
    assert _rel_diff(runs[3], runs[1]) < 1e-10


@pytest.mark.parametrize("accumulation", [1, 3])
def test_scalar_mean_loss_gives_the_same_training_as_per_sample(accumulation):
    epochs = 2
    per_sample = _trainer(n_train=43, accumulation=accumulation, epochs=epochs)
    mean = _trainer(
        n_train=43, accumulation=accumulation, epochs=epochs, model="unit_engine_models.MeanLinear"
    )
    assert isinstance(mean.module, MeanLinear)
    assert _rel_diff(_params(mean.module), _params(per_sample.module)) == 0  # same start
    assert per_sample.run() == 0 and mean.run() == 0
    assert _rel_diff(_params(mean.module), _params(per_sample.module)) < 1e-10


def test_scalar_mean_loss_is_shown_to_hooks_per_sample():
    trainer = _trainer(model="unit_engine_models.MeanLinear")
    stream = data.get_stream(trainer.dataset, "train")
    plan = data.Plan(data.permutation(0, 1, len(stream)), 8, 2)
    result = trainer.train_step(_fetch(stream, plan.step(0)))
    loss, batch = result.loss, concat(result.parts)
    assert batch["loss"].shape == (8,)
    assert torch.allclose(batch["loss"].mean(), loss, rtol=1e-13, atol=0)


def test_warmup_ramps_the_learning_rate_linearly():
    warmup = 4
    trainer = _trainer(optimizer={"warmup_steps": warmup})
    stream = data.get_stream(trainer.dataset, "train")
    plan = data.Plan(data.permutation(0, 1, len(stream)), 8)
    used = []
    for k in range(len(plan)):  # 5 steps
        lr = trainer.engine.learning_rates()[0]
        used.append(lr)
        reference = copy.deepcopy(trainer.module)
        _reference_sgd_step(reference, stream, plan.order[k * 8 : (k + 1) * 8], lr)
        trainer.train_step(_fetch(stream, plan.step(k)))
        assert (
            _rel_diff(_params(trainer.module), _params(reference)) < 1e-12
        )  # that rate was applied
    assert used[0] == pytest.approx(LR / warmup, rel=1e-12)
    full = [i for i, lr in enumerate(used) if lr == pytest.approx(LR, rel=1e-12)]
    assert (
        full and full[0] <= warmup and full == list(range(full[0], len(used)))
    )  # reaches LR, stays
    ramp = used[: full[0] + 1]
    steps = [b - a for a, b in itertools.pairwise(ramp)]
    assert all(s > 0 for s in steps)
    assert all(s == pytest.approx(steps[0], rel=1e-9) for s in steps)  # linear
    assert trainer.engine.learning_rates()[0] == pytest.approx(LR, rel=1e-12)


def test_epoch_scheduler_steps_once_per_epoch():
    class RecordLR(Hook):
        def __init__(self):
            self.lrs = []

        def after_epoch(self, epoch, epoch_data):
            self.lrs.append(self.trainer.learning_rates()[0])

    raw = toy.regression_config(
        main_loop={"epochs": 3, "extra_streams": []},
        optimizer={"lr": LR},
        scheduler={"class": "StepLR", "step_size": 1, "gamma": 0.5, "interval": "epoch"},
    )
    record = RecordLR()
    trainer = Trainer(config.validate(raw), None, [], hooks=[record])
    assert trainer.run() == 0
    assert record.lrs == pytest.approx([LR / 2, LR / 4, LR / 8], rel=1e-12)


def test_eval_step_gives_per_sample_outputs_without_changing_the_model():
    trainer = _trainer()
    stream = data.get_stream(trainer.dataset, "valid")
    before = _params(trainer.module)
    batch = batching.collate([stream[i] for i in range(len(stream))])
    out = trainer.eval_step(batch)
    assert _rel_diff(_params(trainer.module), before) == 0
    assert not out["loss"].requires_grad
    expected = _reference_loss(trainer.module, stream, list(range(len(stream))))
    assert torch.allclose(out["loss"], expected, rtol=1e-13, atol=0)
    assert out["prediction"].dtype == torch.float64


def test_an_inference_trainer_evaluates_without_building_an_optimizer():
    """`phalanx eval` and `predict` build no optimizer: constructing one imports torch's compiler
    stack, seconds of start-up. Checked in a fresh interpreter, where nothing imported it yet."""
    code = (
        "import sys, toy\nfrom phalanx import config\nfrom phalanx.trainer import Trainer\nt = "
        "Trainer(config.validate(toy.regression_config(main_loop={'extra_streams': ['valid']})), "
        "None, ['.'],\n            hooks=[], "
        "inference=True)\nt.evaluate('valid')\nprint(t.optimizer, t.schedulers, 'torch._dynamo' "
        "in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(toy.__file__).parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "[]", "False"]


class _EmptyRank(DDP):
    """Rank 3 of 4 as the ddp strategy sees a step where its shards are all empty; its reductions
    are recorded instead of run (no process group: only the step's logic is under test)."""

    def __init__(self):
        self.rank, self.world_size, self.scale = 3, 4, 4.0
        self.device = torch.device("cpu")
        self.carrier = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self._rows = self._carried_rows()
        self._ddp, self._pending_stop, self._statistics = None, None, None
        self._in_flight, self._read_ahead = [], None
        self.carried_values: list[list[float]] = []

    def reduce(self, tensor, op="sum"):
        raise AssertionError("the step needs no collective of its own")

    def _carry(self, values):
        raise AssertionError(
            "a step with an empty shard on some rank must not let backward synchronise"
        )

    def _reduce_by_hand(self, values):
        self.carried_values.append(values.tolist())
        self.carrier.grad = (
            values / self.world_size
        )  # as the other ranks, with nothing to add, would leave it


def test_a_rank_with_only_empty_shards_joins_the_step_with_zero_weight():
    """Contract 3: the last global batch (1 sample) on 4 ranks leaves ranks 1-3 without samples."""
    trainer = _trainer()
    strategy = _EmptyRank()
    engine = Engine(trainer.module, trainer.forward, trainer.optimizer, [], trainer.precision)
    order = data.permutation(0, 1, 41)
    plan = data.Plan(order, 8, 1, rank=3, world_size=4)
    micros = plan.step(5)
    assert [m.shard for m in micros] == [[]] and micros[0].global_size == 1
    before = _params(trainer.module)
    result = strategy.train_step(engine, [(m, None) for m in micros], stop=True)
    # it joins the hand reduction the other ranks make, with a zero loss share (not weighted) and
    # its stop flag
    assert strategy.carried_values == [[0.0, 0.0, 0.0, 4.0]]
    assert float(result.loss) == 0.0 and result.stop is True
    assert _rel_diff(_params(trainer.module), before) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_shards_part_of_the_loss_keeps_its_digits_in_half_precision(dtype):
    """The part of the global batch's mean loss a shard gives: 1000 samples of a global batch of a
    million, where each sample's gradient (1e-6) is subnormal in float16 and the part taken through
    it lost a percent."""
    trainer = _trainer()
    engine = Engine(trainer.module, trainer.forward, trainer.optimizer, [], trainer.precision)
    losses = torch.full((1000,), 2.5, dtype=dtype)
    weighed = engine.weigh(losses, {"loss": losses}, Micro(list(range(1000)), 1_000_000))
    assert weighed.gradient is not None and weighed.gradient.dtype == dtype
    assert abs(float(weighed.part) - 2.5e-3) <= 2.5e-3 * 4e-3
