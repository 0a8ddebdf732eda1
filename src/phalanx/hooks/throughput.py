"""LogThroughput: samples/s, tokens/s, MFU, memory and GPU utilisation, live and per epoch."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from phalanx import metrics
from phalanx.files import write_text_atomic
from phalanx.hooks.base import Hook, reads_no_loss
from phalanx.hooks.variables import check_positive
from phalanx.model import Forward, shard_loss_mean

log = logging.getLogger("phalanx")
# what an epoch's figures may hold
_FIGURES = ("samples_per_s", "tokens_per_s", "mfu", "memory_gib", "memory_peak_gib")


class LogThroughput(Hook):
    """Every `every_n_steps` training steps, log samples/s (tokens/s when the batch holds a token
    sequence under `tokens_key`), MFU (with a known `peak_flops` per device), memory and GPU use.
    After each epoch, put the epoch's figures into `epoch_data["train"]` (`samples_per_s`,
    `tokens_per_s`, `mfu`, `memory_peak_gib`) for the hooks listed after it, and at the end write
    `throughput.json` with the steady-state figures (the first `warmup_steps` steps left out). The
    bytes of parameters, gradients and optimizer state that a process holds (its shards under fsdp)
    are logged once and written there too (`state_bytes`).
    """

    reads_loss = reads_no_loss

    # reads the trainer's global batch size; times its own steps
    gathers = False

    def __init__(
        self,
        every_n_steps: int = 50,
        tokens_key: str | None = "tokens",
        peak_flops: float | None = None,
        warmup_steps: int = 5,
        clock=time.perf_counter,
    ):
        check_positive("LogThroughput", every_n_steps=every_n_steps, peak_flops=peak_flops)
        self.every, self.tokens_key, self.warmup = every_n_steps, tokens_key, warmup_steps
        self.peak_override, self.clock = peak_flops, clock
        self.flops_per_sample: float | None = None
        self.tokens_per_sample = 0
        self._last: float | None = None
        # seconds and samples of the steps timed so far, and where the log line's window, the
        # epoch and the steady state (after the warm-up) began in them
        self._seconds, self._samples = 0.0, 0
        self._window = self._epoch = (0.0, 0)
        self._steady: tuple[float, int] | None = None
        self._steps = 0
        self._counted = False
        self._state_logged = False

    @property
    def devices(self) -> int:
        """The devices the run trains on: every process's (towers drive several from one)."""
        strategy = self.trainer.strategy
        return strategy.world_size * len(strategy.devices)

    @property
    def peak(self) -> float | None:
        per_device = self.peak_override or metrics.peak_flops(self.trainer.strategy.device)
        return per_device * self.devices if per_device else None

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        if not self.trainer.training:
            return
        if not self._counted:
            self._count(batch)
        now = self.clock()
        last, self._last = self._last, now
        if last is not None:
            if self._steady is None and self._steps >= self.warmup:
                self._steady = (self._seconds, self._samples)
            self._seconds += now - last
            self._samples += self.trainer.last_batch_size
        self._steps += 1
        if self._steps % self.every == 0 and self._seconds > self._window[0]:
            self._log_window()

    def _since(self, start: tuple[float, int]) -> tuple[float, int]:
        """Seconds and samples timed since `start`."""
        return self._seconds - start[0], self._samples - start[1]

    def _count(self, batch: dict[str, Any]) -> None:
        """FLOPs per sample, and tokens per sample, from the first training batch of this process
        (or, where it runs part of the model and sees no batch, as a pipeline's first stages, its
        share of the global batch). They are counted on the dataset's samples, not on the batch
        seen here, where an output may have taken the place of an input of its name; on the whole
        model, which a strategy may hold only part of in each process."""
        self._counted = True
        trainer = self.trainer
        strategy = trainer.strategy
        n = next(
            (v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()),
            -(-trainer.last_batch_size // strategy.data_world_size),
        )
        if not n:
            return
        inputs = dict(trainer.first_samples(n))
        n = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor)), 0)
        tokens = inputs.get(self.tokens_key) if self.tokens_key else None
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            self.tokens_per_sample = int(tokens.shape[1])
        if not n:
            return
        module = strategy.whole_model() or trainer.model

        def step(meta_module: torch.nn.Module, meta_batch: Mapping) -> torch.Tensor:
            outputs = Forward(meta_module, trainer.cfg.model, trainer.search_dirs)(meta_batch)
            return shard_loss_mean(outputs["loss"], n)

        # one warning for the job: every process would fail alike
        flops = metrics.training_flops(module, step, inputs, warn=strategy.is_main)
        self.flops_per_sample = flops / n if flops else None

    def _figures(self, seconds: float, samples: float) -> dict[str, float]:
        rate = samples / seconds
        out = {"samples_per_s": rate}
        if self.tokens_per_sample:
            out["tokens_per_s"] = rate * self.tokens_per_sample
        if self.flops_per_sample and self.peak:
            out["mfu"] = self.flops_per_sample * rate / self.peak
        out.update(metrics.memory(*self.trainer.strategy.devices))
        return out

    def _log_window(self) -> None:
        device = self.trainer.strategy.device
        for each in set(self.trainer.strategy.devices):
            if each.type == "cuda":
                torch.cuda.synchronize(each)
        figures = self._figures(*self._since(self._window))
        self._window = (self._seconds, self._samples)
        if not self.trainer.strategy.is_main:
            return
        utilization = metrics.gpu_utilization(device)
        parts = [f"{figures['samples_per_s']:,.0f} samples/s"]
        if "tokens_per_s" in figures:
            parts.append(f"{figures['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in figures:
            parts.append(f"MFU {100 * figures['mfu']:.1f}%")
        parts.append(f"peak memory {figures['memory_peak_gib']:.2f} GiB")
        if utilization is not None:
            parts.append(f"GPU {utilization:.0f}%")
        # once the optimizer has taken a step, and made its state
        if not self._state_logged:
            self._state_logged = True
            state = self.trainer.state_bytes()
            log.info(
                "model state held by the main process: %s "
                "(parameters %s, gradients %s, optimizer %s)",
                _mib(sum(state.values())),
                *(_mib(state[k]) for k in ("parameters", "gradients", "optimizer")),
            )
        log.info("step %d | %s", self.trainer.step, ", ".join(parts))

    def computes(self, stream: str) -> tuple[str, ...]:
        # those it can give: tokens and MFU where known, memory as the devices report it
        return _FIGURES if stream == "train" else ()

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        # evaluation time between epochs is not training time
        self._last = None
        seconds, samples = self._since(self._epoch)
        if seconds > 0:
            epoch_data.setdefault("train", {}).update(self._figures(seconds, samples))
        self._epoch = (self._seconds, self._samples)

    def summary(self) -> dict[str, Any]:
        """Steady-state figures of the whole run (after the warm-up steps)."""
        seconds, samples = self._since(self._steady) if self._steady is not None else (0.0, 0)
        if seconds <= 0:  # a run no longer than its warm-up: the last epoch's steps
            seconds, samples = self._since(self._epoch)
        out = {
            "devices": self.devices,
            "steps": self._steps,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops": self.peak,
            "profile": dict(self.trainer.profile),
            "state_bytes": self.trainer.state_bytes(),
        }
        strategy = self.trainer.strategy
        if strategy.device.type == "cpu":  # what the main process computed with
            out["cpu_threads"] = torch.get_num_threads()
        sampled = strategy.backward_communication()
        # inside forward_backward: the reduction that overlaps backward
        if sampled is not None:
            out["backward_communication_s"] = {"per_step": sampled[0], "hidden": sampled[1]}
        if seconds > 0:
            out.update(self._figures(seconds, samples))
        return out

    def after_training(self, success: bool) -> None:
        if self.trainer.strategy.is_main and self.trainer.run_dir is not None:
            write_text_atomic(
                self.trainer.run_dir / "throughput.json", json.dumps(self.summary(), indent=1)
            )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
