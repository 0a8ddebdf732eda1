"""Every built-in hook, run inside a real Trainer on the toy problems and checked against an
independent computation: numpy and scikit-learn for statistics and metrics, TensorBoard's own reader
for event files, matplotlib's reader for plots, the checkpoint files themselves for saving."""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import toy
from rich.console import Console
from safetensors.torch import load_file
from sklearn import metrics as skm

from phalanx import commands, config, data, logs, rundir
from phalanx.errors import ConfigError, ModelError, StorageError
from phalanx.hooks import (
    ClassificationMetrics,
    ComputeStats,
    Hook,
    LogProfile,
    LogThroughput,
    LogVariables,
    PlotLines,
    SaveBest,
    SaveEvery,
    SaveLatest,
    ShowProgress,
    StopAfter,
    StopOnNaN,
    StopOnPlateau,
    TrainingTerminated,
    WriteCSV,
    WriteTensorBoard,
    build_hooks,
)
from phalanx.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

TESTS = Path(toy.__file__).parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- helpers -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _close_logs():
    """logs.setup attaches handlers to files and streams of this test; detach them afterwards."""
    yield
    logger = logging.getLogger("phalanx")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


class Record(Hook):
    """Keeps what the hooks listed before it produced: every batch, each epoch's data, the weights
    at each epoch's end, the profile events and how training ended."""

    def __init__(self):
        self.batches: list[tuple[str, int, dict]] = []
        self.epochs: dict[int, dict] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.profiles: list[int] = []
        self.success: bool | None = None

    def after_batch(self, stream, batch):
        kept = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }
        self.batches.append((stream, self.trainer.step, kept))

    def after_epoch(self, epoch, epoch_data):
        self.epochs[epoch] = copy.deepcopy(epoch_data)
        self.weights[epoch] = {
            k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()
        }

    def after_epoch_profile(self, epoch, profile, train_stream, extra_streams):
        self.profiles.append(epoch)

    def after_training(self, success):
        self.success = success

    def train_batches(self, epoch: int, steps_per_epoch: int) -> list[dict]:
        first, last = (epoch - 1) * steps_per_epoch + 1, epoch * steps_per_epoch
        return [b for s, step, b in self.batches if s == "train" and first <= step <= last]


def classification_config(**sections) -> dict:
    """The regression config turned into 3-class classification of Gaussian blobs."""
    cfg = toy.regression_config(
        dataset={"class": "toy.Classes"}, optimizer={"lr": 0.02}, **sections
    )
    cfg["model"] = {"class": "toy.Classifier", "features": 4, "classes": 3}
    return cfg


def make_trainer(tmp_path: Path, hooks, classes: bool = False, **sections) -> Trainer:
    """A trainer on a toy problem writing into tmp_path/run; `hooks` are Hook objects, or specs
    as a config lists them."""
    raw = classification_config(**sections) if classes else toy.regression_config(**sections)
    specs = not all(isinstance(h, Hook) for h in hooks)
    raw["hooks"] = hooks if specs else None
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    logs.setup(run)
    return Trainer(config.validate(raw), run, [TESTS], hooks=None if specs else hooks)


def trace_events(run: Path) -> list[str]:
    return [e["event"] for e in rundir.read_trace(run)]


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def regression_losses(weights: dict[str, torch.Tensor], stream: str) -> np.ndarray:
    """Per-sample squared errors of toy.Linear weights on a stream, computed by hand."""
    items = toy.Regression().streams()[stream]
    x, y = items.x.double().numpy(), items.y.double().numpy()
    w, b = weights["net.weight"].double().numpy(), weights["net.bias"].double().numpy()
    return ((x @ w.T + b).reshape(-1) - y) ** 2


def classifier_predictions(
    weights: dict[str, torch.Tensor], stream: str
) -> tuple[np.ndarray, np.ndarray]:
    items = toy.Classes().streams()[stream]
    w, b = weights["net.weight"].double().numpy(), weights["net.bias"].double().numpy()
    logits = items.x.double().numpy() @ w.T + b
    return logits.argmax(axis=1), items.y.numpy()


def sklearn_scores(predicted, gold) -> dict[str, float]:
    kw = {"average": "macro", "zero_division": 0}
    return {
        "accuracy": skm.accuracy_score(gold, predicted),
        "precision": skm.precision_score(gold, predicted, **kw),
        "recall": skm.recall_score(gold, predicted, **kw),
        "f1": skm.f1_score(gold, predicted, **kw),
    }


# --- ComputeStats ------------------------------------------------------------------------------

ALL_AGGREGATIONS = ["mean", "std", "min", "max", "sum", "count"]


def _numpy_stats(values: np.ndarray) -> dict[str, float]:
    return {
        "loss": values.mean(),
        "loss_std": values.std(),
        "loss_min": values.min(),
        "loss_max": values.max(),
        "loss_sum": values.sum(),
        "loss_count": len(values),
    }


def test_compute_stats_equal_numpy_on_the_per_sample_losses(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [ComputeStats(["loss"], ALL_AGGREGATIONS), rec], main_loop={"epochs": 2}
    )
    assert trainer.run() == 0
    for epoch in (1, 2):
        # training stream: the per-sample losses of the epoch's batches, as the model produced them
        train = np.concatenate([b["loss"].numpy() for b in rec.train_batches(epoch, 5)])
        assert len(train) == 40
        got = rec.epochs[epoch]["train"]
        for key, expected in _numpy_stats(train).items():
            assert got[key] == pytest.approx(expected, rel=1e-10, abs=1e-12), (epoch, key)
        # valid stream: recomputed by hand from the weights at the end of the epoch
        valid = regression_losses(rec.weights[epoch], "valid")
        for key, expected in _numpy_stats(valid).items():
            assert rec.epochs[epoch]["valid"][key] == pytest.approx(
                expected, rel=1e-10, abs=1e-12
            ), (epoch, key)
    assert (
        rec.epochs[1]["train"]["loss"] != rec.epochs[2]["train"]["loss"]
    )  # sums restart each epoch


def test_compute_stats_only_publish_the_aggregations_asked_for(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(["loss", "prediction"], ["mean", "max"]), rec],
        main_loop={"epochs": 1},
    )
    assert trainer.run() == 0
    assert set(rec.epochs[1]["train"]) == {"loss", "loss_max", "prediction", "prediction_max"}
    predictions = np.concatenate([b["prediction"].numpy() for b in rec.train_batches(1, 5)])
    assert rec.epochs[1]["train"]["prediction_max"] == pytest.approx(predictions.max(), rel=1e-12)


def test_compute_stats_state_survives_a_json_round_trip_mid_epoch(tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [{"loss": torch.rand(n, generator=g, dtype=torch.float64) * 10} for n in (5, 3, 7, 1)]
    whole = ComputeStats(["loss"], ALL_AGGREGATIONS)
    first = ComputeStats(["loss"], ALL_AGGREGATIONS)
    second = ComputeStats(["loss"], ALL_AGGREGATIONS)
    make_trainer(tmp_path, [whole, first, second])  # the hooks are called by hand below
    for b in batches:
        whole.after_batch("train", b)
    for b in batches[:2]:
        first.after_batch("train", b)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for b in batches[2:]:
        second.after_batch("train", b)
    expected, resumed = {}, {}
    whole.after_epoch(1, expected)
    second.after_epoch(1, resumed)
    values = torch.cat([b["loss"] for b in batches]).numpy()
    for key, value in _numpy_stats(values).items():
        assert expected["train"][key] == pytest.approx(value, rel=1e-12)
        assert resumed["train"][key] == pytest.approx(value, rel=1e-12)


def test_stop_after_refuses_limits_that_are_not_positive_numbers():
    for given, says in [
        ({"steps": -1}, "steps must be a positive number, got -1"),
        ({"minutes": 0}, "minutes must be a positive number, got 0"),
        ({"epochs": True}, "epochs must be a positive number, got True"),
        ({"steps": 5, "clock": "banana"}, "clock is a function giving seconds"),
    ]:
        with pytest.raises(ConfigError, match=f"StopAfter: {says}"):
            StopAfter(**given)
    StopAfter(steps=np.int64(3), epochs=2.5)  # numbers of any kind


@pytest.mark.parametrize("hook", [SaveBest, StopOnPlateau])
def test_a_best_or_plateau_of_a_stream_the_run_does_not_evaluate_is_refused_before_training(
    tmp_path, hook
):
    ended = Record()
    trainer = make_trainer(tmp_path, [hook("test.loss"), ended], main_loop={"epochs": 1})
    with pytest.raises(
        ConfigError, match=r"stream 'test' of test.loss is not evaluated \(streams: train, valid\)"
    ):
        trainer.run()
    assert trainer.step == 0 and not ended.epochs


def test_an_extra_stream_the_dataset_lacks_is_said_before_a_hooks_check(tmp_path):
    """main_loop.extra_streams=[tset]: the stream the dataset lacks is the mistake to name, not
    SaveBest's valid stream, which the typo left out."""
    from phalanx.errors import DataError

    ended = Record()
    trainer = make_trainer(
        tmp_path,
        [SaveBest("valid.loss"), ended],
        main_loop={"epochs": 1, "extra_streams": ["tset"]},
    )
    with pytest.raises(DataError, match="has no stream 'tset'"):
        trainer.run()
    assert trainer.step == 0 and not ended.epochs


def test_compute_stats_name_a_variable_that_is_not_there(tmp_path):
    trainer = make_trainer(tmp_path, [ComputeStats(["accuracy"])], main_loop={"epochs": 1})
    with pytest.raises(ModelError, match="'accuracy'"):
        trainer.run()
    with pytest.raises(ConfigError, match="median"):
        ComputeStats(["loss"], ["median"])


# --- ClassificationMetrics ---------------------------------------------------------------------


def test_classification_metrics_equal_scikit_learn(tmp_path):
    rec = Record()
    hook = ClassificationMetrics(
        predicted="logits", gold="y", metrics=["accuracy", "precision", "recall", "f1"]
    )
    trainer = make_trainer(tmp_path, [hook, rec], classes=True, main_loop={"epochs": 2})
    assert trainer.run() == 0
    for epoch in (1, 2):
        batches = rec.train_batches(epoch, trainer.steps_per_epoch)
        predicted = np.concatenate([b["logits"].argmax(-1).numpy() for b in batches])
        gold = np.concatenate([b["y"].numpy() for b in batches])
        assert len(gold) == 60
        for key, expected in sklearn_scores(predicted, gold).items():
            assert rec.epochs[epoch]["train"][key] == pytest.approx(expected, abs=1e-12), (
                epoch,
                key,
            )
        predicted, gold = classifier_predictions(rec.weights[epoch], "valid")
        for key, expected in sklearn_scores(predicted, gold).items():
            assert rec.epochs[epoch]["valid"][key] == pytest.approx(expected, abs=1e-12), (
                epoch,
                key,
            )
    assert (
        0.3 < rec.epochs[1]["train"]["accuracy"] < 1.0
    )  # an informative check: neither chance nor perfect


def test_macro_f1_counts_a_class_that_is_predicted_but_never_true(tmp_path):
    """Macro averages run over every class seen in the gold labels or the predictions (scikit-learn,
    torchmetrics): a class predicted but never true has precision 0 and F1 0, and counts."""
    hook = ClassificationMetrics(
        predicted="scores", gold="label", metrics=["accuracy", "precision", "recall", "f1"]
    )
    make_trainer(tmp_path, [hook], classes=True)  # called by hand below
    predicted, gold = np.array([0, 2, 1, 1]), np.array([0, 0, 1, 1])
    hook.after_batch(
        "valid",
        {
            "scores": torch.nn.functional.one_hot(torch.tensor(predicted), 3).double(),
            "label": torch.tensor(gold),
        },
    )
    out = {}
    hook.after_epoch(1, out)
    for key, expected in sklearn_scores(predicted, gold).items():
        assert out["valid"][key] == pytest.approx(expected, abs=1e-12), key


def test_classification_metrics_take_predicted_class_indices(tmp_path):
    """`predicted` may hold class indices; a batch may predict a class above its largest gold."""
    hook = ClassificationMetrics(
        predicted="pred", gold="label", metrics=["accuracy", "precision", "recall", "f1"]
    )
    make_trainer(tmp_path, [hook], classes=True)  # called by hand below
    batches = [([0, 2, 1, 1], [0, 0, 1, 1]), ([2, 1, 0], [2, 2, 0])]
    for predicted, gold in batches:
        hook.after_batch("test", {"pred": torch.tensor(predicted), "label": torch.tensor(gold)})
    out = {}
    hook.after_epoch(1, out)
    predicted = np.concatenate([p for p, _ in batches])
    gold = np.concatenate([g for _, g in batches])
    for key, expected in sklearn_scores(predicted, gold).items():
        assert out["test"][key] == pytest.approx(expected, abs=1e-12), key


def test_classification_metrics_refuse_classes_outside_the_matrix():
    """A label the scores have no column for, or a negative one (an ignored -100), is counted apart
    (on the outputs' device, nothing read back) and refused at the epoch's end, naming the stream
    and the keys; the epoch's counts start afresh after it."""
    hook = ClassificationMetrics(predicted="scores", gold="label")
    hook.after_batch("valid", {"scores": torch.eye(3, 2), "label": torch.tensor([0, 1, 1])})
    hook.after_batch("valid", {"scores": torch.eye(2), "label": torch.tensor([-100, 2])})
    with pytest.raises(ModelError, match=r"2 samples of stream 'valid'.*outside 0-1 in 'label'"):
        hook.after_epoch(1, {})
    hook.after_batch("valid", {"scores": torch.eye(2), "label": torch.tensor([0, 0])})
    out: dict = {}
    hook.after_epoch(2, out)
    assert out["valid"]["accuracy"] == 0.5


def test_classification_metrics_count_tokens_of_sequences():
    """Scores of shape (batch, tokens, classes) against gold of shape (batch, tokens)."""
    hook = ClassificationMetrics(predicted="scores", gold="label", metrics=["accuracy"])
    scores = torch.zeros(2, 3, 4)
    gold = torch.tensor([[0, 1, 2], [3, 3, 0]])
    scores[0, :, 0] = scores[1, :, 3] = 1  # predicts 0, 0, 0 and 3, 3, 3: 3 right of 6
    hook.after_batch("valid", {"scores": scores, "label": gold})
    out: dict = {}
    hook.after_epoch(1, out)
    assert out["valid"]["accuracy"] == 0.5


def test_classification_metrics_refuse_gold_that_is_not_one_class_per_prediction():
    hook = ClassificationMetrics(predicted="scores", gold="image")
    with pytest.raises(ModelError, match=r"'scores' gives 3 predicted .* but 'image' 12 gold"):
        hook.after_batch("valid", {"scores": torch.eye(3, 2), "image": torch.zeros(3, 2, 2)})


# --- LogVariables, LogProfile ------------------------------------------------------------------


def test_log_variables_and_log_profile_write_a_line_per_epoch(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [ComputeStats(), LogVariables(), LogProfile(), rec], main_loop={"epochs": 2}
    )
    assert trainer.run() == 0
    text = (trainer.run_dir / "log.txt").read_text()
    for epoch, step in ((1, 5), (2, 10)):
        values = rec.epochs[epoch]
        line = (
            f"epoch {epoch} (step {step}) | train: loss {values['train']['loss']:.6g} | "
            f"valid: loss {values['valid']['loss']:.6g}"
        )
        assert line in text
        profile = re.search(rf"epoch {epoch} time \| (.*)", text)
        assert profile, text
        parts = re.findall(r"(\w+) ([\d.]+)s \((\d+)%\)", profile.group(1))
        assert [name for name, _, _ in parts] == [
            "data",
            "forward_backward",
            "communication",
            "optimizer",
            "hooks",
            "eval",
            "after_epoch",
        ]
        assert abs(sum(int(p) for _, _, p in parts) - 100) <= len(parts)


class _SampledDDP:
    """A main process whose DDP sampled the backward all-reduce: `sampled` is what it reports."""

    is_main = True
    world_size = 2

    def __init__(self) -> None:
        self.sampled = (0.004, 0.003)

    def backward_communication(self) -> tuple[float, float]:
        return self.sampled


def test_log_profile_labels_ddps_run_long_average_and_repeats_it_only_when_it_changes():
    """DDP's figures are averages over the steps it sampled in the whole run, not the epoch's."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("phalanx")
    strategy = _SampledDDP()
    hook = LogProfile()
    hook.attach(SimpleNamespace(strategy=strategy, step_in_epoch=0, steps_per_epoch=10))
    profile = {"data": 0.1, "forward_backward": 0.3}
    try:
        logs.setup(None)  # INFO on, whatever earlier tests left
        logger.addHandler(handler)
        hook.after_epoch_profile(1, profile, "train", [])
        hook.after_epoch_profile(2, profile, "train", [])  # no new sample: nothing new to say
        strategy.sampled = (0.005, 0.003)
        hook.after_epoch_profile(3, profile, "train", [])
    finally:
        logger.removeHandler(handler)
    lines = [message for message in messages if "all-reduce" in message]
    assert len(lines) == 2, lines
    # once, after the first epoch: the share of communication (10 steps each waiting 1 ms of
    # the all-reduce, 0.01 s of 0.4 s), under half: no warning
    shares = [m for m in messages if m.startswith("communication |")]
    assert shares == ["communication | 2% of the training time (1.00 ms a step)"]
    assert not [m for m in messages if "waits for communication" in m]
    assert all(
        line.startswith(
            "gradient all-reduce in backward, DDP's sampled average over the run so far"
        )
        for line in lines
    )
    assert (
        "4.00 ms per step, 75% of it hidden" in lines[0]
        and "5.00 ms per step, 60% of it hidden" in lines[1]
    )
    assert [m.split(" time")[0] for m in messages if " time |" in m] == [
        "epoch 1",
        "epoch 2",
        "epoch 3",
    ]


def test_log_profile_judges_the_communication_share_after_the_first_steps_not_the_epoch():
    """Steps 6 to 25 are judged (the first five, slow with first calls, are not), as the run goes:
    a long epoch need not end before the run says that it waits for communication."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("phalanx")
    strategy = _SampledDDP()
    strategy.sampled = (0.0, 0.0)  # nothing inside backward: the share is what the steps say
    view = SimpleNamespace(strategy=strategy, training=True, step_in_epoch=0, steps_per_epoch=1000)
    hook = LogProfile()
    hook.attach(view)
    try:
        logs.setup(None)
        logger.addHandler(handler)
        for step in range(1, 40):
            # the first 5 steps: 1 s each of computation; then 4 ms computing, 6 ms communicating
            slow = min(step, 5)
            fast = max(step - 5, 0)
            view.profile = {
                "forward_backward": 1.0 * slow + 0.004 * fast,
                "communication": 0.006 * fast,
                "eval": 9.0,  # not a step's
            }
            hook.after_batch("train", {})
    finally:
        logger.removeHandler(handler)
    shares = [m for m in messages if m.startswith("communication |")]
    assert shares == ["communication | 60% of the training time (6.00 ms a step)"]
    warned = [m for m in messages if "more than half of each step waits" in m]
    assert len(warned) == 1 and "one device would take about 8.0 ms a step" in warned[0]
    hook.after_epoch_profile(1, {"forward_backward": 1.0}, "train", [])  # said once a run
    assert len([m for m in messages if m.startswith("communication |")]) == 1


def test_log_variables_shows_only_the_variables_asked_for(tmp_path):
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(aggregations=["mean", "max"]), LogVariables(["loss_max"])],
        main_loop={"epochs": 1},
    )
    assert trainer.run() == 0
    line = next(
        row
        for row in (trainer.run_dir / "log.txt").read_text().splitlines()
        if "epoch 1 (step 5)" in row
    )
    assert "train: loss_max " in line and "valid: loss_max " in line
    assert not re.search(r"\bloss \d", line)


def test_log_variables_take_stream_names_and_say_once_a_variable_no_stream_has(tmp_path):
    shown = LogVariables(["valid.loss", "loss_max", "los"])
    listed = [ComputeStats(aggregations=["mean", "max"]), shown]
    trainer = make_trainer(tmp_path, listed, main_loop={"epochs": 2})
    assert trainer.run() == 0
    log = (trainer.run_dir / "log.txt").read_text()
    line = next(row for row in log.splitlines() if "epoch 1 (step 5)" in row)
    assert "valid: loss " in line and "loss_max" in line and "train: loss " not in line
    said = "LogVariables: no stream has 'los'; the epoch's variables are train.loss, train.loss_max"
    assert log.count(said) == 1


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"ComputeStats": {"variables": "loss"}}, "variables takes a list, got the string 'loss'"),
        ({"LogVariables": {"variables": "loss"}}, "write [loss] for variables in the hooks.0."),
        ({"ClassificationMetrics": {"metrics": "f1"}}, "metrics takes a list, got the string"),
        ({"ClassificationMetrics": {"num_classes": 0}}, "num_classes must be a number above 1"),
        ({"LogThroughput": {"every_n_steps": 0}}, "every_n_steps must be a positive number"),
        ({"LogThroughput": {"peak_flops": -1}}, "peak_flops must be a positive number, got -1"),
        ({"ShowProgress": {"refresh_s": -1}}, "refresh_s must be a number of 0 or more"),
    ],
)
def test_hook_keywords_of_the_wrong_kind_are_refused_when_the_hooks_are_built(spec, words):
    raw = toy.regression_config(hooks=[spec])
    with pytest.raises(ConfigError) as info:
        build_hooks(config.validate(raw), [TESTS])
    assert words in str(info.value)


# --- WriteCSV ----------------------------------------------------------------------------------


def test_write_csv_has_a_row_per_epoch_and_a_column_per_variable(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(aggregations=["mean", "max"]), WriteCSV(), rec],
        main_loop={"epochs": 3},
    )
    assert trainer.run() == 0
    columns, rows = read_csv(trainer.run_dir / "metrics.csv")
    assert columns == [
        "epoch",
        "step",
        "train.loss",
        "train.loss_max",
        "valid.loss",
        "valid.loss_max",
    ]
    assert [(int(r["epoch"]), int(r["step"])) for r in rows] == [(1, 5), (2, 10), (3, 15)]
    for row in rows:
        values = rec.epochs[int(row["epoch"])]
        for column in columns[2:]:
            stream, var = column.split(".")
            assert float(row[column]) == values[stream][var]  # written with full precision


def test_write_csv_drops_the_rows_after_the_restored_epoch(tmp_path):
    hooks = lambda: [ComputeStats(), WriteCSV(), SaveEvery(epochs=1)]  # noqa: E731
    trainer = make_trainer(tmp_path, hooks(), main_loop={"epochs": 3})
    assert trainer.run() == 0
    _, before = read_csv(trainer.run_dir / "metrics.csv")
    again = make_trainer(tmp_path, hooks(), main_loop={"epochs": 3})
    again.restore(5)  # back to the end of epoch 1: epochs 2 and 3 are trained again
    assert again.run() == 0
    _, after = read_csv(trainer.run_dir / "metrics.csv")
    assert [r["epoch"] for r in after] == ["1", "2", "3"]
    assert after == before  # the same sample order and RNG: the same numbers, each epoch once


# --- WriteTensorBoard --------------------------------------------------------------------------


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_write_tensorboard_writes_events_that_tensorboard_reads(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [ComputeStats(), WriteTensorBoard(every_n_steps=2), rec], main_loop={"epochs": 2}
    )
    assert trainer.run() == 0
    folder = trainer.run_dir / "tensorboard"
    assert [p.name.startswith("events.out.tfevents.") for p in folder.iterdir()] == [True]
    scalars = _scalars(folder)
    assert {"train/loss", "valid/loss", "train/step_loss", "lr/group0"} <= set(scalars)
    for stream in ("train", "valid"):
        steps = [s for s, _ in scalars[f"{stream}/loss"]]
        assert steps == [5, 10]
        for (_, value), epoch in zip(scalars[f"{stream}/loss"], (1, 2), strict=True):
            assert value == pytest.approx(rec.epochs[epoch][stream]["loss"], rel=1e-6)
    step_means = {step: b["loss"].mean().item() for s, step, b in rec.batches if s == "train"}
    assert [s for s, _ in scalars["train/step_loss"]] == [2, 4, 6, 8, 10]
    for step, value in scalars["train/step_loss"]:
        assert value == pytest.approx(step_means[step], rel=1e-6)
    assert [v for _, v in scalars["lr/group0"]] == pytest.approx([0.05] * 5)


def test_write_tensorboard_into_a_folder_that_cannot_be_made_is_one_error(tmp_path):
    trainer = make_trainer(tmp_path, [WriteTensorBoard(log_dir="blocked/tensorboard")])
    (trainer.run_dir / "blocked").write_text("a file where the folder should go\n")
    with pytest.raises(StorageError, match=r"cannot write .*blocked/tensorboard: Not a directory"):
        trainer.run()


def test_write_tensorboard_keeps_every_event_across_a_resume(tmp_path):
    """A resumed run continues after the checkpoint's step: the events logged at that step belong to
    the history it keeps, and must still be there (purging starts after it)."""
    hooks = lambda: [ComputeStats(), WriteCSV(), WriteTensorBoard(every_n_steps=5), SaveLatest()]  # noqa: E731
    assert make_trainer(tmp_path, hooks(), main_loop={"epochs": 2}).run() == 0
    resumed = make_trainer(tmp_path, hooks(), main_loop={"epochs": 3})
    resumed.restore(10)
    assert resumed.run() == 0
    _, rows = read_csv(tmp_path / "run" / "metrics.csv")
    scalars = _scalars(tmp_path / "run" / "tensorboard")
    for stream in ("train", "valid"):
        assert scalars[f"{stream}/loss"] == [
            (int(r["step"]), pytest.approx(float(r[f"{stream}.loss"]), rel=1e-6)) for r in rows
        ]
    assert [s for s, _ in scalars["train/step_loss"]] == [5, 10, 15]


# --- PlotLines ---------------------------------------------------------------------------------


def test_plot_lines_write_png_files_that_matplotlib_reads(tmp_path):
    from matplotlib import image

    plot = PlotLines(variables=["loss", "accuracy"])
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), ClassificationMetrics("logits", "y"), plot],
        classes=True,
        main_loop={"epochs": 2},
    )
    assert trainer.run() == 0
    folder = trainer.run_dir / "plots"
    assert sorted(p.name for p in folder.iterdir()) == [
        "accuracy.png",
        "loss.png",
    ]  # no f1, no temp files
    for name in ("accuracy.png", "loss.png"):
        assert (folder / name).read_bytes()[:8] == PNG_SIGNATURE
        pixels = image.imread(folder / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # something is drawn
    assert sorted(plot.history) == ["train.accuracy", "train.loss", "valid.accuracy", "valid.loss"]
    assert [e for e, _ in plot.history["valid.loss"]] == [1, 2]


def test_plot_lines_say_once_a_variable_no_stream_has(tmp_path):
    plot = PlotLines(variables=["loss", "valid.loss", "los"])
    trainer = make_trainer(tmp_path, [ComputeStats(), plot], main_loop={"epochs": 2})
    assert trainer.run() == 0
    log = (trainer.run_dir / "log.txt").read_text()
    said = "PlotLines: no stream has 'los'; the epoch's variables are train.loss, valid.loss"
    assert log.count(said) == 1
    assert sorted(plot.history) == ["train.loss", "valid.loss"]


def test_plot_lines_draw_in_a_process_of_their_own(tmp_path):
    """While it trains, the training process never imports matplotlib: the curves are drawn by
    another process, and are complete when training ends (the last picture is that of the whole
    history; the child's, or the trainer's where the child, at idle priority, got no CPU in time on
    a busy machine)."""
    script = tmp_path / "train.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
import phalanx, toy
from phalanx.hooks import ComputeStats, Hook, PlotLines

class Looks(Hook):
    def after_epoch(self, epoch, epoch_data):
        drawn = [name for name in sys.modules if name.startswith("matplotlib")]
        assert not drawn, "matplotlib in the training process"

raw = toy.regression_config(
    output_root={str(tmp_path / "runs")!r}, hooks=[],
    main_loop={{"epochs": 4, "extra_streams": ["valid"]}},
)
plot = PlotLines()
run = phalanx.fit(raw, hooks=[ComputeStats(), plot, Looks()])
assert run.code == 0
print(json.dumps({{"run_dir": str(run.run_dir), "history": plot.history}}))
""")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    from matplotlib import image

    from phalanx.plots import draw

    done = json.loads(result.stdout.splitlines()[-1])
    folder = Path(done["run_dir"]) / "plots"
    assert sorted(p.name for p in folder.iterdir()) == ["loss.png"]
    assert [epoch for epoch, _ in done["history"]["valid.loss"]] == [1, 2, 3, 4]
    draw(tmp_path / "whole", done["history"])  # the same picture, drawn here from the whole history
    assert (folder / "loss.png").read_bytes() == (tmp_path / "whole" / "loss.png").read_bytes()
    pixels = image.imread(folder / "loss.png")
    assert pixels.ndim == 3 and pixels.std() > 0


class _KeepsPainter(PlotLines):
    """PlotLines that remembers its drawing process, to see that it ended."""

    def after_epoch(self, epoch, epoch_data):
        super().after_epoch(epoch, epoch_data)
        self.child = self._painter._child


class _FailsAt(Hook):
    """Fails in the middle of an epoch, while its DataLoader workers run."""

    def __init__(self, step):
        self.step = step

    def after_batch(self, stream, batch):
        if self.trainer.training and self.trainer.step == self.step:
            raise RuntimeError("the model's code failed")


@pytest.mark.parametrize("late", [False, True], ids=["the-child-draws", "the-trainer-draws"])
def test_plot_lines_that_cannot_write_fail_the_run_naming_the_folder(tmp_path, monkeypatch, late):
    """Whoever draws the last picture (the child, or the trainer where the child is late), the
    error is PlotLines', naming the folder."""
    if late:
        monkeypatch.setattr("phalanx.plots.CLOSE_WAIT_S", 0.0)
    plot = _KeepsPainter(path="blocked")
    trainer = make_trainer(tmp_path, [ComputeStats(), plot], main_loop={"epochs": 2})
    (trainer.run_dir / "blocked").write_text("a file where the plots' folder would be")
    with pytest.raises(StorageError, match="PlotLines: .*blocked"):
        trainer.run()
    assert plot.child.poll() is not None  # the drawing process ended


def test_plot_lines_draw_the_last_picture_themselves_when_the_child_is_late(tmp_path, monkeypatch):
    """A drawing process that has not drawn the end in time (at idle priority on a busy machine) is
    ended, and the trainer draws the last picture: the plots are complete, and the run ends soon."""
    monkeypatch.setattr("phalanx.plots.CLOSE_WAIT_S", 0.0)
    plot = _KeepsPainter()
    trainer = make_trainer(tmp_path, [ComputeStats(), plot], main_loop={"epochs": 3})
    assert trainer.run() == 0
    assert plot.child.returncode == -signal.SIGKILL
    from phalanx.plots import draw

    draw(tmp_path / "whole", plot.history)
    assert (trainer.run_dir / "plots" / "loss.png").read_bytes() == (
        tmp_path / "whole" / "loss.png"
    ).read_bytes()


@pytest.mark.timeout(60)
def test_a_failing_run_with_plot_lines_and_loader_workers_ends(tmp_path):
    """DataLoader workers forked while the drawing process lives hold copies of its pipe: the run
    still ends, and its drawing process with it, when training fails."""
    plot = _KeepsPainter()
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), plot, _FailsAt(step=7)],
        main_loop={"epochs": 3},
        dataset={
            "class": "toy.Regression",
            "batch_size": 8,
            "num_workers": 1,
            "persistent_workers": False,
        },
    )
    with pytest.raises(RuntimeError, match="the model's code failed"):
        trainer.run()
    assert plot.child.poll() is not None
    assert (trainer.run_dir / "plots" / "loss.png").is_file()


# --- ShowProgress ------------------------------------------------------------------------------


def test_show_progress_draws_on_a_terminal(tmp_path, monkeypatch):
    out = io.StringIO()
    terminal = Console(file=out, force_terminal=True, width=150, color_system=None)
    monkeypatch.setattr("phalanx.logs.console", terminal)
    monkeypatch.setattr("phalanx.hooks.progress.console", terminal)
    trainer = make_trainer(
        tmp_path,
        [ShowProgress(refresh_s=0.0), ComputeStats(), LogVariables()],
        main_loop={"epochs": 2},
    )
    assert trainer.run() == 0
    text = out.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "5/5" in text  # the training bar reaches the epoch's step count
    assert "valid" in text and "samples/s" in text
    assert re.search(r"loss \d+\.\d{4}", text)
    assert "epoch 2 (step 10)" in text  # log lines go through the same console


class _Ticks:
    """A clock that advances one second each time it is read: a batch a second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_progress_bar_rates_from_the_first_batchs_end_and_counts_evaluation_batches(
    tmp_path, monkeypatch
):
    """A batch of 8 a second is 8 samples/s from the first refresh on (not the first batch's samples
    over the instant since it ended); the validation bar counts to its 2 batches (10 samples in
    batches of 8), the second of 2 samples."""
    out = io.StringIO()
    terminal = Console(file=out, force_terminal=True, width=150, color_system=None)
    monkeypatch.setattr("phalanx.logs.console", terminal)
    monkeypatch.setattr("phalanx.hooks.progress.console", terminal)
    trainer = make_trainer(tmp_path, [ShowProgress(refresh_s=0.0, clock=_Ticks()), ComputeStats()])
    assert trainer.run() == 0
    text = out.getvalue()
    rows = [r.strip() for r in re.split(r"\x1b\[[0-9;?]*[A-Za-z]|\n", text) if r.strip()]

    def rates(name: str) -> set[str]:
        return {m[1] for r in rows if (m := re.search(rf"^{name} .* ([\d,]+) samples/s", r))}

    assert rates("epoch") == {"8"} and rates("valid") == {"2"}, rows  # valid: 8, then 2
    valid = [r for r in rows if r.startswith("valid")]
    assert valid and all(re.search(r" [12]/2 ", r) for r in valid), valid


def test_off_a_terminal_progress_is_a_log_line_every_so_often(tmp_path):
    """Every 3 s (a batch a second): the fourth of 5 steps is 3 s after the first ended."""
    trainer = make_trainer(
        tmp_path, [ShowProgress(every_s=3, clock=_Ticks()), ComputeStats()], main_loop={"epochs": 2}
    )
    assert trainer.run() == 0
    log = (tmp_path / "run" / "log.txt").read_text().splitlines()
    lines = [line.split(" INFO ", 1)[1] for line in log if "samples/s" in line]
    assert len(lines) == 2, lines  # one an epoch; the 2 validation batches take 1 s
    for epoch, line in enumerate(lines, 1):
        assert re.fullmatch(
            rf"epoch {epoch}/2: 4/5 steps \(80%\), 8 samples/s, loss \d+\.\d{{4}}, eta 0:00:01",
            line,
        ), line


def test_show_progress_draws_nothing_off_a_terminal(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("phalanx.hooks.progress.console", Console(file=out, force_terminal=False))
    hook = ShowProgress()
    trainer = make_trainer(tmp_path, [hook, ComputeStats()], main_loop={"epochs": 1})
    assert trainer.run() == 0
    assert out.getvalue() == "" and hook._progress is None


# --- SaveEvery, SaveLatest, SaveBest -----------------------------------------------------------


def test_save_every_n_steps(tmp_path):
    trainer = make_trainer(
        tmp_path, [SaveEvery(steps=3)], main_loop={"epochs": 2}, checkpoints={"keep_last": 10}
    )
    assert trainer.run() == 0
    assert trainer.checkpoints.steps() == [3, 6, 9]
    for step in (3, 6, 9):
        trainer.checkpoints.verify(step)
        state = json.loads((trainer.checkpoints.path(step) / "trainer.json").read_text())
        assert (state["step"], state["epoch"], state["step_in_epoch"]) == (
            step,
            (step - 1) // 5,
            step - 5 * ((step - 1) // 5),
        )


def test_save_every_n_epochs(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [SaveEvery(epochs=2), rec], main_loop={"epochs": 4}, checkpoints={"keep_last": 10}
    )
    assert trainer.run() == 0
    assert trainer.checkpoints.steps() == [10, 20]
    saved = load_file(str(trainer.checkpoints.path(10) / "model.safetensors"))
    for name, value in rec.weights[2].items():
        assert torch.equal(saved[name], value)
    with pytest.raises(ConfigError):
        SaveEvery(epochs=0)


def test_save_latest_after_each_epoch_and_at_the_end(tmp_path):
    trainer = make_trainer(tmp_path, [SaveLatest(), StopAfter(steps=7)], main_loop={"epochs": 3})
    assert trainer.run() == 0
    assert trainer.checkpoints.steps() == [5, 7]
    state = json.loads((trainer.checkpoints.path(7) / "trainer.json").read_text())
    assert (state["epoch"], state["step_in_epoch"]) == (1, 2)  # resumable mid-epoch


def test_save_best_keeps_the_best_step_through_retention(tmp_path):
    rec = Record()
    # valid.loss falls every epoch, so with mode max the best stays at epoch 1 while newer steps
    # come and go under keep_last=1
    hooks = [ComputeStats(), SaveBest("valid.loss", mode="max"), SaveLatest(), rec]
    trainer = make_trainer(tmp_path, hooks, main_loop={"epochs": 4}, checkpoints={"keep_last": 1})
    assert trainer.run() == 0
    losses = [rec.epochs[e]["valid"]["loss"] for e in (1, 2, 3, 4)]
    assert losses == sorted(losses, reverse=True)
    best = json.loads((trainer.run_dir / "checkpoints" / "best.json").read_text())
    assert best == {"step": 5, "variable": "valid.loss", "value": losses[0], "epoch": 1}
    assert trainer.checkpoints.steps() == [5, 20]
    trainer.checkpoints.verify(5)
    saved = load_file(str(trainer.checkpoints.path(5) / "model.safetensors"))
    for name, value in rec.weights[1].items():
        assert torch.equal(saved[name], value)
    assert trainer.checkpoints.select("best") == 5


def test_save_best_in_min_mode_follows_the_improvements(tmp_path):
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), SaveBest("valid.loss", mode="min")],
        main_loop={"epochs": 3},
        checkpoints={"keep_last": 1},
    )
    assert trainer.run() == 0
    assert trainer.checkpoints.best() == 15 and trainer.checkpoints.steps() == [15]


@pytest.mark.parametrize("hook", [SaveBest, StopOnPlateau])
def test_a_best_or_plateau_of_a_variable_nothing_computes_is_refused_before_training(
    tmp_path, hook
):
    ended = Record()
    listed = [ComputeStats(["loss"], ["mean", "std"]), LogThroughput(), hook("valid.los"), ended]
    trainer = make_trainer(tmp_path, listed, main_loop={"epochs": 1})
    with pytest.raises(ConfigError) as refused:
        trainer.run()
    said = str(refused.value)
    assert said.startswith(f"{hook.__name__}: no hook listed before it computes 'valid.los'")
    assert 'will be loss, loss_std (did you mean "valid.loss"?).' in said
    assert trainer.step == 0 and not ended.epochs
    # a variable computed only after it is read is not there either
    late = make_trainer(tmp_path, [hook("train.loss"), ComputeStats()], main_loop={"epochs": 1})
    with pytest.raises(ConfigError, match="the train stream's variables will be none"):
        late.run()


class Holdout(Hook):
    """A user's hook that puts a stream of its own into the epoch's data: `holdout.score`, the
    epoch's number, so that its best is the last epoch."""

    def after_epoch(self, epoch, epoch_data):
        epoch_data["holdout"] = {"score": float(epoch)}


class SaidHoldout(Holdout):
    """The same, saying what it computes."""

    def computes(self, stream):
        return ["score"] if stream == "holdout" else []


def test_what_a_best_reads_is_checked_against_what_the_hooks_before_it_say_they_compute(
    tmp_path,
):
    # the run's own gradient norms, where it clips, and LogThroughput's figures
    clips = make_trainer(
        tmp_path,
        [LogThroughput(), SaveBest("train.samples_per_s", "max"), SaveBest("train.grad_norm")],
        main_loop={"epochs": 1},
        optimizer={"max_grad_norm": 1.0},
    )
    assert clips.run() == 0
    # a hook that does not say what it computes may put anything: a stream of its own too
    (tmp_path / "run").rename(tmp_path / "first")
    mute = make_trainer(
        tmp_path, [Holdout(), SaveBest("holdout.score", "max")], main_loop={"epochs": 2}
    )
    assert mute.run() == 0 and mute.checkpoints.best() == mute.step
    # one that says is held to it, streams included
    (tmp_path / "run").rename(tmp_path / "second")
    said = make_trainer(
        tmp_path, [SaidHoldout(), SaveBest("holdout.scores")], main_loop={"epochs": 1}
    )
    with pytest.raises(ConfigError, match="stream 'holdout' of holdout.scores is not evaluated"):
        said.run()
    assert said.step == 0


# --- StopAfter, StopOnNaN, StopOnPlateau -------------------------------------------------------


def test_stop_after_epochs(tmp_path):
    trainer = make_trainer(tmp_path, [ComputeStats(), StopAfter(epochs=2)], main_loop={"epochs": 5})
    assert trainer.run() == 0
    assert (trainer.epoch, trainer.step) == (2, 10)
    assert trace_events(trainer.run_dir)[-1] == "finished"


def test_stop_after_steps(tmp_path):
    trainer = make_trainer(tmp_path, [StopAfter(steps=7)], main_loop={"epochs": 5})
    assert trainer.run() == 0
    assert (trainer.epoch, trainer.step, trainer.step_in_epoch) == (1, 7, 2)


def test_stop_after_minutes_reads_the_injected_clock(tmp_path):
    calls = []

    def clock() -> float:  # 20 seconds pass at each reading
        calls.append(len(calls) * 20.0)
        return calls[-1]

    trainer = make_trainer(tmp_path, [StopAfter(minutes=1, clock=clock)], main_loop={"epochs": 5})
    assert trainer.run() == 0
    assert trainer.step == 3  # readings 0 (start), 20, 40, 60: the third step reaches one minute
    with pytest.raises(ConfigError):
        StopAfter()


def test_stop_on_nan_fails_the_run_at_the_step_that_saw_it(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [ComputeStats(), StopOnNaN(), SaveLatest(), rec], main_loop={"epochs": 3}
    )
    trainer.dataset.streams()["train"].y[13] = float("nan")
    expected_step = data.permutation(0, 1, 40).index(13) // 8 + 1
    assert trainer.run() == 1
    assert trainer.step == expected_step
    assert rec.success is False
    assert trace_events(trainer.run_dir)[-1] == "failed"
    assert trainer.checkpoints.steps() == (
        [5] if expected_step > 5 else []
    )  # no checkpoint of the failed state
    assert "StopOnNaN" in (trainer.run_dir / "log.txt").read_text()


def test_stop_on_nan_sees_a_diverging_loss(tmp_path):
    trainer = make_trainer(
        tmp_path, [StopOnNaN()], optimizer={"class": "SGD", "lr": 1e150}, main_loop={"epochs": 50}
    )
    assert trainer.run() == 1
    assert not math.isfinite(float(trainer.last_loss))
    assert trainer.epoch < 50


class _Event:
    """A CUDA event's stand-in for a loss read behind its step on the CPU: the copy is there."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def read_behind(monkeypatch):
    """StopOnNaN reading each loss behind its step, as on a GPU, on the CPU."""
    from phalanx.hooks import stopping

    monkeypatch.setattr(stopping, "_read_behind", lambda loss: True)
    monkeypatch.setattr(stopping.torch.cuda, "Event", _Event)
    monkeypatch.setattr(stopping.torch.cuda, "current_stream", lambda device=None: None)


@pytest.mark.parametrize("bad_step, failed_at", [(2, 3), (5, 5), (6, 7)])
def test_stop_on_nan_read_behind_the_step_fails_a_check_later(
    tmp_path, read_behind, bad_step, failed_at
):
    """Read behind the step (on a GPU), a loss that is not finite fails the run at the next
    check, naming its step; at an epoch's last step (5 of 5) the check waits, so no evaluation or
    checkpoint comes after it (the epoch does not end)."""
    ended = Record()
    trainer = make_trainer(
        tmp_path,
        [StopOnNaN(), SaveLatest(), ended],
        model={"class": "toy.InfAt", "features": 3, "step": bad_step},
        main_loop={"epochs": 3},
    )
    assert trainer.run() == 1
    assert trainer.step == failed_at
    assert len(ended.epochs) == (1 if bad_step > 5 else 0)
    assert trainer.checkpoints.steps() == ([5] if bad_step > 5 else [])
    log = (trainer.run_dir / "log.txt").read_text()
    assert f"the training loss is not finite (inf) at step {bad_step} (StopOnNaN)" in log


def test_stop_on_nan_read_behind_reads_its_last_check_at_the_epochs_end_between_checks(
    tmp_path, read_behind
):
    """Checking every 2nd step, read behind the step: step 4's infinite loss, on its way at the
    epoch's last step (5, no check of its own), is read there, before the epoch's end."""
    ended = Record()
    trainer = make_trainer(
        tmp_path,
        [StopOnNaN(every_n_steps=2), SaveLatest(), ended],
        model={"class": "toy.InfAt", "features": 3, "step": 4},
        main_loop={"epochs": 3},
    )
    assert trainer.run() == 1
    assert trainer.step == 5
    assert ended.epochs == {} and trainer.checkpoints.steps() == []
    log = (trainer.run_dir / "log.txt").read_text()
    assert "the training loss is not finite (inf) at step 4 (StopOnNaN)" in log


def test_stop_on_nan_read_behind_says_what_it_read_after_another_hook_stopped(
    tmp_path, read_behind
):
    """StopAfter ends the run at the step whose loss StopOnNaN has not read yet: the run ends as
    StopAfter says, and the loss is read as it ends and logged as an error."""
    trainer = make_trainer(
        tmp_path,
        [StopOnNaN(), StopAfter(steps=2)],
        model={"class": "toy.InfAt", "features": 3, "step": 2},
    )
    assert trainer.run() == 0
    assert trainer.step == 2
    log = (trainer.run_dir / "log.txt").read_text()
    assert (
        "the training loss is not finite (inf) at step 2 (StopOnNaN), read after the run had "
        "stopped" in log
    )


def test_a_failure_at_the_step_another_hook_stops_at_stands_over_the_planned_end(tmp_path):
    """StopAfter ends the run at step 3 as planned, and StopOnNaN, listed after it, finds step 3's
    loss infinite at that step: the run failed (the later hook's failure stands), either order."""
    for hooks in ([StopAfter(steps=3), StopOnNaN()], [StopOnNaN(), StopAfter(steps=3)]):
        trainer = make_trainer(
            tmp_path, hooks, model={"class": "toy.InfAt", "features": 3, "step": 3}
        )
        assert trainer.run() == 1
        assert trainer.step == 3
        assert trace_events(trainer.run_dir)[-1] == "failed"
    ended = make_trainer(tmp_path, [StopAfter(steps=3), StopOnNaN()])
    assert ended.run() == 0 and trace_events(ended.run_dir)[-1] == "finished"


def test_stop_on_plateau_after_patience_epochs_without_improvement(tmp_path):
    rec = Record()
    # lr 0: nothing learns, valid.loss is the same every epoch
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), StopOnPlateau("valid.loss", patience=2), rec],
        optimizer={"class": "SGD", "lr": 0.0},
        main_loop={"epochs": 10},
    )
    assert trainer.run() == 0
    assert trainer.epoch == 3 and sorted(rec.epochs) == [1, 2, 3]


def test_stop_on_plateau_lets_an_improving_run_go_on(tmp_path):
    trainer = make_trainer(
        tmp_path, [ComputeStats(), StopOnPlateau("valid.loss", patience=1)], main_loop={"epochs": 3}
    )
    assert trainer.run() == 0
    assert trainer.epoch == 3


def test_stop_on_plateau_min_delta(tmp_path):
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), StopOnPlateau("valid.loss", patience=1, min_delta=100.0)],
        main_loop={"epochs": 5},
    )
    assert trainer.run() == 0
    assert trainer.epoch == 2  # improvements under min_delta do not count


# --- TrainingTerminated and the order of hooks -------------------------------------------------


class StopAt(Hook):
    def __init__(self, event: str, when: int, success: bool = True):
        self.event, self.when, self.success = event, when, success

    def after_batch(self, stream, batch):
        if self.event == "after_batch" and stream == "train" and self.trainer.step == self.when:
            raise TrainingTerminated("test stop", success=self.success)

    def after_epoch(self, epoch, epoch_data):
        if self.event == "after_epoch" and epoch == self.when:
            raise TrainingTerminated("test stop", success=self.success)


def test_a_hook_stopping_after_epoch_lets_the_later_hooks_run_that_epoch(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path,
        [ComputeStats(), StopAt("after_epoch", 1), WriteCSV(), SaveLatest(), rec],
        main_loop={"epochs": 3},
    )
    assert trainer.run() == 0
    assert trainer.epoch == 1
    assert sorted(rec.epochs) == [1] and rec.profiles == [1] and rec.success is True
    _, rows = read_csv(trainer.run_dir / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1"]
    assert trainer.checkpoints.steps() == [5]


def test_a_hook_stopping_after_batch_lets_the_later_hooks_see_that_batch(tmp_path):
    rec = Record()
    trainer = make_trainer(
        tmp_path, [StopAt("after_batch", 3, success=False), rec], main_loop={"epochs": 3}
    )
    assert trainer.run() == 1
    assert [step for s, step, _ in rec.batches if s == "train"] == [1, 2, 3]
    assert rec.success is False
    assert trace_events(trainer.run_dir)[-1] == "failed"


# --- the default hooks -------------------------------------------------------------------------


def test_default_hooks_write_metrics_tensorboard_and_checkpoints(tmp_path):
    path = toy.write_config(tmp_path / "exp", toy.regression_config(hooks=None))
    assert commands.train(str(path), []) == 0
    [run] = list((tmp_path / "exp" / "runs").iterdir())
    _, rows = read_csv(run / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2"] and "valid.loss" in rows[0]
    assert any(p.name.startswith("events.out.tfevents.") for p in (run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "step-10" / "manifest.json").is_file()
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["variable"] == "valid.loss" and best["step"] == 10
    assert "epoch 2 time |" in (run / "log.txt").read_text()


def test_default_hooks_without_a_valid_stream_save_no_best():
    with_valid = config.validate(toy.regression_config(hooks=None))
    without = config.validate(toy.regression_config(hooks=None, main_loop={"extra_streams": []}))
    names = [type(h).__name__ for h in build_hooks(with_valid, [TESTS])]
    assert names == [
        "ShowProgress",
        "ComputeStats",
        "LogThroughput",
        "LogVariables",
        "LogProfile",
        "WriteCSV",
        "WriteTensorBoard",
        "SaveLatest",
        "SaveBest",
    ]
    assert "SaveBest" not in [type(h).__name__ for h in build_hooks(without, [TESTS])]


def test_the_zeroth_epoch_evaluates_the_train_stream_without_training_hooks_firing(tmp_path):
    """skip_zeroth_epoch: false evaluates every stream before step 1; hooks that act on training
    steps (StopOnNaN, SaveEvery by steps, throughput, TensorBoard's step loss) must wait for
    them."""
    cfg = config.validate(
        toy.regression_config(
            main_loop={"epochs": 1, "extra_streams": ["valid"], "skip_zeroth_epoch": False},
            hooks=[
                {"ComputeStats": {"variables": ["loss"]}},
                "StopOnNaN",
                {"SaveEvery": {"steps": 1}},
                {"LogThroughput": {"every_n_steps": 1}},
                {"WriteTensorBoard": {"every_n_steps": 1}},
                "ShowProgress",
                "toy.Record",
            ],
        )
    )
    trainer = Trainer(cfg, tmp_path, [TESTS])
    assert trainer.run() == 0
    record = trainer.hooks[-1]
    assert len(record.epochs) == 2  # epoch 0 (evaluation only) and epoch 1
    assert "loss" in record.epochs[0]["train"]  # the train stream was evaluated before training
    assert min(trainer.checkpoints.steps()) >= 1  # no checkpoint "at step 0" from the evaluation


def test_hooks_see_the_run_read_only():
    from phalanx.trainer import Trainer

    seen = []

    class Meddler(Hook):
        def after_batch(self, stream, batch):
            seen.append(self.trainer.step)
            with pytest.raises(AttributeError):
                self.trainer.step = 1000  # a hook cannot move the run's counters

    trainer = Trainer(config.validate(toy.regression_config(hooks=[])), None, [], hooks=[Meddler()])
    assert trainer.run() == 0
    assert seen[:3] == [1, 2, 3] and trainer.step == 10


def _imports(path: Path) -> set[str]:
    """Every module a source file imports, wherever the import stands (TYPE_CHECKING, functions)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_import_circle():
    """Hooks see a view of the run, not the trainer; the launcher is handed the function it runs."""
    src = Path(data.__file__).parent
    for path in sorted((src / "hooks").glob("*.py")):
        assert "phalanx.trainer" not in _imports(path), path.name
    assert not {"phalanx.commands", "phalanx.trainer"} & _imports(src / "launch.py")


class _TensorState(Hook):
    """Keeps a tensor in its state: a checkpoint holds a hook's state as JSON."""

    def state_dict(self):
        return {"best": torch.tensor(1.0)}


class _Raises(Hook):
    def after_batch(self, stream, batch):
        if self.trainer.step == 2:
            raise ValueError("a hook's own mistake at step 2")


def test_a_hook_state_json_cannot_hold_is_refused_before_the_first_step(tmp_path):
    ended = Record()
    trainer = make_trainer(tmp_path, [_TensorState(), SaveLatest(), ended])
    with pytest.raises(ModelError) as info:
        trainer.run()
    said = str(info.value)
    assert said.startswith("hook _TensorState's state_dict() holds what JSON cannot")
    assert "Tensor" in said and trainer.step == 0 and not ended.epochs


def test_a_run_that_fails_in_this_process_keeps_why_in_its_log(tmp_path):
    trainer = make_trainer(tmp_path, [_Raises()])
    with pytest.raises(ValueError, match="a hook's own mistake"):
        trainer.run()
    log = (trainer.run_dir / "log.txt").read_text()
    assert "ERROR training failed at step 2" in log
    assert "ValueError: a hook's own mistake at step 2" in log  # the traceback's last line


def test_every_built_in_hook_that_sees_the_steps_says_at_which_it_reads_the_loss():
    """The pipeline agrees on the steps between reads of the loss in one message: a hook that does
    not say where it reads is read at every step (the steps agreed one by one), so each built-in
    hook with an after_batch says, and says the steps it reads at (StopOnNaN reads each checked
    step's loss once it has been sent, and ends no window)."""
    from phalanx.hooks import BUILTIN, Hook, StopAfter, WriteTensorBoard
    from phalanx.hooks.base import reads_no_loss

    listening = [c for c in BUILTIN.values() if c.after_batch is not Hook.after_batch]
    assert listening and all(c.reads_loss is not Hook.reads_loss for c in listening)
    readers = {c.__name__ for c in listening if c.reads_loss is not reads_no_loss}
    assert readers == {"WriteTensorBoard", "WriteMLflow", "WriteWandb", "StopAfter"}
    board = WriteTensorBoard(every_n_steps=5)
    assert [s for s in range(1, 13) if board.reads_loss(s)] == [5, 10]
    # StopAfter reads none, but ends a window where it may end the run
    assert [s for s in range(1, 13) if StopAfter(steps=7).reads_loss(s)] == [7]
    assert [s for s in range(1, 13) if StopAfter(steps=6.5).reads_loss(s)] == [7]
    for other in (StopAfter(minutes=1), StopAfter(epochs=2)):
        assert not any(other.reads_loss(s) for s in range(1, 25))
    assert not WriteTensorBoard(every_n_steps=0).reads_loss(5)

    class Mine(Hook):
        def after_batch(self, stream, batch):
            pass

    assert all(Mine().reads_loss(s) for s in range(1, 5))  # unsaid: every step


def test_what_a_hook_class_says_of_its_loss_reads_holds_for_its_own_after_batch():
    """A subclass of a hook that reads no loss, or reads it every N steps, and that brings an
    after_batch of its own without saying at which steps it reads: read at every step (it may
    print `last_loss` on one process), not as its parent said; one that keeps its parent's
    after_batch keeps what the parent said; a tracker reads where it writes."""
    from phalanx.hooks import Hook, LogThroughput, WriteTensorBoard
    from phalanx.hooks.base import loss_reads
    from phalanx.hooks.trackers import _Tracker

    class Printing(LogThroughput):
        def after_batch(self, stream, batch):
            print(self.trainer.last_loss)

    class Quiet(LogThroughput):
        pass

    class Board(WriteTensorBoard):
        def after_batch(self, stream, batch):
            super().after_batch(stream, batch)

    class Said(Printing):
        def reads_loss(self, step):
            return step == 2

    for hook, steps in (
        (Printing(), [1, 2, 3, 4, 5, 6]),
        (Board(every_n_steps=2), [1, 2, 3, 4, 5, 6]),
        (WriteTensorBoard(every_n_steps=2), [2, 4, 6]),
        (Said(), [2]),
        (_Tracker(every_n_steps=3), [3, 6]),
    ):
        read = loss_reads(hook)
        assert read is not None and [s for s in range(1, 7) if read(s)] == steps
    assert loss_reads(Quiet()) is None and loss_reads(Hook()) is not None
