"""The digits example trained from Python: the config's settings, with the model and the data built
here and given to phalanx.fit as objects; then the best checkpoint evaluated and loaded back.

    .venv/bin/python examples/digits/fit.py              # about 15 s on a 2-core CPU
    .venv/bin/python examples/digits/fit.py --epochs 3 --channels 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(
    0, str(HERE.parents[1])
)  # the repository root: `examples.digits` imports from any folder

import phalanx  # noqa: E402
from examples.digits.data import Digits  # noqa: E402
from examples.digits.net import Net  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--channels", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)  # the weights phalanx would draw for the config's seed
    run = phalanx.fit(
        HERE / "config.yaml",
        overrides=[f"main_loop.epochs={args.epochs}", f"scheduler.T_max={args.epochs}"],
        model=Net(channels=args.channels),
        dataset=Digits(),
    )
    print(f"{run.status}: valid accuracy {run.metrics['valid.accuracy']:.4f} in {run.run_dir}")

    test = phalanx.evaluate(
        run.run_dir, "test", model=Net(channels=args.channels), dataset=Digits()
    )
    print(f"best checkpoint on the test stream: accuracy {test['accuracy']:.4f}")

    model = phalanx.load(
        run.run_dir, model=Net(channels=args.channels)
    )  # the best weights, on the CPU
    image = Digits().streams()["test"][0]["image"]
    with torch.no_grad():
        logits = model(image=image.unsqueeze(0), label=torch.tensor([0]))["logits"]
    print(f"the first test image is a {int(logits.argmax())}")


if __name__ == "__main__":
    main()
