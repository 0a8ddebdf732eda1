"""Workers that do not wait: `param_server` against `ddp` when one worker is slower than the other.

    .venv/bin/python bench/param_server.py                 # about a minute
    .venv/bin/python bench/param_server.py --hidden 256 --batch 256 --n 8192 --epochs 3

Trains the same MLP on the same Gaussian blobs four ways through `phalanx train`, each process one
CPU thread, and reads the steady samples/s that `LogThroughput` writes (`throughput.json`):

- ddp, 2 processes, the second at half speed: every step waits for it;
- param_server, 1 server and 2 workers, the second at half speed, staleness 2: the fast worker
  claims more of each batch and runs up to 2 updates ahead;
- ddp and param_server at staleness 0 (synchronous) with equal workers: what the servers' round
  trips cost.

Half speed: the slow worker sleeps, after each forward, as long as one forward and backward of its
micro-batch takes on this machine (measured first), as a device half as fast would take. The
targets (issue: param_server): samples/s of param_server at staleness 2 at least 1.3x ddp's with
the slow worker; at staleness 0 with equal workers, a step within 1.3x of ddp's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import make_items  # noqa: E402

FEATURES, CLASSES = 32, 10


class Blobs:
    """Gaussian blobs (a stream `train` of `n` samples), the same in every process."""

    def __init__(self, n: int = 8192):
        self._train = make_items(n, FEATURES, CLASSES)

    def streams(self) -> dict[str, Dataset]:
        return {"train": self._train}


class SlowMLP(nn.Module):
    """An MLP whose training forward on rank `rank` sleeps `seconds` more (0: every rank alike)."""

    def __init__(self, hidden: int = 256, rank: int = 1, seconds: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )
        self.slow = seconds if int(os.environ.get("RANK", 0)) == rank else 0.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and self.slow:
            time.sleep(self.slow)
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, y, reduction="none")}


def micro_batch_seconds(hidden: int, samples: int) -> float:
    """One forward and backward of `samples` on one thread: what the slow worker sleeps more."""
    torch.set_num_threads(1)
    model = SlowMLP(hidden)
    x, y = torch.randn(samples, FEATURES), torch.randint(CLASSES, (samples,))
    runs = []
    for k in range(30):
        start = time.perf_counter()
        model(x, y)["loss"].mean().backward()
        if k >= 5:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def config(args, parallel: dict, seconds: float, folder: Path) -> Path:
    raw = {
        "name": "ps-bench",
        "output_root": str(folder / "runs"),
        "model": {"class": "bench.param_server.SlowMLP", "hidden": args.hidden, "seconds": seconds},
        "optimizer": {"class": "SGD", "lr": 0.05},
        "dataset": {"class": "bench.param_server.Blobs", "batch_size": args.batch, "n": args.n},
        "parallel": {
            "accelerator": "cpu",
            "cpu_threads": 1,
            "gradient_accumulation": args.accumulation,
            **parallel,
        },
        "main_loop": {"epochs": args.epochs, "skip_zeroth_epoch": True},
        "hooks": [{"LogThroughput": {"every_n_steps": 1000, "warmup_steps": 5}}],
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def samples_per_s(path: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("phalanx")), "train", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode:
        raise SystemExit(f"phalanx train {path} failed:\n{done.stdout}\n{done.stderr}")
    (run,) = (path.parent / "runs").iterdir()
    return json.loads((run / "throughput.json").read_text())["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--n", type=int, default=65536, help="training samples")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches a step (param_server: chunks)"
    )
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "param_server.json"))
    args = parser.parse_args()

    slow = micro_batch_seconds(args.hidden, args.batch // (2 * args.accumulation))
    ddp = {"devices": 2, "strategy": "ddp"}

    def served(staleness: int) -> dict:
        return {
            "devices": 3,
            "strategy": "param_server",
            "param_server": {"servers": 1, "staleness": staleness},
        }

    setups = {
        "ddp, one worker at half speed": (ddp, slow),
        "param_server staleness 2, one worker at half speed": (served(2), slow),
        "ddp, equal workers": (ddp, 0.0),
        "param_server staleness 0, equal workers": (served(0), 0.0),
    }
    rates = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-ps-bench-") as tmp:
        for k, (name, (parallel, seconds)) in enumerate(setups.items()):
            rates[name] = samples_per_s(config(args, parallel, seconds, Path(tmp) / str(k)))
            print(f"{name}: {rates[name]:,.0f} samples/s", flush=True)
    names = list(setups)
    uneven = rates[names[1]] / rates[names[0]]
    even = rates[names[2]] / rates[names[3]]  # param_server's step time over ddp's
    share = args.batch // (2 * args.accumulation)
    print(f"the slow worker sleeps {1e3 * slow:.1f} ms a micro-batch of {share}")
    print(f"param_server (staleness 2) / ddp, one worker at half speed: {uneven:.2f}x samples/s")
    print(f"param_server (staleness 0) step time / ddp's, equal workers: {even:.2f}x")
    report = {"args": vars(args), "slow_s": slow, "samples_per_s": rates, "uneven": uneven}
    report["even_step_ratio"] = even
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
