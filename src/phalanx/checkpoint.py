"""Checkpoints: one logical format, written atomically, checked before they are trusted.

`checkpoints/step-<N>/` holds `model.safetensors` (weights), `optimizer.pt` (optimizer, scheduler
and loss-scaler state, read only with `weights_only=True`), `trainer.json` (epoch, step, sampler
cursor, every RNG, hook state) and `manifest.json` (sizes and SHA-256 of the others), written last.
A step is built in a temporary folder, fsynced and renamed into place: a step without a manifest
does not exist, and an interrupted save leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from phalanx.errors import CheckpointError
from phalanx.files import fsync_dir, fsync_file, write_text_atomic, writing

log = logging.getLogger("phalanx")

FORMAT = 1
WEIGHTS, OPTIMIZER, TRAINER, MANIFEST = "model.safetensors", "optimizer.pt", "trainer.json", "manifest.json"
_in_progress: set[Path] = set()


def abort_in_progress() -> None:
    """Remove half-written checkpoint folders (on a second signal, before exiting at once)."""
    for path in list(_in_progress):
        shutil.rmtree(path, ignore_errors=True)


class Checkpoints:
    """The checkpoints of one run: save, verify, find the latest valid, keep the last K and the best."""

    def __init__(self, root: Path, keep_last: int = 3):
        self.root, self.keep_last = Path(root), keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def steps(self) -> list[int]:
        """Steps that have a manifest, oldest first (unverified)."""
        if not self.root.is_dir():
            return []
        found = [int(p.name[5:]) for p in self.root.glob("step-*")
                 if p.name[5:].isdigit() and (p / MANIFEST).is_file()]
        return sorted(found)

    def save(self, step: int, module: nn.Module, optimizer_state: dict, trainer_state: dict,
             best: dict | None = None) -> Path:
        """Write step `step` atomically; `best` (variable and value) marks it the best so far."""
        final = self.path(step)
        if not final.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".tmp-step-{step}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            _in_progress.add(tmp)
            try:
                with writing(final):  # a full disk: one error naming the step (the finally removes tmp)
                    self._write(tmp, step, module, optimizer_state, trainer_state)
                    os.rename(tmp, final)
                    fsync_dir(self.root)
            finally:
                _in_progress.discard(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        if best is not None:
            write_text_atomic(self.root / "best.json", json.dumps({"step": step, **best}), sync=True)
        self.prune()
        return final

    def _write(self, folder: Path, step: int, module: nn.Module, optimizer_state: dict,
               trainer_state: dict) -> None:
        save_model(module, str(folder / WEIGHTS), metadata={"step": str(step)}, force_contiguous=True)
        with open(folder / OPTIMIZER, "wb") as f:  # through Python's file: a full disk is an OSError, with errno
            torch.save(optimizer_state, f)
        (folder / TRAINER).write_text(json.dumps(trainer_state))
        files = {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
                 for name in (WEIGHTS, OPTIMIZER, TRAINER)}
        for name in files:
            fsync_file(folder / name)
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
        fsync_file(folder / MANIFEST)
        fsync_dir(folder)

    def verify(self, step: int) -> Path:
        """The step's folder, if every file matches its manifest; else CheckpointError naming the file."""
        folder = self.path(step)
        manifest_path = folder / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(f"{manifest_path} is missing or unreadable; this checkpoint is incomplete") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path} has format {manifest.get('format')!r}; this phalanx reads {FORMAT}")
        for name, meta in files.items():
            file = folder / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing; the checkpoint is damaged")
            if file.stat().st_size != meta["size"]:
                raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says "
                                      f"{meta['size']}: the file is truncated or altered")
            if _sha256(file) != meta["sha256"]:
                raise CheckpointError(f"{file} does not match its SHA-256 in the manifest: the file is altered")
        return folder

    def latest_valid(self) -> int | None:
        """The newest step that verifies; damaged newer ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                self.verify(step)
                return step
            except CheckpointError as e:
                log.warning("skipping damaged checkpoint: %s; falling back to the previous one", e)
        return None

    def best(self) -> int | None:
        try:
            return int(json.loads((self.root / "best.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return None

    def select(self, which: str | int) -> int:
        """`latest`, `best` or a step number, verified."""
        if which == "latest":
            step = self.latest_valid()
        elif which == "best":
            step = self.best()
        else:
            step = int(which) if str(which).isdigit() else None
            if step is None:
                raise CheckpointError(f"--checkpoint {which!r} is not best, latest or a step number")
            if step not in self.steps():
                raise CheckpointError(f"no checkpoint at step {step}; there are {self.steps() or 'none'}")
        if step is None:
            raise CheckpointError(f"no {which} checkpoint in {self.root}; train longer or save with SaveBest/SaveLatest")
        self.verify(step)
        return step

    def prune(self) -> None:
        """Keep the last `keep_last` steps and the best; delete the others."""
        steps = self.steps()
        keep = set(steps[-self.keep_last:]) | {self.best()}
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.path(step), ignore_errors=True)

    def clean_stale(self) -> None:
        """Remove temporary folders that an interrupted process left."""
        for tmp in self.root.glob(".tmp-step-*") if self.root.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, step: int, module: nn.Module | None) -> tuple[dict, dict]:
        """Load weights into `module` (if given); return optimizer state and trainer state."""
        folder = self.verify(step)
        if module is not None:
            load_weights(module, folder / WEIGHTS)
        optimizer_state = torch.load(folder / OPTIMIZER, weights_only=True, map_location="cpu")
        return optimizer_state, json.loads((folder / TRAINER).read_text())


def load_weights(module: nn.Module, path: Path) -> None:
    """Weights from a safetensors file; a checkpoint of another model is a CheckpointError."""
    try:
        load_model(module, str(path), strict=True, device="cpu")
    except (RuntimeError, SafetensorError) as e:
        lines = " ".join(str(e).split())
        raise CheckpointError(f"{path} does not fit this model ({lines[:300]}); was it saved from "
                              "another model config?") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
