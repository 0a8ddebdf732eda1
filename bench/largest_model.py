"""The largest GPT decoder (examples/gpt/model.py) that trains on one GPU, three ways, through
`phalanx train` as a user runs it:

- plain: `strategy: single`, bf16 autocast over float32 parameters, AdamW, the model built on the
  GPU (`parallel.build: device`: no host copy, its values drawn there, so a trial of billions of
  parameters starts in seconds);
- checkpointed: the same, with `activation_checkpointing: [Block]`;
- fsdp-offload: `strategy: fsdp` on the one device (a group of one process), `offload: true` (the
  parameters, gradients and AdamW's moments in CPU memory, each block gathered onto the GPU while it
  runs), `init: meta` (the model is never whole in one place before it is sharded), and activation
  checkpointing.

    python bench/largest_model.py                          # every mode; minutes per mode on an H100
    python bench/largest_model.py --mode plain --start 16  # one mode, searched from 16 layers up
    python bench/largest_model.py --smoke                  # tiny widths on the CPU: a check

For a mode, the search trains `--steps` optimizer steps at a number of layers (a fresh process each
time, so that no allocator state carries over), doubles the layers until a trial runs out of
memory (the GPU's, or the host's: the process killed), then halves the gap until it is one layer.
A trial that fails for any other reason stops the search with its output. Each trial's parameters
are counted on the meta device. The bound is the device's memory over 16 bytes per parameter (the
float32 value, its gradient and AdamW's two moments): 80 GB / 16 B = 5.0 B parameters on an H100.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import machine, measured_source, write_report  # noqa: E402

CHECKPOINTED = {"activation_checkpointing": ["Block"]}
ON_THE_DEVICE = {"parallel": {"build": "device"}}
MODES: dict[str, dict[str, Any]] = {
    "plain": ON_THE_DEVICE,
    "checkpointed": {**CHECKPOINTED, **ON_THE_DEVICE},
    "fsdp-offload": {
        **CHECKPOINTED,
        "parallel": {
            "strategy": "fsdp",
            "fsdp": {"offload": True, "init": "meta", "shard": ["Block"]},
        },
    },
}
OUT_OF_MEMORY = ("out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


def model_section(args, layers: int) -> dict[str, Any]:
    return {
        "class": "examples.gpt.model.GPT",
        "vocab_size": 256,
        "block_size": args.seq_len,
        "n_layer": layers,
        "n_head": max(1, args.width // 128),
        "n_embd": args.width,
        "dropout": 0.0,
        "bias": False,
    }


def config(args, mode: str, layers: int, root: Path) -> dict[str, Any]:
    extra = MODES[mode]
    tokens = (
        2 * args.seq_len * args.batch_size * (args.steps + 1)
    )  # the train stream's windows and a few for valid
    return {
        "name": f"largest-{mode}-{layers}",
        "output_root": str(root),
        "model": model_section(args, layers),
        "optimizer": {"class": "AdamW", "lr": 1e-4},
        "dataset": {
            "class": "examples.gpt.data.StdlibBytes",
            "block_size": args.seq_len,
            "max_bytes": tokens,
            "valid_fraction": 0.1,
            "batch_size": args.batch_size,
            "num_workers": 0,
        },
        "precision": args.precision,
        "parallel": {"accelerator": args.device, "devices": 1, **extra.get("parallel", {})},
        "activation_checkpointing": extra.get("activation_checkpointing", []),
        "main_loop": {"epochs": 1, "extra_streams": []},
        "hooks": [{"StopAfter": {"steps": args.steps}}],
    }


def parameters(args, layers: int) -> int:
    """The decoder's parameters at `layers`, counted on the meta device (the tied head once)."""
    from examples.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(**{k: v for k, v in model_section(args, layers).items() if k != "class"})
    return sum(p.numel() for p in model.parameters())


def trial(args, mode: str, layers: int) -> dict[str, Any]:
    """Train at `layers` in a fresh `phalanx train`; whether it fit, and why not."""
    with tempfile.TemporaryDirectory(prefix="phalanx-largest-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(
            yaml.safe_dump(config(args, mode, layers, Path(tmp) / "runs"), sort_keys=False)
        )
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "phalanx.cli", "train", str(path)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=args.trial_timeout,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
                    ),
                },
            )
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            code, text = None, f"no result in {args.trial_timeout} s"
    seconds = time.perf_counter() - started
    memory = any(marker in text for marker in OUT_OF_MEMORY) or code in (
        -9,
        137,
    )  # the host's: killed
    result = {
        "layers": layers,
        "parameters": parameters(args, layers),
        "fits": code == 0,
        "seconds": round(seconds, 1),
    }
    if code != 0:
        result["why"] = "out of memory" if memory else f"exit {code}"
        result["output_tail"] = text[-2000:]
    print(
        f"  {mode}: {layers} layers, {result['parameters'] / 1e9:.3f} B parameters: "
        f"{'fits' if result['fits'] else result['why']} ({seconds:.0f} s)",
        flush=True,
    )
    return result


def search(args, mode: str) -> dict[str, Any]:
    trials, fits, fails = [], 0, None
    layers = args.start
    while fails is None and layers <= args.max_layers:  # doubling until a trial does not fit
        trials.append(trial(args, mode, layers))
        if trials[-1]["fits"]:
            fits, layers = layers, layers * 2
        elif trials[-1]["why"] == "out of memory":
            fails = layers
        else:
            raise SystemExit(
                f"{mode} at {layers} layers failed for another reason than memory:\n"
                f"{trials[-1]['output_tail']}"
            )
    if fails is None and fits < args.max_layers:
        layers = args.max_layers
        trials.append(trial(args, mode, layers))
        fits, fails = (layers, None) if trials[-1]["fits"] else (fits, layers)
    while fails is not None and fails - fits > 1:  # halving the gap
        middle = (fits + fails) // 2
        trials.append(trial(args, mode, middle))
        if trials[-1]["fits"]:
            fits = middle
        elif trials[-1]["why"] == "out of memory":
            fails = middle
        else:
            raise SystemExit(
                f"{mode} at {middle} layers failed for another reason than memory:\n"
                f"{trials[-1]['output_tail']}"
            )
    return {
        "largest_layers": fits,
        "largest_parameters": parameters(args, fits) if fits else 0,
        "first_that_does_not_fit": fails,
        "capped_at_max_layers": fails is None,
        "trials": trials,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all")
    parser.add_argument("--width", type=int, default=None, help="n_embd (default 4096; smoke 64)")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="block size (default 1024; smoke 32)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="sequences per step (default 8; smoke 4)"
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trial")
    parser.add_argument(
        "--start", type=int, default=None, help="layers of the first trial (default 8; smoke 1)"
    )
    parser.add_argument(
        "--max-layers", type=int, default=None, help="no trial beyond (default 256; smoke 2)"
    )
    parser.add_argument("--trial-timeout", type=float, default=900)
    parser.add_argument("--smoke", action="store_true", help="tiny, float32, on the CPU")
    parser.add_argument(
        "--out", default=None, help="the JSON report (default bench/results/largest_model.json)"
    )
    args = parser.parse_args(argv)
    small = args.smoke
    args.width = args.width or (64 if small else 4096)
    args.seq_len = args.seq_len or (32 if small else 1024)
    args.batch_size = args.batch_size or (4 if small else 8)
    args.start = args.start or (1 if small else 8)
    args.max_layers = args.max_layers or (2 if small else 256)
    args.device = "cpu" if small else "cuda"
    args.precision = "fp32" if small else "bf16"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; --smoke runs tiny models on the CPU")
    memory = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    bound = memory / 16 if memory else None
    modes = list(MODES) if args.mode == "all" else [args.mode]
    report: dict[str, Any] = {
        "benchmark": "largest_model",
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(),
        "phalanx_source": measured_source(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "device_memory_bytes": memory,
        "bound_parameters": bound,
        "modes": {},
    }
    for mode in modes:
        print(f"{mode}:", flush=True)
        found = search(args, mode)
        if bound:
            found["fraction_of_bound"] = found["largest_parameters"] / bound
        report["modes"][mode] = found
    print("\nmode            layers   parameters   of the bound")
    for mode, found in report["modes"].items():
        share = f"{found['fraction_of_bound']:.2f}" if "fraction_of_bound" in found else "-"
        capped = " (the cap: --max-layers)" if found["capped_at_max_layers"] else ""
        print(
            f"{mode:<15}{found['largest_layers']:>7}   {found['largest_parameters'] / 1e9:>8.3f} B "
            f"  {share}{capped}"
        )
    out = Path(
        args.out
        or ROOT
        / "bench"
        / "results"
        / ("largest_model_smoke.json" if small else "largest_model.json")
    )
    write_report(report, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
