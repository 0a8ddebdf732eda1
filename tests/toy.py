"""Tiny models and datasets for the tests: fast, deterministic, importable from configs as
`toy.X`."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset


class Items(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "id": i}


class Regression:
    """A linear regression problem with noise; streams train, valid, test of the given sizes.
    `inf_at`: that training sample's target is infinite (its loss is)."""

    def __init__(
        self,
        n_train: int = 40,
        n_valid: int = 10,
        n_test: int = 10,
        features: int = 3,
        seed: int = 0,
        inf_at: int | None = None,
    ):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(features, generator=g)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
            x = torch.randn(n, features, generator=g)
            y = x @ w + 0.1 * torch.randn(n, generator=g)
            if name == "train" and inf_at is not None:
                y[inf_at] = float("inf")
            self._streams[name] = Items(x, y)

    def streams(self) -> dict[str, Items]:
        return self._streams


class _Unreadable(Items):
    """Items whose item `bad` raises; the first item a DataLoader worker reads adds `worker PID
    PARENT SIGNAL` to the file `record`, SIGNAL the one Linux sends it when its parent ends (0:
    none)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, bad: int, record: str):
        super().__init__(x, y)
        self.bad, self.record, self._said = bad, record, False

    def __getitem__(self, i: int) -> dict[str, Any]:
        import os

        from torch.utils.data import get_worker_info

        if not self._said and get_worker_info() is not None:
            self._said = True
            with open(self.record, "a") as f:
                f.write(f"worker {os.getpid()} {os.getppid()} {_death_signal()}\n")
        if i == self.bad:
            raise ValueError(f"training item {i} cannot be read")
        return super().__getitem__(i)


def _death_signal() -> int:
    """The signal Linux sends this process when its parent ends (PR_GET_PDEATHSIG)."""
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value


class UnreadableItem(Regression):
    """Regression whose training item `bad` raises when read. Each worker of a launch (a process
    with a RANK) adds `rank PID` to the file `record`, and each DataLoader worker `worker PID
    PARENT`."""

    def __init__(self, bad: int, record: str, **kwargs: Any):
        import os

        super().__init__(**kwargs)
        if "RANK" in os.environ:
            with open(record, "a") as f:
                f.write(f"rank {os.getpid()}\n")
        train = self._streams["train"]
        self._streams["train"] = _Unreadable(train.x, train.y, bad, record)


def unreadable_dataset(record: Path, bad: int = 29) -> dict:
    """The dataset section of a run whose training item `bad` a DataLoader worker cannot read
    (`UnreadableItem`, its processes added to `record`)."""
    return {
        "class": "toy.UnreadableItem",
        "bad": bad,
        "record": str(record),
        "batch_size": 8,
        "num_workers": 1,
    }


class Classes:
    """Gaussian blobs for classification: items {"x": features, "y": class index}."""

    def __init__(
        self,
        n_train: int = 60,
        n_valid: int = 20,
        n_test: int = 20,
        features: int = 4,
        classes: int = 3,
        seed: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        centers = 3 * torch.randn(classes, features, generator=g)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
            y = torch.randint(classes, (n,), generator=g)
            x = centers[y] + torch.randn(n, features, generator=g)
            self._streams[name] = Items(x, y)

    def streams(self) -> dict[str, Items]:
        return self._streams


def keras_net(
    features: int = 16,
    classes: int = 3,
    dtype: str = "float64",
    dense: bool = False,
    lambda_layer: bool = False,
) -> Any:
    """A Keras Sequential model over `features` inputs seen as a 1x4x4 image: convolutions (the
    last, 1x1 over the whole image, gives the class scores) and a Dropout, whose seed generator is
    state too; with `dense`, Dense layers before and after; with `lambda_layer`, the first
    convolution's tanh is a `Lambda` layer of a Python lambda. Keras's matmul computes in float32
    even for float64 tensors on its torch backend (its type promotion maps float64 to float32
    outside TensorFlow), so only a model without Dense layers computes wholly in float64. Keras is
    imported here, by phalanx's import of this function, on its torch backend."""
    import keras

    side = int(features**0.5)
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)  # the model and every layer compute in it
    conv = {"data_format": "channels_first"}
    try:
        return keras.Sequential(
            [
                keras.Input((features,)),
                *([keras.layers.Dense(features, activation="tanh")] if dense else []),
                keras.layers.Reshape((1, side, side)),
                keras.layers.Conv2D(
                    4, 3, padding="same", activation=None if lambda_layer else "tanh", **conv
                ),
                *([keras.layers.Lambda(lambda t: keras.ops.tanh(t))] if lambda_layer else []),
                keras.layers.Dropout(0.0),
                keras.layers.Conv2D(classes, side, **conv),
                keras.layers.Flatten(),
                *([keras.layers.Dense(classes)] if dense else []),
            ]
        )
    finally:
        keras.config.set_dtype_policy(policy)


class Linear(nn.Module):
    """forward(x, y) -> {"prediction", "loss" (per sample)}."""

    def __init__(self, features: int = 3, hidden: int = 0):
        super().__init__()
        self.net = (
            nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
            if hidden
            else nn.Linear(features, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).squeeze(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class Deep(Linear):
    """toy.Linear with `layers` hidden layers: net = Sequential(Linear, Tanh, ..., Linear), whose
    blocks 2, 4, ... start a new layer (where a pipeline may split it)."""

    def __init__(self, features: int = 3, hidden: int = 4, layers: int = 3):
        super().__init__(features)
        blocks: list[nn.Module] = [nn.Linear(features, hidden), nn.Tanh()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(hidden, hidden), nn.Tanh()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, 1))


class Looped(Deep):
    """toy.Deep whose forward calls its blocks one by one (a loop over the Sequential), not the
    Sequential whole: a pipeline stage then runs its blocks from inside the model's own loop."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.net:
            x = block(x)
        prediction = x.squeeze(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class Dropped(Linear):
    """toy.Linear with two dropout layers: net = Sequential(Linear, Tanh, Dropout, Linear, Tanh,
    Dropout, Linear), which a pipeline may split at net.3."""

    def __init__(self, features: int = 3, hidden: int = 8, p: float = 0.3):
        super().__init__(features)
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.Tanh(),
            nn.Dropout(p),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Dropout(p / 2),
            nn.Linear(hidden, 1),
        )


class Tied(Linear):
    """toy.Linear over 4 features through net = Sequential(Linear, Tanh, Linear, Tanh, Linear),
    whose first and last Linear share one weight (tied, as a language model's embedding and
    head)."""

    def __init__(self, features: int = 4):
        super().__init__(features)
        self.net = nn.Sequential(
            nn.Linear(features, features),
            nn.Tanh(),
            nn.Linear(features, features),
            nn.Tanh(),
            nn.Linear(features, features),
        )
        self.net[4].weight = self.net[0].weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).sum(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class Scaled(Linear):
    """toy.Linear with a learned output scale that the model holds itself, drawn in its __init__."""

    def __init__(self, features: int = 3):
        super().__init__(features)
        self.scale = nn.Parameter(torch.rand(1) + 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).squeeze(-1) * self.scale
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class SameName(Linear):
    """toy.Linear whose prediction is the output `y`: the name of the target it is trained on, as a
    rating model returns the `rating` it predicts."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).squeeze(-1)
        return {"y": prediction, "loss": (prediction - y) ** 2}


class Classifier(nn.Module):
    def __init__(self, features: int = 4, classes: int = 3):
        super().__init__()
        self.net = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, y, reduction="none")}


class DigitsMLP(nn.Module):
    """A small MLP on examples.digits' items {"image", "label"}: forward(image, label) -> logits
    and the per-sample loss."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(image)
        return {"logits": logits, "loss": F.cross_entropy(logits, label, reduction="none")}


class DigitsWithIds:
    """examples.digits' streams, each item with its index as "id"."""

    def __init__(self):
        from examples.digits.data import Digits

        self._streams = {name: _WithIds(stream) for name, stream in Digits().streams().items()}

    def streams(self) -> dict[str, Dataset]:
        return self._streams


class _WithIds(Dataset):
    def __init__(self, items: Dataset):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.items[i], "id": i}


class SlowDigitsMLP(DigitsMLP):
    """DigitsMLP whose training forward on rank `rank` takes `seconds` more: a slower device."""

    def __init__(self, hidden: int = 32, rank: int = 1, seconds: float = 0.02):
        import os

        super().__init__(hidden)
        self.slow = int(os.environ.get("RANK", 0)) == rank
        self.seconds = seconds

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and self.slow:
            time.sleep(self.seconds)
        return super().forward(image, label)


def dropout_model() -> dict:
    """A plain nn.Sequential with dropout for toy.Regression: no wrapper class, the batch mapped by
    `inputs`."""
    return {
        "class": "torch.nn.Sequential",
        "args": [
            {"class": "torch.nn.Linear", "in_features": 3, "out_features": 8},
            {"class": "torch.nn.Dropout", "p": 0.3},
            {"class": "torch.nn.Linear", "in_features": 8, "out_features": 1},
            {"class": "torch.nn.Flatten", "start_dim": 0},
        ],
        "inputs": {"x": "input"},
        "outputs": "prediction",
        "loss": {"function": "mse_loss", "output": "prediction", "target": "y"},
    }


def regression_config(**sections: Any) -> dict:
    """A small float64 regression config; keyword sections replace or extend the defaults."""
    cfg = {
        "name": "toy",
        "model": {"class": "toy.Linear", "features": 3},
        "optimizer": {"class": "SGD", "lr": 0.05},
        "dataset": {"class": "toy.Regression", "batch_size": 8},
        "precision": "fp64",
        "main_loop": {"epochs": 2, "extra_streams": ["valid"]},
        "hooks": [{"ComputeStats": {"variables": ["loss"]}}, "LogVariables", "SaveLatest"],
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def contract_config(
    batch: int, accumulation: int, n_train: int, n_valid: int = 10, **parallel: Any
) -> dict:
    """The float64 scenario that strategies are held to one device with: a hidden layer, AdamW with
    a warm-up, two epochs and a validation stream; `parallel` adds to the CPU, one-device
    section."""
    return regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "AdamW", "lr": 0.01, "warmup_steps": 3},
        dataset={
            "class": "toy.Regression",
            "batch_size": batch,
            "n_train": n_train,
            "n_valid": n_valid,
        },
        parallel={
            "accelerator": "cpu",
            "devices": 1,
            "gradient_accumulation": accumulation,
            **parallel,
        },
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )


def write_config(folder: Path, cfg: dict, name: str = "config.yaml") -> Path:
    """Write a config next to a copy of this module, so that `toy.X` class paths import from it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy.py").write_text(Path(__file__).read_text())
    path = folder / name
    path.write_text(yaml.safe_dump({"output_root": str(folder / "runs"), **cfg}, sort_keys=False))
    return path


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> Tanh -> Linear: its gradients depend on the batch statistics."""

    def __init__(self, features: int = 3, hidden: int = 6):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).squeeze(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class SlowRegression(Regression):
    """Regression whose training items take `delay` seconds each to load; with `init_s`, it takes
    that long to build, after writing `ready-<rank>` in the working directory."""

    def __init__(self, delay: float = 0.0, init_s: float = 0.0, **kwargs: Any):
        import os
        import time

        super().__init__(**kwargs)
        if init_s:
            Path(f"ready-{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))
            time.sleep(init_s)
        train = self._streams["train"]
        get = train.__getitem__

        class Delayed(type(train)):
            def __getitem__(self, i: int) -> dict[str, Any]:
                time.sleep(delay)
                return get(i)

        self._streams["train"] = Delayed(train.x, train.y)


class SlowSave(Linear):
    """Linear whose state_dict, read while a checkpoint is written, takes `save_delay` seconds,
    after its first `fast_calls` (a data-parallel start reads it once to broadcast it)."""

    def __init__(self, save_delay: float = 0.0, fast_calls: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.save_delay, self.fast_calls = save_delay, fast_calls

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        import time

        if self.fast_calls > 0:
            self.fast_calls -= 1
        else:
            time.sleep(self.save_delay)
        return super().state_dict(*args, **kwargs)


class OutOfMemoryAbove(Linear):
    """Linear whose training forward raises torch.OutOfMemoryError on rank `rank` alone when given
    more than `rows` samples, from its `after`-th training forward on (a device too small for
    micro-batches larger than `rows`)."""

    def __init__(self, features: int = 3, rows: int = 2, rank: int = 1, after: int = 1):
        super().__init__(features)
        self.rows, self.oom_rank, self.after, self.calls = rows, rank, after, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        import os

        if self.training:
            self.calls += 1
            here = int(os.environ.get("RANK", 0)) == self.oom_rank
            if here and self.calls >= self.after and x.shape[0] > self.rows:
                raise torch.OutOfMemoryError(
                    f"injected: {x.shape[0]} samples on a device that holds {self.rows}"
                )
        return super().forward(x, y)


class FailAt(Linear):
    """Raises on rank `rank` at training step `step` (counting forward calls in training mode).
    Each worker (a process with a RANK) adds its pid and its parent's to the file `record`, if
    given."""

    def __init__(self, features: int = 3, rank: int = 1, step: int = 3, record: str | None = None):
        import os

        super().__init__(features)
        self.fail_rank, self.fail_step, self.calls = rank, step, 0
        if record is not None and "RANK" in os.environ:
            with open(record, "a") as f:
                f.write(f"{os.getpid()} {os.getppid()}\n")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        import os

        if self.training:
            self.calls += 1
            if int(os.environ.get("RANK", 0)) == self.fail_rank and self.calls == self.fail_step:
                raise RuntimeError(
                    f"injected failure on rank {self.fail_rank} at step {self.fail_step}"
                )
        return super().forward(x, y)


class FaultAt(Linear):
    """On rank `rank`, at its `step`-th training forward call of an attempt, SIGKILLs its own
    process (`kind: kill`) or raises (`kind: raise`), on the launcher's attempts in `attempts` (all
    where None); every attempt's start is appended to `record`, if given."""

    def __init__(
        self,
        features: int = 3,
        rank: int = 1,
        step: int = 3,
        kind: str = "kill",
        attempts: list[int] | None = (0,),
        record: str | None = None,
    ):
        import os

        super().__init__(features)
        self.rank, self.step, self.kind, self.calls = rank, step, kind, 0
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        # a worker started alone in place of a dead one (param_server's) is not the one to fail
        first = int(os.environ.get("PHALANX_INCARNATION", 0)) == 0
        self.armed = first and (attempts is None or self.attempt in attempts)
        if record and int(os.environ.get("RANK", 0)) == rank:
            with open(record, "a") as f:
                f.write(f"{self.attempt}\n")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        import os
        import signal

        if self.training and self.armed:
            self.calls += 1
            if int(os.environ.get("RANK", 0)) == self.rank and self.calls == self.step:
                if self.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure on rank {self.rank}, attempt {self.attempt}")
        return super().forward(x, y)


from phalanx.hooks import Hook  # noqa: E402  (the toy hooks below need phalanx; the models above do not)
from phalanx.hooks.base import reads_no_loss  # noqa: E402


class Record(Hook):
    """Keeps every step's global loss and every epoch's data, for comparisons between runs."""

    gathers = False

    def __init__(self):
        self.losses: list[float] = []
        self.epochs: list[dict] = []

    def after_batch(self, stream: str, batch: dict) -> None:
        if self.trainer.training:
            self.losses.append(float(self.trainer.last_loss))

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        self.epochs.append({s: dict(v) for s, v in epoch_data.items()})


class RecordEvery(Hook):
    """Keeps the global loss of every `every`-th step on rank 0 alone (as a hook that prints it
    would), and says so (`reads_loss`): the steps between may be agreed on together."""

    gathers = False

    def __init__(self, every: int):
        self.every = every
        self.losses: dict[int, float] = {}
        self.shown: list[float] = []  # ShowProgress's reading of the epoch's loss, at every step
        self.rounds: list[float] = []  # the epoch's loss at each after_epoch (rank 0's)

    def reads_loss(self, step: int) -> bool:
        return step % self.every == 0

    def after_batch(self, stream: str, batch: dict) -> None:
        run = self.trainer
        if not run.training or run.strategy.rank:
            return
        so_far = run.epoch_loss_so_far
        self.shown.append(float("nan") if so_far is None else float(so_far))
        if run.step % self.every == 0:
            self.losses[run.step] = float(run.last_loss)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if not self.trainer.strategy.rank:
            self.rounds.append(float(self.trainer.epoch_loss))


class EpochLoss(Hook):
    """Keeps each epoch's mean training loss as the trainer gives it at the epoch's end; it reads no
    step's loss, so a strategy that agrees on the loss behind the step is never waited for."""

    gathers = False

    def __init__(self):
        self.means: list[float] = []

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        self.means.append(float(self.trainer.epoch_loss))


class RequestStopAt(Hook):
    """Asks for a graceful stop on rank `rank` alone, after training step `step`: a real SIGTERM to
    itself. It reads no loss (`reads_loss`)."""

    gathers = False
    reads_loss = reads_no_loss

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def after_batch(self, stream: str, batch: dict) -> None:
        if (
            self.trainer.training
            and self.trainer.strategy.rank == self.rank
            and self.trainer.step == self.step
        ):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


class SeenIds(Hook):
    """Records the sample ids of every gathered batch, and the model's predictions where it makes
    them, in the order the hooks see them."""

    gather_keys = ("id", "prediction")

    def __init__(self):
        self.ids: dict[str, list[list[int]]] = {}
        self.predictions: dict[str, list[list[float]]] = {}

    def after_batch(self, stream: str, batch: dict) -> None:
        self.ids.setdefault(stream, []).append(batch["id"].tolist())
        if "prediction" in batch:
            self.predictions.setdefault(stream, []).append(batch["prediction"].tolist())


class _Counted(Items):
    """Items that count, in this process, the training items read so far (`READ`)."""

    READ = [0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        _Counted.READ[0] += 1
        return super().__getitem__(i)


class CountedRegression(Regression):
    """Regression whose training items count their reads in this process (`_Counted.READ`)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        train = self._streams["train"]
        self._streams["train"] = _Counted(train.x, train.y)


class ReadsSeen(Hook):
    """At each training step's after_batch: the training items this process had read by then,
    since training began."""

    gathers = False

    def __init__(self):
        self.reads: list[int] = []
        self._start = 0

    def before_training(self) -> None:
        self._start = _Counted.READ[0]

    def after_batch(self, stream: str, batch: dict) -> None:
        if self.trainer.training:
            self.reads.append(_Counted.READ[0] - self._start)


class ImageRegression:
    """4x6x6 'images' with a scalar target, for the convolution and memory-format tests."""

    def __init__(self, n_train: int = 24, n_valid: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid)):
            x = torch.randn(n, 4, 6, 6, generator=g)
            self._streams[name] = Items(x, x.mean(dim=(1, 2, 3)))

    def streams(self) -> dict[str, Items]:
        return self._streams


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, channels, 3, padding=1),
            nn.Tanh(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(channels, 1),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.net(x).squeeze(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


class Sequences:
    """Token sequences of different lengths, padded to one length: items {"tokens", "labels"}, the
    labels -100 after each sequence's end (and on a few tokens inside it). Vocabulary `vocab`."""

    def __init__(
        self, n_train: int = 37, n_valid: int = 11, length: int = 6, vocab: int = 5, seed: int = 0
    ):
        g = torch.Generator().manual_seed(seed)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid)):
            tokens = torch.randint(vocab, (n, length), generator=g)
            lengths = torch.randint(1, length + 1, (n,), generator=g)
            labels = torch.randint(vocab, (n, length), generator=g)
            labels[torch.arange(length) >= lengths[:, None]] = -100
            labels[
                torch.rand(n, length, generator=g) < 0.1
            ] = -100  # some samples have no real token at all
            self._streams[name] = SequenceItems(tokens, labels)

    def streams(self) -> dict[str, Dataset]:
        return self._streams


class SequenceItems(Dataset):
    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor):
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": self.tokens[i], "labels": self.labels[i], "id": i}


class TinyLM(nn.Module):
    """forward(tokens) -> logits (batch, length, vocab): an embedding, a mix along the sequence, a
    head."""

    def __init__(self, vocab: int = 5, width: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.tanh(self.mix(h.cumsum(dim=1)))
        return self.head(h)


class CumulativeMix(nn.Module):
    """TinyLM's mix along the sequence as a block of its own: tanh(linear(cumsum))."""

    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(h.cumsum(dim=1)))


class ChainLM(nn.Module):
    """forward(tokens) -> logits: an embedding, `blocks` mixes in an nn.Sequential (where a pipeline
    may split it), a head."""

    def __init__(self, vocab: int = 5, width: int = 4, blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(CumulativeMix(width) for _ in range(blocks)))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class WeighingChainLM(ChainLM):
    """ChainLM that weighs its samples itself, as WeighingLM does."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = super().forward(tokens)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        real = (labels != -100).sum(dim=1)
        return {
            "logits": logits,
            "loss": losses.sum(dim=1) / real.clamp(min=1),
            "loss_weight": real,
        }


class WeighingLM(TinyLM):
    """TinyLM that computes its own loss: per sample over its real tokens, with their count as
    `loss_weight` (the protocol a model that weighs its samples follows)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = super().forward(tokens)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # -100: 0
        real = (labels != -100).sum(dim=1)
        return {
            "logits": logits,
            "loss": losses.sum(dim=1) / real.clamp(min=1),
            "loss_weight": real,
        }


class CausalSequences:
    """Hugging Face style causal language-model items, padded: {"input_ids", "attention_mask",
    "labels"} with the labels the inputs themselves, -100 on the padding (the model shifts them)."""

    def __init__(
        self, n_train: int = 21, n_valid: int = 7, length: int = 8, vocab: int = 50, seed: int = 0
    ):
        g = torch.Generator().manual_seed(seed)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid)):
            ids = torch.randint(vocab, (n, length), generator=g)
            lengths = torch.randint(2, length + 1, (n,), generator=g)
            mask = (torch.arange(length) < lengths[:, None]).long()
            self._streams[name] = [
                {
                    "input_ids": ids[i],
                    "attention_mask": mask[i],
                    "labels": torch.where(mask[i] > 0, ids[i], -100),
                    "id": i,
                }
                for i in range(n)
            ]

    def streams(self) -> dict[str, list]:
        return self._streams


class InfAt(Linear):
    """Linear whose loss is infinite on training step `step` (counted in its own forward calls)."""

    def __init__(self, features: int = 3, step: int = 3):
        super().__init__(features)
        self.step, self.calls = step, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x, y)
        if self.training:
            self.calls += 1
            if self.calls == self.step:
                out["loss"] = out["loss"] * float("inf")
        return out


class TextLoss(Linear):
    """Linear whose 'loss' is text."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        return {**super().forward(x, y), "loss": "low"}


class Overwritten(Linear):
    """Linear whose every call writes NaN over the outputs it gave at the call before, as a model
    replayed as CUDA graphs writes each replay's outputs where the last one's were."""

    def __init__(self, features: int = 3):
        super().__init__(features)
        self._given: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self._overwrite()
        out = super().forward(x, y)
        self._given = list(out.values())
        return out

    def _overwrite(self) -> None:
        with torch.no_grad():
            for given in self._given:
                given.fill_(float("nan"))


class StreamItems(torch.utils.data.IterableDataset):
    """A stream of Regression items in an order of its own (shuffled by `set_epoch`), with no
    length. `stateful`: it says where it stands (`state_dict`) and starts there again
    (`load_state_dict`), as Hugging Face's streaming datasets do. Each iteration's first position is
    appended to `log`."""

    def __init__(self, items: Items, stateful: bool = False, log: str | None = None):
        self.items, self.stateful, self.log = items, stateful, log
        self.epoch, self.position, self._start = 0, 0, 0
        if stateful:
            self.state_dict = lambda: {"epoch": self.epoch, "position": self.position}
            self.load_state_dict = self._load

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _load(self, state: dict) -> None:
        self.epoch, self._start = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(
            len(self.items), generator=torch.Generator().manual_seed(100 + self.epoch)
        ).tolist()
        start, self._start = self._start, 0
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.epoch} {start}\n")
        for position in range(start, len(order)):
            self.position = (
                position + 1
            )  # once this item is taken, the next one is where the stream stands
            yield self.items[order[position]]


class IterableRegression(Regression):
    """Regression whose streams are StreamItems (valid and test too)."""

    def __init__(
        self,
        n_train: int = 40,
        n_valid: int = 10,
        stateful: bool = False,
        log: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(n_train=n_train, n_valid=n_valid, **kwargs)
        self._streams = {
            name: StreamItems(items, stateful, log if name == "train" else None)
            for name, items in self._streams.items()
        }


class TupleRegression(Regression):
    """Regression whose streams are TensorDatasets: items (x, y) tuples, named by dataset.keys."""

    def streams(self) -> dict[str, Any]:
        return {
            name: torch.utils.data.TensorDataset(s.x, s.y) for name, s in super().streams().items()
        }


class ListRegression(Regression):
    """Regression whose items are [x, y] lists."""

    def streams(self) -> dict[str, Any]:
        return {
            name: [[s.x[i], s.y[i]] for i in range(len(s))] for name, s in super().streams().items()
        }


class _Noisy(Dataset):
    """Items with noise drawn at read time from torch, numpy and random (augmentation, as a worker
    draws it), and the pid of the process that read them."""

    def __init__(self, items: Items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import os
        import random

        import numpy as np

        item = self.items[i]
        noise = 0.01 * (
            torch.randn(()).item() + float(np.random.standard_normal()) + random.gauss(0, 1)
        )
        return {**item, "x": item["x"] + noise, "pid": os.getpid()}


class NoisyRegression(Regression):
    """toy.Regression whose items are augmented with noise when read."""

    def streams(self) -> dict[str, Dataset]:
        return {name: _Noisy(items) for name, items in self._streams.items()}


class _Batched(Dataset):
    """Items read a batch at a time by __getitems__ (as Hugging Face datasets are), marked
    `batched`."""

    def __init__(self, items: Items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.items[i], "batched": 0}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{**self.items[i], "batched": 1} for i in indices]


class BatchedRegression(Regression):
    """toy.Regression whose streams have a batched read."""

    def streams(self) -> dict[str, Dataset]:
        return {name: _Batched(items) for name, items in self._streams.items()}


class LocalIds(Hook):
    """The training samples this process computed, by epoch (its own part: nothing gathered)."""

    gathers = False

    def __init__(self):
        self.epochs: list[list[int]] = [[]]

    def after_batch(self, stream: str, batch: dict) -> None:
        if self.trainer.training and "id" in batch:
            self.epochs[-1].extend(batch["id"].tolist())

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        self.epochs.append([])


class Tokens:
    """Random token windows, as a language model's: items {"tokens", "targets", "id"} of `length`
    tokens below `vocab`."""

    def __init__(
        self, n_train: int = 37, n_valid: int = 10, length: int = 6, vocab: int = 16, seed: int = 0
    ):
        g = torch.Generator().manual_seed(seed)
        self._streams = {}
        for name, n in (("train", n_train), ("valid", n_valid)):
            tokens = torch.randint(vocab, (n, length + 1), generator=g)
            self._streams[name] = _Windows(tokens[:, :-1], tokens[:, 1:])

    def streams(self) -> dict[str, Dataset]:
        return self._streams


class _Windows(Dataset):
    def __init__(self, tokens: torch.Tensor, targets: torch.Tensor):
        self.tokens, self.targets = tokens, targets

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": self.tokens[i], "targets": self.targets[i], "id": i}


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v and output Linears, a head count and a head
    size, reshaping as Llama's does (the head count, or -1, and head_dim). With `dropout`, the
    attention weights are computed by hand and dropped (a module, as GPT-2's), and the output too.
    """

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.dropout = dropout
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if not self.dropout:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        weights = self.attn_drop(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = weights @ v
        return self.resid_drop(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))


class Attending(nn.Module):
    """forward(tokens, targets) -> {"logits", "loss" (per sequence)}: an embedding, a pre-norm
    attention block and MLP block (fc, GELU, proj), a head; `dropout`: on the attention weights,
    the attention's output and the MLP's hidden features."""

    def __init__(self, vocab: int = 16, width: int = 8, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        # with dropout, between the MLP's two Linears: mlp.3 is the second
        hidden = [nn.GELU(), nn.Dropout(dropout)] if dropout else [nn.GELU()]
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), *hidden, nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(tokens)
        x = x + self.attn(self.ln_1(x))
        logits = self.head(x + self.mlp(self.ln_2(x)))
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
        return {"logits": logits, "loss": loss}


class Operators(TorchDispatchMode):
    """Counts the aten operators run inside it, views left out (they launch nothing): kernels (what
    a GPU would launch) and reads of a tensor's value on the host (`item()`, `bool()`, `float()`:
    on a GPU, each waits for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> int:
        return self.counts["_local_scalar_dense"]

    @property
    def kernels(self) -> int:
        return sum(self.counts.values()) - self.reads
