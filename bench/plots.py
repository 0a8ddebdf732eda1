"""What PlotLines costs an epoch: the digits example trained with its hooks, and with the same
hooks less PlotLines, through `phalanx.fit`, in one process. A hook reads each epoch's profile
(`after_epoch_profile`): the seconds of the epoch's parts and of its `after_epoch` hooks.

    .venv/bin/python bench/plots.py              # about a minute; --epochs 8 --repeats 2

Reported per epoch (the first, which starts the drawing process, apart from the others): the
`after_epoch` seconds and the epoch's seconds, with and without PlotLines, and PlotLines' share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import phalanx  # noqa: E402
from bench.common import machine, measured_source, write_report  # noqa: E402
from phalanx import config  # noqa: E402
from phalanx.hooks import Hook  # noqa: E402

CONFIG = ROOT / "examples" / "digits" / "config.yaml"


class Profiles(Hook):
    """Each epoch's profile: seconds by part, `after_epoch` among them."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
        self.epochs.append(dict(profile))


def train(epochs: int, plots: bool, root: Path) -> list[dict[str, float]]:
    hooks = [h for h in config.read(CONFIG)["hooks"] if h != "ShowProgress"]
    if not plots:
        hooks = [h for h in hooks if not (isinstance(h, dict) and "PlotLines" in h)]
    profiles = Profiles()
    run = phalanx.fit(
        CONFIG,
        overrides=[
            f"main_loop.epochs={epochs}",
            f"output_root={root}",
            "parallel.accelerator=cpu",
            f"hooks={json.dumps(hooks)}",
        ],
        hooks=[profiles],
    )
    assert run.code == 0 and (run.run_dir / "plots").is_dir() == plots
    return profiles.epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "plots.json"))
    args = parser.parse_args()
    runs = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternated, so that drift on a shared machine touches both
            for kind in ("without", "with"):
                runs[kind].append(train(args.epochs, kind == "with", Path(tmp)))
    result = {}
    for kind, repeats in runs.items():
        later = [e for epochs in repeats for e in epochs[1:]]
        first = [epochs[0] for epochs in repeats]
        result[kind] = {
            "after_epoch_s": statistics.median(e["after_epoch"] for e in later),
            "epoch_s": statistics.median(sum(e.values()) for e in later),
            "first_after_epoch_s": statistics.median(e["after_epoch"] for e in first),
            "parts_s": {part: statistics.median(e[part] for e in later) for part in later[0]},
        }
    with_, without = result["with"], result["without"]
    result["plotlines_share_of_epoch"] = (with_["epoch_s"] - without["epoch_s"]) / with_["epoch_s"]
    result["epoch_ratio"] = with_["epoch_s"] / without["epoch_s"]
    for kind in ("without", "with"):
        r = result[kind]
        print(
            f"{kind:8s} PlotLines: after_epoch {r['after_epoch_s'] * 1e3:7.1f} ms, epoch "
            f"{r['epoch_s'] * 1e3:7.1f} ms (first epoch's after_epoch "
            f"{r['first_after_epoch_s'] * 1e3:.1f} ms); "
            + ", ".join(f"{part} {seconds * 1e3:.0f}" for part, seconds in r["parts_s"].items())
        )
    print(
        f"epoch with / without PlotLines: {result['epoch_ratio']:.3f}x; PlotLines' share of an "
        f"epoch {100 * result['plotlines_share_of_epoch']:.1f}%"
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
