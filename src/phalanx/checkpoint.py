"""Checkpoints: one logical format, written atomically, checked before they are trusted.

`checkpoints/step-<N>/` holds `model.safetensors` (weights), `optimizer.pt` (optimizer, scheduler
and loss-scaler state, read only with `weights_only=True`), `trainer.json` (epoch, step, sampler
cursor, every RNG, hook state) and `manifest.json` (sizes and SHA-256 of the others), written last.
A strategy that shards the model writes, instead of the weights and the optimizer's own state, a
`shards/` folder of `torch.distributed.checkpoint` files (one per process, and `.metadata`), which
any strategy on any process count reads back (`shards.load_shards`). A step is built in a temporary
folder, fsynced and renamed into place: a step without a manifest does not exist, and an
interrupted save leaves nothing behind. A step folder that does not verify (a damaged one that a
resumed run trains through again) is replaced the same way.

What a checkpoint holds is checked before it is used: the hashes, then that each file parses and the
trainer state makes sense. Any failure is a CheckpointError naming the file, so that `resume` can
fall back to the step before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch
from safetensors.torch import save_file, save_model
from torch import nn

from phalanx.errors import CheckpointError, ConfigError, StorageError
from phalanx.files import (
    fsync_dir,
    fsync_file,
    read_json,
    write_atomic,
    write_text_atomic,
    writing,
)
from phalanx.shards import checkpoint_exception, shard_error
from phalanx.stepfiles import FORMAT, read_manifest, read_optimizer_state, read_trainer_state
from phalanx.weights import (
    SHARDS,
    WEIGHTS,
    Weights,
    load_into,
    untie_weights,
    weights_path,
    whole_state,
)

log = logging.getLogger("phalanx")


class Group(Protocol):
    """The processes that save a sharded step together (a strategy)."""

    @property
    def is_main(self) -> bool: ...

    def gather(self, value: Any) -> list[Any]: ...

    def broadcast(self, value: Any) -> Any: ...


def saves_shards(strategy: Any) -> bool:
    """Whether a strategy's checkpoints are each process's shards (it has `save_shards`)."""
    return callable(getattr(strategy, "save_shards", None))


OPTIMIZER, TRAINER, MANIFEST = "optimizer.pt", "trainer.json", "manifest.json"
_in_progress: set[Path] = set()


def abort_in_progress() -> None:
    """Remove half-written checkpoint folders (on a second signal, before exiting at once)."""
    for path in list(_in_progress):
        shutil.rmtree(path, ignore_errors=True)


class Checkpoints:
    """The checkpoints of one run: save, verify, find the latest valid, keep the last K and the
    best."""

    def __init__(self, root: Path, keep_last: int = 3):
        self.root, self.keep_last = Path(root), keep_last
        # steps this object wrote: known intact without hashing them again
        self._written: set[int] = set()
        # steps a resume fell back past: replaced when saved again
        self._passed: set[int] = set()
        # whether pruning was held back for a best.json that names no step (said once)
        self._unpruned = False

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def steps(self) -> list[int]:
        """Steps that have a manifest, oldest first (unverified)."""
        if not self.root.is_dir():
            return []
        found = [
            int(p.name[5:])
            for p in self.root.glob("step-*")
            # step-N as phalanx names it (step-060 would be another folder of step 60)
            if p.name[5:].isdigit()
            and p.name == f"step-{int(p.name[5:])}"
            and (p / MANIFEST).is_file()
        ]
        return sorted(found)

    def save(
        self,
        step: int,
        module: nn.Module | dict[str, torch.Tensor],
        optimizer_state: dict,
        trainer_state: dict,
        best: dict | None = None,
    ) -> Path:
        """Write step `step` atomically; `best` (variable and value) marks it the best so far. An
        existing step is kept if it verifies, and replaced if it does not."""
        final = self.path(step)
        if step not in self._written and not (final.exists() and self._intact(step)):
            tmp = self.root / f".tmp-step-{step}-{os.getpid()}"
            _in_progress.add(tmp)
            try:
                # a full disk or a folder that cannot be written: one error naming the step (the
                # finally removes tmp)
                with writing(final):
                    self.root.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir()
                    self._write(tmp, step, module, optimizer_state, trainer_state)
                    self._move_into_place(tmp, final)
            finally:
                _in_progress.discard(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        self._written.add(step)
        self._record(step, best)
        return final

    def _record(self, step: int, best: dict | None) -> None:
        """After step `step` is written, or found written already (SaveLatest, then SaveBest at the
        same step): mark it the best where it is, then apply retention, which keeps the best."""
        if best is not None:
            write_text_atomic(
                self.root / "best.json", json.dumps({"step": step, **best}), sync=True
            )
        self.prune()

    def save_state(
        self,
        step: int,
        strategy: Any,
        optimizer: torch.optim.Optimizer,
        rest: dict,
        trainer_state: dict,
        best: dict | None = None,
        background: Any = None,
    ) -> Path | None:
        """Step `step` as `strategy` holds the model and optimizer: each process's shards, written
        by every process at once where it saves shards (`saves_shards`), else the whole state
        gathered to the main process (`model_state`, `optimizer_state`) and written there, by
        `background`'s thread where one is given. `rest`: the schedulers' and the scaler's
        state. Every rank calls it; returns the step's folder on the main process (None
        elsewhere)."""
        if saves_shards(strategy):
            path = self.save_sharded(
                step,
                lambda folder: strategy.save_shards(folder, optimizer),
                {"optimizer": None, **rest},
                trainer_state,
                strategy,
                best,
            )
            return path if strategy.is_main else None
        weights, optimizer_state = strategy.model_state(), strategy.optimizer_state(optimizer)
        if not strategy.is_main:
            return None
        state = {"optimizer": optimizer_state, **rest}
        if background is not None:  # committed by the writer's thread
            return background.submit(step, weights, state, trainer_state, best)
        return self.save(step, weights, state, trainer_state, best)

    def save_sharded(
        self,
        step: int,
        write_shards: Callable[[Path], None],
        optimizer_state: dict,
        trainer_state: dict,
        group: Group,
        best: dict | None = None,
    ) -> Path:
        """Step `step` of a sharded model, atomically. Every rank calls it: each writes its shards
        into the temporary folder with `write_shards(folder)` (a collective), then the main process
        writes the rest and the manifest over every file and renames. Every rank raises the same
        error."""
        final = self.path(step)
        # one name every rank knows (one job per run: the run lock)
        tmp = self.root / f".tmp-step-{step}-shards"
        began = self._begin_sharded(step, tmp) if group.is_main else None
        began = group.broadcast(began)
        # written already, by an earlier save of this step: recorded now
        if began == "kept":
            error = self._try_record(step, best) if group.is_main else None
            error = group.broadcast(error)
            if error:
                raise StorageError(error)
            self._written.add(step)
            return final
        if began != "ready":
            raise StorageError(began)
        try:
            error = None
            try:
                write_shards(tmp / SHARDS)
            except (Exception, checkpoint_exception()) as e:  # noqa: BLE001 - every rank must hear of it
                error = shard_error(final, e)
            errors = [e for e in group.gather(error) if e]
            if group.is_main and not errors:
                errors = [
                    self._finish_sharded(tmp, final, step, optimizer_state, trainer_state, best)
                ]
            error = group.broadcast(errors[0] if errors else None)
        finally:
            if group.is_main:
                _in_progress.discard(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        if error:
            raise StorageError(error)
        self._written.add(step)
        return final

    def _begin_sharded(self, step: int, tmp: Path) -> str:
        """ "kept" where the step exists and verifies, "ready" once the empty temporary folder is
        made, else the error that prevented it."""
        if step in self._written or (self.path(step).exists() and self._intact(step)):
            return "kept"
        try:
            with writing(self.path(step)):
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / SHARDS).mkdir(parents=True)
        except StorageError as e:
            return str(e)
        _in_progress.add(tmp)
        return "ready"

    def _finish_sharded(
        self,
        tmp: Path,
        final: Path,
        step: int,
        optimizer_state: dict,
        trainer_state: dict,
        best: dict | None,
    ) -> str | None:
        """The main process's part once every shard is written; the error, if any, as text."""
        try:
            with writing(final):
                self._write(tmp, step, None, optimizer_state, trainer_state)
                self._move_into_place(tmp, final)
        except StorageError as e:
            return str(e)
        return self._try_record(step, best)

    def _try_record(self, step: int, best: dict | None) -> str | None:
        """`_record`, its refusal as text (which every rank of a sharded save must hear of)."""
        try:
            self._record(step, best)
        except StorageError as e:
            return str(e)
        return None

    def fell_back_past(self, steps: list[int]) -> None:
        """Steps a resume could not continue from though their files verify (another model's,
        weights that are not finite): training that reaches one of them again saves it anew."""
        self._passed.update(steps)

    def _intact(self, step: int) -> bool:
        if step in self._passed:
            log.warning("replacing checkpoint step-%d, which the resume fell back past", step)
            return False
        try:
            self.verify(step)
        except CheckpointError as e:
            log.warning("replacing damaged checkpoint step-%d: %s", step, e)
            return False
        return True

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename `tmp` to `final`; a damaged folder already there is first renamed aside (a crash
        in between leaves no step `final`, which is what a damaged step amounts to) and then
        removed."""
        aside = None
        if final.exists():
            aside = self.root / f".tmp-replaced-{final.name}-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(self.root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _write(
        self,
        folder: Path,
        step: int,
        module: nn.Module | dict[str, torch.Tensor] | None,
        optimizer_state: dict,
        trainer_state: dict,
    ) -> None:
        """Everything but the shards (already in `folder/shards` where `module` is None), then the
        manifest over every file in `folder`. Each file is hashed and synced by a thread as soon as
        it is written, while the next one is written: the hashes cost little more than the writes
        (hashlib and fsync release the GIL)."""
        with ThreadPoolExecutor(max_workers=_SEALERS, thread_name_prefix="phalanx-seal") as pool:
            sealed = {
                p.relative_to(folder).as_posix(): pool.submit(_seal, p, sync=False)
                for p in folder.rglob("*")
                if p.is_file()  # the shards' writers synced their own files
            }
            # the largest file first: its hash runs while the weights are written
            # Python's file: a full disk is an OSError
            with open(folder / OPTIMIZER, "wb") as f:
                torch.save(optimizer_state, f)
            sealed[OPTIMIZER] = pool.submit(_seal, folder / OPTIMIZER)
            # safetensors' own handling of shared (tied) weights
            if isinstance(module, nn.Module):
                save_model(
                    module,
                    str(folder / WEIGHTS),
                    metadata={"step": str(step)},
                    force_contiguous=True,
                )
            elif module is not None:
                # a state gathered from shards: no tensor shares storage
                save_file(
                    {k: v.contiguous() for k, v in module.items()},
                    str(folder / WEIGHTS),
                    metadata={"step": str(step)},
                )
            if module is not None:
                sealed[WEIGHTS] = pool.submit(_seal, folder / WEIGHTS)
            (folder / TRAINER).write_text(json.dumps(trainer_state))
            sealed[TRAINER] = pool.submit(_seal, folder / TRAINER)
            files = {name: sealed[name].result() for name in sorted(sealed)}
        layout = "full" if module is not None else "sharded"
        (folder / MANIFEST).write_text(
            json.dumps({"format": FORMAT, "step": step, "layout": layout, "files": files}, indent=1)
        )
        fsync_file(folder / MANIFEST)
        if module is None:
            fsync_dir(folder / SHARDS)
        fsync_dir(folder)

    def verify(self, step: int, weights_only: bool = False) -> Path:
        """The step's folder, if every file matches its manifest; else CheckpointError naming the
        file. `weights_only`: the files its weights are read from (a damaged optimizer or trainer
        state keeps no one from evaluating or exporting the weights)."""
        folder = self.path(step)
        manifest_path = folder / MANIFEST
        files = read_manifest(manifest_path)
        for name, meta in files.items():
            if weights_only and name in (OPTIMIZER, TRAINER):
                continue
            parts = PurePosixPath(name).parts
            if not parts or parts[0] == "/" or ".." in parts:
                raise CheckpointError(
                    f"{manifest_path} names {name!r}, which is not a file inside the step; the "
                    "checkpoint is damaged"
                )
            file = folder / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing; the checkpoint is damaged")
            if file.stat().st_size != meta["size"]:
                raise CheckpointError(
                    f"{file} has {file.stat().st_size} bytes, the manifest says "
                    f"{meta['size']}: the file is truncated or altered"
                )
            try:
                digest = _sha256(file)
            except OSError as e:  # not the checkpoint's fault: no step is passed over for it
                raise StorageError(
                    f"cannot read {file}: {e.strerror or e}; make the run directory readable by "
                    "the user running phalanx"
                ) from None
            if digest != meta["sha256"]:
                raise CheckpointError(
                    f"{file} does not match its SHA-256 in the manifest: the file is altered"
                )
        return folder

    def latest_valid(self, weights_only: bool = False) -> int | None:
        """The newest step that verifies (`verify`); damaged newer ones are skipped with a
        warning."""
        for step in reversed(self.steps()):
            try:
                self.verify(step, weights_only)
                return step
            except CheckpointError as e:
                log.warning("skipping damaged checkpoint: %s; falling back to the previous one", e)
        return None

    def best(self) -> int | None:
        """The best step as `best.json` names it; None where there is none or it is unreadable."""
        try:
            return self._best()
        except CheckpointError:
            return None

    def _best(self) -> int | None:
        path = self.root / "best.json"
        if not path.is_file():
            return None
        try:
            step = read_json(path)["step"]
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            step = None
        if type(step) is not int or step < 0:
            raise CheckpointError(
                f"{path} does not name a step; choose one with --checkpoint latest or N, or "
                "delete it: the next SaveBest writes it again"
            )
        return step

    def _said_damaged(self, step: int) -> None:
        """Where `step` has a folder but no manifest (a save cut short, or damaged), the error
        says so, naming the file, rather than that there is no such checkpoint."""
        if self.path(step).is_dir():
            read_manifest(self.path(step) / MANIFEST)

    def select(self, which: str | int, weights_only: bool = False) -> int:
        """`latest`, `best`, `auto` (the best where there is one, else the latest) or a step number,
        verified (`verify`: its weights alone, where `weights_only`)."""
        if which == "auto":  # a best.json that names no step is said, not passed over
            which = "best" if self._best() is not None else "latest"
        if which == "latest":
            step = self.latest_valid(weights_only)
        elif which == "best":
            step = self._best()
            if step is not None and step not in self.steps():
                self._said_damaged(step)
                raise CheckpointError(
                    f"{self.root / 'best.json'} names step {step}, which has no checkpoint (there "
                    f"are {self.steps() or 'none'}); choose one with --checkpoint latest or N, or "
                    "delete best.json: the next SaveBest writes it again"
                )
        else:
            step = int(which) if str(which).isdigit() else None
            if step is None:
                raise CheckpointError(
                    f"--checkpoint {which!r} is not best, latest, auto or a step number"
                )
            if step not in self.steps():
                self._said_damaged(step)
                raise CheckpointError(
                    f"no checkpoint at step {step}; there are {self.steps() or 'none'}"
                )
        if step is None:
            raise CheckpointError(
                f"no {which} checkpoint in {self.root}; train longer or save with "
                "SaveBest/SaveLatest"
            )
        try:
            self.verify(step, weights_only)
        except CheckpointError as e:
            raise CheckpointError(
                f"{e}; --checkpoint latest takes the newest checkpoint that verifies, or give a "
                f"step: there are {self.steps()}"
            ) from None
        return step

    def prune(self) -> None:
        """Keep the last `keep_last` steps and the best; delete the others. Where `best.json` does
        not name a step, which one is best is not known: none is deleted (said once)."""
        steps = self.steps()
        try:
            best = self._best()
        except CheckpointError:
            if not self._unpruned:
                self._unpruned = True
                log.warning(
                    "%s does not name a step, so which checkpoint is best is not known: none is "
                    "deleted until it names one (the next SaveBest writes it; delete it, or write "
                    'the best step into it as {"step": N}, to prune now)',
                    self.root / "best.json",
                )
            return
        keep = set(steps[-self.keep_last :]) | {best}
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.path(step), ignore_errors=True)

    def clean_stale(self) -> list[str]:
        """Remove the temporary folders that an interrupted process left (a write killed before its
        commit); each removed, with its size, for the log."""
        removed = []
        for tmp in sorted(self.root.glob(".tmp-*")) if self.root.is_dir() else []:
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(f"{tmp.name} ({size / 2**20:,.1f} MiB)")
        return removed

    def load(self, step: int, weights: Weights | None) -> tuple[dict, dict]:
        """Optimizer state and trainer state of step `step`, and its weights loaded into `weights`
        once every file has verified and parsed. In a sharded step the optimizer's own state is in
        the shards (its entry here is None): `weights` given a shards folder loads it from there."""
        folder = self.verify(step)
        trainer_state = read_trainer_state(folder / TRAINER)
        # a folder renamed, or a state copied from another step
        if trainer_state["step"] != step:
            raise CheckpointError(
                f"{folder / TRAINER} says step {trainer_state['step']}, but the folder is step "
                f"{step}; the checkpoint is damaged"
            )
        optimizer_state = read_optimizer_state(folder / OPTIMIZER)
        if weights is not None:
            load_into(weights, weights_path(folder))
        return optimizer_state, trainer_state

    def load_weights(self, step: int, weights: Weights) -> None:
        """Only the weights of step `step`, verified, into `weights` (evaluation needs no more)."""
        load_into(weights, weights_path(self.verify(step, weights_only=True)))

    def export(self, step: int, output: Path) -> int:
        """The whole model of step `step` as one safetensors file at `output`, every name of its
        state dict present (tied weights as copies), loadable by `load_state_dict` with no phalanx;
        written atomically. Returns the number of tensors."""
        from safetensors.torch import save

        path = weights_path(self.verify(step, weights_only=True))
        state = untie_weights(whole_state(path), path)
        data = save(state, metadata={"step": str(step)})
        write_atomic(output, lambda f: f.write(data), sync=True)
        return len(state)


def initial_weights(source: str, which: str | int = "auto") -> tuple[Path, dict[str, torch.Tensor]]:
    """The weights `model.init_from` names: a safetensors file, or checkpoint `which` of a run
    directory (auto: its best, else its latest). The path read, and the whole state."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "checkpoints").is_dir():
            if (path / "config.yaml").is_file():  # a run that saved nothing yet
                raise ConfigError(
                    f"model.init_from: the run {path} has saved no checkpoint yet; name a run "
                    "that has, or a .safetensors file"
                )
            raise ConfigError(
                f"model.init_from: {path} is a folder but not a run directory (it has no "
                "checkpoints/); name a run directory or a .safetensors file"
            )
        checkpoints = Checkpoints(path / "checkpoints")
        step = checkpoints.select(which, weights_only=True)
        path = weights_path(checkpoints.verify(step, weights_only=True))
    elif not path.is_file():
        raise ConfigError(
            f"model.init_from: {path} does not exist; name a run directory or a .safetensors file"
        )
    return path, whole_state(path)


# threads that hash and sync a checkpoint's files
_SEALERS = 4


def _seal(path: Path, sync: bool = True) -> dict[str, Any]:
    """A written file's manifest entry (its size and SHA-256), once it is synced (`sync`)."""
    digest = _sha256(path)
    if sync:
        fsync_file(path)
    return {"size": path.stat().st_size, "sha256": digest}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
