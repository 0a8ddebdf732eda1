"""Per-step overhead of phalanx (and of Lightning and Accelerate, where installed) against a
hand-written PyTorch loop: a tiny MLP on in-memory data, one CPU thread, all loops interleaved chunk
by chunk in one process so that the machine's changes of speed affect each of them alike.

    .venv/bin/python bench/overhead.py                 # 40 epochs of 200 steps, ~1.5-2 min
    .venv/bin/python bench/overhead.py --steps 400 --rounds 25 --out /tmp/overhead.json
    .venv/bin/python bench/overhead.py --breakdown     # where phalanx's extra time goes (A/B)
    .venv/bin/python bench/overhead.py --profile       # cProfile of phalanx's steps alone
    .venv/bin/python bench/overhead.py --tokens 16 --clip 1.0   # token-weighted and clipped
    .venv/bin/python bench/overhead.py --public        # phalanx.fit, every default hook

What is timed (see BENCHMARKS.md): every loop trains its own copy of the same MLP (same init), with
AdamW, on the same dataset object (a map-style dataset of dict items) batched by a torch DataLoader
(shuffled, default collate), and accumulates the loss for logging (`loss.detach()` summed, one
`.item()` per epoch; phalanx does this with its default ComputeStats hook). The loops take turns:
each runs `--chunk` optimizer steps, then hands over; a round is one chunk of each loop. A chunk's
window starts when its loop gets control and ends after its last optimizer step (for phalanx,
after that step's after_batch hooks), so each loop's per-epoch set-up (sampler, DataLoader
iterator) lands in the first chunk of its epoch. phalanx's epoch end (after_epoch hooks:
statistics, log, metrics.csv, TensorBoard flush, the SaveLatest checkpoint) is outside the windows
and reported on its own. Nobody saves a checkpoint inside a window. The first `--warmup` epochs are
not counted.

phalanx runs as `phalanx train` builds it, with the default hooks less ShowProgress (its target:
1.05x); with `--public`, as a user's script runs it: `phalanx.fit` on the config without a `hooks`
key, so every default hook, ShowProgress and the console log included, then the benchmark's
driver (its target: 1.10x).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset, default_collate  # noqa: E402

from bench.common import (  # noqa: E402
    MLP,
    REGISTRY,
    Coroutine,
    against_hand,
    hand_steps,
    machine,
    make_items,
    make_sequences,
    measured_source,
    mlp_model,
    phalanx_trainer,
    print_profile,
    print_results,
    with_epoch_end,
    write_report,
)

clock = time.perf_counter


def now() -> tuple[float, float]:
    """Wall-clock and process CPU time. Only one loop runs at a time (the others wait on a lock),
    so the CPU time of a window is that loop's, less the time the machine gave to other tenants."""
    return time.perf_counter(), time.process_time()


def since(
    start: tuple[float, float], end: tuple[float, float] | None = None
) -> tuple[float, float]:
    end = end or now()
    return end[0] - start[0], end[1] - start[1]


LR = 1e-3
DATA_KEY = "overhead"
FEATURES, CLASSES = 32, 10


# --- 1. the hand-written loop ------------------------------------------------------------------


class HandLoop:
    """What one would write without a framework, run a chunk of steps at a time."""

    name = "hand loop"

    def __init__(self, dataset, args):
        torch.manual_seed(0)
        self.model = MLP(FEATURES, args.hidden, CLASSES)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        # tuple items (--tuples): the hand loop names each batch's two tensors, as one would
        collate = (
            (lambda items: dict(zip(("x", "y"), default_collate(items), strict=True)))
            if args.tuples
            else None
        )
        self.loader = DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate
        )
        self.steps_per_epoch = args.steps
        self.clip = args.clip
        self.epoch_losses: list[float] = []
        self._step, self._batches, self._total = 0, None, None

    def chunk(self, k: int) -> tuple[float, float]:
        """The next `k` steps of the current epoch (starting one where the last ended); returns
        their window (wall, CPU seconds). An epoch's set-up and its loss read-out count in its first
        and last chunks."""
        start = now()
        if self._step == 0:
            self.model.train()
            self._batches, self._total = iter(self.loader), torch.zeros(())
        hand_steps(self.model, self.optimizer, self._batches, k, self._total, self.clip)
        self._step += k
        if self._step == self.steps_per_epoch:
            self.epoch_losses.append(self._total.item() / self._step)
            self._step = 0
        return since(start)


# --- 2. phalanx ---------------------------------------------------------------------------------


def phalanx_config(args, output_root: str) -> dict[str, Any]:
    """The run's config: no `hooks:` key would mean the defaults; they are listed here without
    ShowProgress (a terminal progress bar), everything else as phalanx.hooks.default_hooks has
    it."""
    return {
        "name": "overhead",
        "model": mlp_model(args.hidden, FEATURES, CLASSES),
        "optimizer": {
            "class": "AdamW",
            "lr": LR,
            **({"max_grad_norm": args.clip} if args.clip else {}),
        },
        "dataset": {
            "class": "bench.common.SharedStreams",
            "key": DATA_KEY,
            "batch_size": args.batch_size,
            **({"keys": ["x", "y"]} if args.tuples else {}),
        },
        "parallel": {"accelerator": "cpu"},
        "seed": 0,
        "main_loop": {"epochs": args.warmup + args.rounds},
        "output_root": output_root,
    }


def build_phalanx(args, tmp: Path, driver):
    """A Trainer as `phalanx train` builds one (a validated config, a real run directory, the log
    file), its hooks the defaults minus ShowProgress, then `driver`."""
    return phalanx_trainer(phalanx_config(args, str(tmp / "runs")), tmp, [driver], [ROOT])


def fit_phalanx(args, tmp: Path, driver) -> tuple[Path, dict[str, Any], list[str], float]:
    """phalanx as a user's script runs it: `phalanx.fit` on the config (no `hooks` key: the
    defaults, ShowProgress and the console log included), with `driver` after them. Returns the
    run directory, the config, the hooks' names and the run's seconds."""
    import phalanx
    from phalanx import config
    from phalanx.hooks import default_hooks

    raw = phalanx_config(args, str(tmp / "runs"))
    started = clock()
    run = phalanx.fit(raw, hooks=[driver])
    wall_s = clock() - started
    if run.code != 0:
        raise RuntimeError(f"the phalanx run ended with exit code {run.code}")
    hook_names = [*default_hooks(config.validate(raw)), "Driver"]
    return Path(run.run_dir), raw, hook_names, wall_s


def make_driver_hook(chunk: int, on_chunk):
    """The last hook of the phalanx run: it times phalanx's chunks of `chunk` steps and, after
    each, calls `on_chunk(epoch)`, which runs the other loops' chunks. Its after_batch costs one
    comparison per step. The epoch end (after_epoch hooks) is timed apart, outside the windows."""
    from phalanx.hooks import Hook

    class Driver(Hook):
        gathers = False

        def __init__(self):
            self.start = (0.0, 0.0)
            self.windows: list[tuple[float, float]] = []
            self.window_epochs: list[int] = []
            self.epoch_ends: list[tuple[float, float]] = []

        def before_training(self) -> None:
            self.start = now()

        def after_batch(self, stream: str, batch: dict) -> None:
            trainer = self.trainer
            if trainer.training and trainer.step_in_epoch % chunk == 0:
                self.windows.append(since(self.start))
                self.window_epochs.append(trainer.epoch + 1)
                on_chunk(trainer.epoch + 1)
                self.start = now()

        def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
            self.epoch_ends.append(since(self.start))
            self.start = now()

    return Driver()


# --- 3. Lightning -------------------------------------------------------------------------------


class LightningLoop:
    """Lightning's Trainer.fit in barebones mode (no logger, progress bar, checkpointing, model
    summary, sanity check), driven as a coroutine: a callback hands control back after each chunk
    of steps."""

    name = "Lightning"

    def __init__(self, dataset, args):
        import lightning.pytorch as pl

        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        steps, epochs, chunk = args.steps, args.warmup + args.rounds, args.chunk
        outer = self

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.model = MLP(FEATURES, args.hidden, CLASSES)
                self.acc = {
                    "total": torch.zeros(()),
                    "batches": 0,
                }  # a dict: no nn.Module __setattr__

            def training_step(self, batch, batch_idx):
                loss = F.cross_entropy(self.model(batch["x"]), batch["y"])
                acc = self.acc
                acc["total"] += loss.detach()  # the same logging work as the hand loop
                acc["batches"] += 1
                return loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=LR)

        class Timer(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if (batch_idx + 1) % chunk == 0:
                    outer.windows.append(since(outer.start))
                    if (
                        trainer.current_epoch < epochs - 1 or batch_idx + 1 < steps
                    ):  # not the very last
                        self.pause()
                        outer.start = now()

            def on_train_epoch_end(
                self, trainer, module
            ):  # in the next epoch's first chunk, as set-up is
                acc = module.acc
                outer.epoch_losses.append(acc["total"].item() / acc["batches"])
                acc["total"], acc["batches"] = torch.zeros(()), 0

        self.module, timer = Module(), Timer()
        self.trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=epochs,
            barebones=True,
            callbacks=[timer],
            deterministic=False,
        )
        self.loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
        self.windows: list[tuple[float, float]] = []
        self.epoch_losses: list[float] = []
        self.start = (0.0, 0.0)

        def body(pause):
            timer.pause = pause
            torch.set_num_threads(1)
            self.start = now()  # the first (warm-up) window also holds fit's set-up
            self.trainer.fit(self.module, train_dataloaders=self.loader)

        self.coroutine = Coroutine(body, "lightning")

    def chunk(self, k: int) -> tuple[float, float]:
        self.coroutine.resume()
        return self.windows[-1]

    def close(self) -> None:
        if not self.coroutine.finished:
            raise RuntimeError("Lightning's fit did not end with its last chunk")
        self.coroutine.join()


# --- 4. Accelerate ------------------------------------------------------------------------------


class AccelerateLoop:
    """The hand loop through Accelerate's prepare(), accelerator.backward and its optimizer."""

    name = "Accelerate"

    def __init__(self, dataset, args):
        from accelerate import Accelerator

        torch.manual_seed(0)
        self.accelerator = Accelerator(cpu=True)
        model = MLP(FEATURES, args.hidden, CLASSES)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.steps_per_epoch = args.steps
        self.epoch_losses: list[float] = []
        self._step, self._batches, self._total = 0, None, None

    def chunk(self, k: int) -> tuple[float, float]:
        """As HandLoop.chunk."""
        start = now()
        if self._step == 0:
            self.model.train()
            self._batches, self._total = iter(self.loader), torch.zeros(())
        model, optimizer, accelerator = self.model, self.optimizer, self.accelerator
        batches, total = self._batches, self._total
        for _ in range(k):
            batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
        self._step += k
        if self._step == self.steps_per_epoch:
            self.epoch_losses.append(total.item() / self._step)
            self._step = 0
        return since(start)


# --- the benchmark ------------------------------------------------------------------------------


def optional(name: str, factory, dataset, args, skipped: dict[str, str]):
    try:
        return factory(dataset, args)
    except ImportError as e:
        skipped[name] = f"not importable: {e}"
        return None


def make_dataset(args) -> Any:
    n = args.steps * args.batch_size
    items = (
        make_sequences(n, args.tokens, FEATURES, CLASSES)
        if args.tokens
        else make_items(n, FEATURES, CLASSES)
    )
    return TensorDataset(items.x, items.y) if args.tuples else items


def run(args) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on num_workers and the like
    dataset = make_dataset(args)
    REGISTRY[DATA_KEY] = dataset
    skipped: dict[str, str] = {}
    hand = HandLoop(dataset, args)
    if args.tokens or args.clip or args.tuples:  # the other loops here: dict items, plain objective
        others = []
        skipped.update(
            dict.fromkeys(
                ("Lightning", "Accelerate"),
                "--tokens, --clip and --tuples compare with the hand loop only",
            )
        )
    else:
        others = [
            loop
            for loop in (
                optional("Lightning", LightningLoop, dataset, args, skipped),
                optional("Accelerate", AccelerateLoop, dataset, args, skipped),
            )
            if loop
        ]
    windows: dict[str, list[tuple[float, float]]] = {
        hand.name: [],
        **{loop.name: [] for loop in others},
    }
    total, per_epoch = args.warmup + args.rounds, args.steps // args.chunk

    def chunk_of_others(epoch: int) -> None:
        """Run after each of phalanx's chunks: the same chunk of every other loop, so that a round
        is phalanx, Lightning, Accelerate, hand loop (the hand loop then phalanx again)."""
        for loop in [*others, hand]:
            windows[loop.name].append(loop.chunk(args.chunk))
        if len(driver.windows) % per_epoch == 0:
            shown = [("phalanx", driver.windows), *windows.items()]
            print(
                f"  epoch {epoch}/{total}{' (warm-up)' if epoch <= args.warmup else ''}: "
                + ", ".join(
                    f"{n} {1e3 * sum(x[0] for x in w[-per_epoch:]) / args.steps:.3f}"
                    for n, w in shown
                )
                + " ms/step",
                flush=True,
            )

    driver = make_driver_hook(args.chunk, chunk_of_others)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        if args.public:
            run_dir, raw, hook_names, wall_s = fit_phalanx(args, Path(tmp), driver)
        else:
            trainer, run_dir, raw = build_phalanx(args, Path(tmp), driver)
            hook_names = [type(h).__name__ for h in trainer.hooks]
            print(
                f"phalanx hooks: {', '.join(hook_names)} (Driver: the benchmark's); run directory "
                f"{run_dir}",
                flush=True,
            )
            started = clock()
            code = trainer.run()
            wall_s = clock() - started
            if code != 0:
                raise RuntimeError(f"the phalanx run ended with exit code {code}")
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        from phalanx import logs

        logs.setup(None)  # close log.txt before the folder goes
    for loop in others:
        if hasattr(loop, "close"):
            loop.close()

    n, k = args.warmup * per_epoch, args.chunk
    measured = {"phalanx": driver.windows[n:], **{name: ws[n:] for name, ws in windows.items()}}
    results: dict[str, Any] = {}
    for name in [hand.name, "phalanx", *[loop.name for loop in others]]:
        entry: dict[str, Any] = {}
        for i, kind in enumerate(("wall", "cpu")):
            mine = [w[i] / k for w in measured[name]]
            base = [w[i] / k for w in measured[hand.name]]
            entry[kind] = {
                **against_hand(mine, base),
                "per_chunk_ms_per_step": [round(1e3 * t, 5) for t in mine],
            }
        results[name] = entry
    results["phalanx incl. epoch end"] = with_epoch_end(
        measured["phalanx"],
        measured[hand.name],
        driver.epoch_ends[args.warmup :],
        per_epoch,
        args.steps,
    )
    ratio = results["phalanx"]["wall"]["ratio_vs_hand"]["median"]
    return {
        "benchmark": "overhead_public" if args.public else "overhead",
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "settings": {
            "steps": args.steps,
            "chunk": args.chunk,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "batch_size": args.batch_size,
            "tokens": args.tokens,
            "tuples": args.tuples,
            "clip": args.clip,
            "public": args.public,
            "hidden": args.hidden,
            "features": FEATURES,
            "classes": CLASSES,
            "samples": len(dataset),
            "optimizer": f"AdamW(lr={LR})",
            "threads": torch.get_num_threads(),
        },
        "machine": machine(),
        "phalanx_source": measured_source(),
        "method": "loops interleaved chunk by chunk (a round is one chunk of each loop); ms/step "
        "= median over chunks of (window / chunk); ratio = median over chunks of the paired "
        "ratio to the hand loop's chunk of the same round; ratio_of_totals = all measured "
        "windows added up; windows exclude phalanx's epoch-end hooks (row 'incl. epoch end', "
        "per epoch, adds them); no loop saves a checkpoint inside a window",
        "phalanx_hooks": hook_names,
        "phalanx_checkpoints": checkpoints,
        "phalanx_config": raw,
        "skipped": skipped,
        "target": {
            "phalanx_ratio_max": args.target,
            "phalanx_ratio": ratio,
            "met": ratio <= args.target,
        },
        "results": results,
        "final_epoch_loss": {
            hand.name: hand.epoch_losses[-1],
            **{loop.name: loop.epoch_losses[-1] for loop in others},
        },
        "wall_s": wall_s,
    }


def print_table(report: dict[str, Any]) -> None:
    s, m = report["settings"], report["machine"]
    print(
        f"\n{s['rounds']} epochs of {s['steps']} steps (after {s['warmup']} warm-up), in chunks of "
        f"{s['chunk']} steps, batch {s['batch_size']}, hidden {s['hidden']}, {s['threads']} "
        f"thread; torch {m['torch']}, {m['cpu_count']} CPUs, {m['processor']}"
    )
    print_results(report["results"], 24)
    end = report["results"]["phalanx incl. epoch end"]["epoch_end_ms"]["wall"]
    print(
        "\nms/step: median over chunks; ratio: median of the per-chunk ratios to the hand loop's "
        "chunk of the same round; total: all measured time over the hand loop's.\nphalanx's epoch "
        "end (after_epoch hooks: stats, log, CSV, TensorBoard, SaveLatest checkpoint) took a "
        f"median {end['median']:.1f} ms per epoch; it is outside the windows, and 'incl. epoch "
        "end' (per epoch) adds it to the epoch's steps."
    )
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")
    t = report["target"]
    print(
        f"target: phalanx <= {t['phalanx_ratio_max']:.2f}x the hand loop (wall-clock): "
        f"{'met' if t['met'] else 'NOT met'} ({t['phalanx_ratio']:.3f}x)"
    )


# --- diagnostics: where phalanx's per-step time goes --------------------------------------------


def _steady_phalanx(args, tmp: Path, driver=None):
    from phalanx.hooks import Hook

    return build_phalanx(args, tmp, driver or Hook())[0]


def profile(args) -> None:
    """cProfile of phalanx alone, steady state (the warm-up epochs excluded), sorted by own time."""
    import cProfile

    torch.set_num_threads(1)
    REGISTRY[DATA_KEY] = make_items(args.steps * args.batch_size, FEATURES, CLASSES)
    profiler = cProfile.Profile()

    def on_chunk(epoch: int) -> None:
        if len(driver.windows) == args.warmup * (
            args.steps // args.chunk
        ):  # the warm-up's last chunk
            profiler.enable()

    driver = make_driver_hook(args.chunk, on_chunk)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer, _, _ = build_phalanx(args, Path(tmp), driver)
        trainer.run()
        profiler.disable()
        from phalanx import logs

        logs.setup(None)
    steps = args.rounds * args.steps
    print_profile(
        profiler,
        steps,
        "phalanx steps with the default hooks minus ShowProgress, epoch ends included",
        args.profile_top,
    )


def paired(a, b, n: int, blocks: int) -> tuple[float, float]:
    """Median extra wall time per call of b over a (seconds) and median ratio b/a, over `blocks`
    adjacent pairs of `n` calls each, the order alternating; drift cancels within a pair."""
    diffs, ratios = [], []
    for i in range(blocks):
        times = {}
        for f in (a, b) if i % 2 == 0 else (b, a):
            start = clock()
            f(n)
            times[f] = (clock() - start) / n
        diffs.append(times[b] - times[a])
        ratios.append(times[b] / times[a])
    return statistics.median(diffs), statistics.median(ratios)


def breakdown(args) -> dict[str, Any]:
    """Paired A/B timings of the parts of a phalanx step against their hand-written equivalents,
    on one fixed batch (data excepted). Diagnostic: it reaches into phalanx's internals (Engine,
    Forward, data.Plan/loader, the hooks) as they are now."""
    from phalanx import data as pdata
    from phalanx import loading as ploading
    from phalanx.data import Micro

    torch.set_num_threads(1)
    dataset = make_items(args.steps * args.batch_size, FEATURES, CLASSES)
    REGISTRY[DATA_KEY] = dataset
    B, blocks, n = args.batch_size, args.blocks, 40
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer = _steady_phalanx(args, Path(tmp))
        trainer.begin_training()  # opens the TensorBoard writer, as run() would
        train_step, module, optimizer, forward = (
            trainer.train_step,
            trainer.module,
            trainer.optimizer,
            trainer.forward,
        )
        hand = HandLoop(dataset, args)
        model, hand_opt = hand.model, hand.optimizer
        batch = next(iter(hand.loader))
        x, y = batch["x"], batch["y"]
        micros = [(Micro(list(range(B)), B), batch)]
        stats_hook = next(h for h in trainer.hooks if type(h).__name__ == "ComputeStats")
        result = trainer.train_step(micros)
        from phalanx.engine import concat

        trainer.losses.add(result.loss, result.settle)
        payload = result.parts
        out = concat(result.parts)
        per_sample = torch.full(
            (B,), 1 / B
        )  # what the engine back-propagates into each sample's loss

        def steps(opt, loss_of, gradient=None, before=None):
            """`k` optimizer steps of a hand-written variant: `loss_of()` is back-propagated."""

            def run_steps(k):
                for _ in range(k):
                    if before is not None:
                        before()
                    opt.zero_grad(set_to_none=True)
                    loss_of().backward(gradient)
                    opt.step()

            return run_steps

        hand_step = steps(hand_opt, lambda: F.cross_entropy(model(x), y))
        hand_step_phalanx_model = steps(optimizer, lambda: F.cross_entropy(module(x), y))
        hand_step_train = steps(hand_opt, lambda: F.cross_entropy(model(x), y), before=model.train)
        per_sample_loss = steps(
            optimizer, lambda: F.cross_entropy(module(x), y, reduction="none"), per_sample
        )
        forward_wrapper = steps(optimizer, lambda: forward(batch)["loss"], per_sample)

        def engine_step(k):
            for _ in range(k):
                train_step(micros)

        def engine_step_no_train(k):
            module.train = lambda mode=True: module  # instance attribute: skips nn.Module.train
            try:
                engine_step(k)
            finally:
                del module.train

        def hand_accumulate(k):
            total = torch.zeros(())
            for _ in range(k):
                total += trainer.last_loss.detach()

        def stats_after_batch(k):
            for _ in range(k):
                stats_hook.after_batch("train", out)

        def all_after_batch(k):
            for i in range(k):
                trainer.step = i  # WriteTensorBoard writes every 50th step, as in a run
                trainer.call_after_batch("train", payload, training=True)

        def hand_epoch(k):
            for _ in range(k):
                for _ in hand.loader:
                    pass

        # In situ: whole epochs of the real loop (Trainer.train_epoch) against hand-loop epochs. No
        # run directory, so the writers and SaveLatest do nothing at the epoch end; ComputeStats
        # runs.
        from phalanx.trainer import Trainer

        bare = Trainer(trainer.cfg, None, [ROOT], hooks=[])
        hooked = Trainer(trainer.cfg, None, [ROOT])
        hooked.begin_training()

        def hand_epochs(k):
            for _ in range(k):
                hand.chunk(args.steps)  # a whole epoch

        def bare_epochs(k):
            for _ in range(k):
                bare.train_epoch()

        def hooked_epochs(k):
            for _ in range(k):
                hooked.train_epoch()

        stream, epoch = pdata.get_stream(trainer.dataset, "train"), [0]

        def phalanx_epoch(k):
            for _ in range(k):
                epoch[0] += 1
                plan = pdata.Plan(pdata.permutation(0, epoch[0], len(stream)), B)
                batches = iter(ploading.loader(stream, plan))
                for _, ms in plan.steps():
                    [(m, next(batches)) for m in ms]

        rows = [
            (
                "in situ: Trainer epoch, no hooks, vs hand-loop epoch",
                hand_epochs,
                bare_epochs,
                1,
                args.steps,
            ),
            (
                "in situ: Trainer epoch, default hooks (no run dir)",
                hand_epochs,
                hooked_epochs,
                1,
                args.steps,
            ),
            (
                "noise floor: the same hand step on two model copies",
                hand_step,
                hand_step_phalanx_model,
                n,
                1,
            ),
            ("whole Trainer.train_step vs hand step (fixed batch)", hand_step, engine_step, n, 1),
            ("  module.train() on every step", hand_step, hand_step_train, n, 1),
            (
                "  per-sample loss: CE(none).backward(1/B each) vs CE(mean)",
                hand_step_phalanx_model,
                per_sample_loss,
                n,
                1,
            ),
            (
                "  Forward wrapper (inputs/outputs/loss mapping)",
                per_sample_loss,
                forward_wrapper,
                n,
                1,
            ),
            (
                "  rest of Engine (output dict, detach, time split)",
                forward_wrapper,
                engine_step_no_train,
                n,
                1,
            ),
            (
                "ComputeStats.after_batch vs total += loss.detach()",
                hand_accumulate,
                stats_after_batch,
                400,
                1,
            ),
            (
                "all after_batch hooks vs total += loss.detach()",
                hand_accumulate,
                all_after_batch,
                400,
                1,
            ),
            (
                "data: phalanx Plan+loader vs DataLoader(shuffle)",
                hand_epoch,
                phalanx_epoch,
                1,
                args.steps,
            ),
        ]
        print(
            f"paired A/B wall-clock, {blocks} alternating pairs per row ({max(6, blocks // 3)} of "
            f"whole epochs), batch {B}, hidden {args.hidden}, 1 thread"
        )
        print(f"{'':54}{'extra us/step':>14}{'ratio':>8}")
        found = {}
        for label, a, b, k, per in rows:
            extra, ratio = paired(
                a, b, k, blocks if per == 1 else max(6, blocks // 3)
            )  # epochs: fewer pairs
            found[label.strip()] = {"extra_us_per_step": 1e6 * extra / per, "ratio": ratio}
            print(f"{label:<54}{1e6 * extra / per:>14.1f}{ratio:>8.3f}", flush=True)
        trainer.end_training()
        from phalanx import logs

        logs.setup(None)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per epoch")
    parser.add_argument(
        "--chunk",
        type=int,
        default=20,
        help="steps each loop runs before the next takes over (a divisor of --steps)",
    )
    parser.add_argument("--rounds", type=int, default=40, help="measured epochs (of every loop)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted epochs first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="phalanx's allowed ratio to the hand loop (1.05; with --public 1.10)",
    )
    parser.add_argument(
        "--public",
        action="store_true",
        help="phalanx through phalanx.fit with every default hook (ShowProgress too)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="samples are padded sequences of this many tokens (token-weighted loss); 0: classes",
    )
    parser.add_argument(
        "--clip", type=float, default=None, help="clip the gradient norm to this (both loops)"
    )
    parser.add_argument(
        "--tuples",
        action="store_true",
        help="items are (x, y) tuples of a TensorDataset, named by dataset.keys (both loops)",
    )
    parser.add_argument(
        "--out", default=None, help="the JSON (bench/results/overhead.json, overhead_public.json)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="instead: cProfile phalanx alone (no JSON)"
    )
    parser.add_argument("--profile-top", type=int, default=30, help="rows of the profile")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: paired A/B timings of the parts of a phalanx step (no JSON)",
    )
    parser.add_argument("--blocks", type=int, default=40, help="A/B pairs per --breakdown row")
    args = parser.parse_args(argv)
    if args.target is None:
        args.target = 1.10 if args.public else 1.05
    if args.out is None:
        name = "overhead_public.json" if args.public else "overhead.json"
        args.out = str(ROOT / "bench" / "results" / name)
    if args.public and (args.profile or args.breakdown):
        parser.error(
            "--public times phalanx.fit; --profile and --breakdown time the trainer's parts"
        )
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        parser.error("--steps, --rounds and --warmup must be at least 1")
    if args.chunk < 1 or args.steps % args.chunk:
        parser.error(f"--chunk must divide --steps ({args.steps}); got {args.chunk}")
    if args.profile:
        profile(args)
        return 0
    if args.breakdown:
        breakdown(args)
        return 0
    report = run(args)
    print_table(report)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
