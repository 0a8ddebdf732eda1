"""What per-sample random streams cost an epoch: the digits example trained with
`per_sample_random=true` (the global generators that items draw from seeded from (seed, epoch,
index) before each item is read, restored after each batch) and `false` (plain PyTorch), alternated
in one process through `phalanx.fit`, the config's hooks less ShowProgress and PlotLines. A hook
reads each epoch's profile (`after_epoch_profile`): the seconds of the epoch's parts.

    .venv/bin/python bench/item_seeding.py          # under a minute; --epochs 3 --repeats 8

Reported: the median epoch (the epochs after each run's first) with and without, their ratio, the
median of each pair of runs' ratio, and the median of the epoch's waits for training batches plus
its evaluation (where the reading is); and keyed reading's own cost per item, timed apart (the
training stream's epoch read through phalanx's loader in this process, with a key and without,
alternated) for the digits items as they are (they draw nothing) and with noise drawn from torch,
or from torch, random and numpy, times the items an epoch reads, as a share of the epoch without
it: the figure without the rest of the epoch's noise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import phalanx  # noqa: E402
from bench.common import machine, measured_source, write_report  # noqa: E402
from examples.digits.data import Digits  # noqa: E402
from phalanx import config, data, loading, seeding  # noqa: E402
from phalanx.hooks import Hook  # noqa: E402

CONFIG = ROOT / "examples" / "digits" / "config.yaml"
# the drawing process of PlotLines and the terminal of ShowProgress add noise, not data loading
LEFT_OUT = ("ShowProgress", "PlotLines")


class Profiles(Hook):
    """Each epoch's profile: seconds by part."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
        self.epochs.append(dict(profile))


def train(epochs: int, per_sample: bool, root: Path) -> list[dict[str, float]]:
    """Each epoch's profile: seconds by part."""
    hooks = [
        h
        for h in config.read(CONFIG)["hooks"]
        if (h if isinstance(h, str) else next(iter(h))) not in LEFT_OUT
    ]
    profiles = Profiles()
    run = phalanx.fit(
        CONFIG,
        overrides=[
            f"main_loop.epochs={epochs}",
            f"output_root={root}",
            "parallel.accelerator=cpu",
            f"per_sample_random={str(per_sample).lower()}",
            f"hooks={json.dumps(hooks)}",
        ],
        hooks=[profiles],
    )
    assert run.code == 0
    return profiles.epochs


class _Augmented(Dataset):
    """Digits items with noise drawn from the generators `draws` names, as augmentation draws."""

    def __init__(self, stream: Dataset, draws: tuple[str, ...]):
        self.stream, self.draws = stream, draws

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, i: int) -> dict:
        item = self.stream[i]
        noise = torch.rand(()).item() if "torch" in self.draws else 0.0
        noise += random.random() if "random" in self.draws else 0.0
        noise += float(np.random.rand()) if "numpy" in self.draws else 0.0
        return {**item, "image": item["image"] + 0.01 * noise}


def per_item_cost(batch: int, draws: tuple[str, ...], rounds: int = 30) -> float:
    """Seconds that keyed reading adds to one digits item whose read draws from `draws`: an epoch
    of the training stream read through phalanx's loader in this process (as with num_workers 0),
    with a key and without, alternated; the difference of the medians, per item."""
    stream = _Augmented(Digits().streams()["train"], draws)
    key = seeding.training_key(0, 1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for keyed in (False, True):
            plan = data.Plan(data.epoch_order(0, 1, len(stream)), batch)
            start = time.perf_counter()
            for _ in loading.loader(stream, plan, key=key if keyed else None):
                pass
            times[keyed].append(time.perf_counter() - start)
    return (statistics.median(times[True]) - statistics.median(times[False])) / len(stream)


DRAWS = {"nothing": (), "torch": ("torch",), "all three": ("torch", "random", "numpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "item_seeding.json"))
    args = parser.parse_args()
    runs: dict[str, list[list[float]]] = {"true": [], "false": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # alternated, the first of each pair swapped each time
            order = ("true", "false") if repeat % 2 else ("false", "true")
            for kind in order:
                runs[kind].append(train(args.epochs, kind == "true", Path(tmp)))
    profiles = {kind: [e for epochs in rs for e in epochs[1:]] for kind, rs in runs.items()}
    later = {kind: [sum(e.values()) for e in epochs] for kind, epochs in profiles.items()}
    median = {kind: statistics.median(epochs) for kind, epochs in later.items()}
    # the epoch's waits for training batches and its evaluation: where the reading is
    reading = {
        kind: statistics.median(e["data"] + e["eval"] for e in epochs)
        for kind, epochs in profiles.items()
    }
    pairs = [
        sum(sum(e.values()) for e in t[1:]) / sum(sum(e.values()) for e in f[1:])
        for t, f in zip(runs["true"], runs["false"], strict=True)
    ]
    cfg = config.validate(config.read(CONFIG))
    streams = Digits().streams()
    items = len(streams["train"]) + sum(len(streams[s]) for s in cfg.main_loop.extra_streams)
    costs = {name: per_item_cost(cfg.dataset.batch_size, draws) for name, draws in DRAWS.items()}
    result = {
        "epoch_s": median,
        "data_and_eval_s": reading,
        "epoch_ratio": median["true"] / median["false"],
        "pair_ratios": pairs,
        "pair_ratio_median": statistics.median(pairs),
        "items_per_epoch": items,
        "seeding_us_per_item": {name: cost * 1e6 for name, cost in costs.items()},
        "seeding_share_of_epoch": {
            name: cost * items / median["false"] for name, cost in costs.items()
        },
    }
    print(
        f"epoch, median of {len(later['true'])}: per_sample_random true "
        f"{median['true'] * 1e3:.1f} ms, false {median['false'] * 1e3:.1f} ms: "
        f"{result['epoch_ratio']:.3f}x (median of the runs' ratios "
        f"{result['pair_ratio_median']:.3f}x, from {min(pairs):.3f} to {max(pairs):.3f}); "
        f"waiting for training batches and evaluating: {reading['true'] * 1e3:.1f} ms against "
        f"{reading['false'] * 1e3:.1f} ms"
    )
    for name, cost in costs.items():
        print(
            f"keyed reading, an epoch read apart, items that draw from {name}: "
            f"{cost * 1e6:.2f} us an item; {items} items an epoch: "
            f"{100 * result['seeding_share_of_epoch'][name]:.2f}% of the epoch"
        )
    write_report(
        {
            "machine": machine(),
            "source": measured_source(),
            "epochs": args.epochs,
            "repeats": args.repeats,
            **result,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
