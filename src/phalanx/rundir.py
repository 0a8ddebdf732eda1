"""The run directory: `runs/<name>-<time>/` with the resolved config, logs, metrics, checkpoints
and `trace.jsonl`, an append-only record of the run's status."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.config import Config, dump, read_yaml
from phalanx.errors import RunDirError, first_line
from phalanx.files import parse_json, read_json, writing
from phalanx.overrides import default_hooks

CONFIG, META, TRACE = "config.yaml", "run.json", "trace.jsonl"
log = logging.getLogger("phalanx")


def create(cfg: Config, config_path: Path | None, objects: dict[str, Any] | None = None) -> Path:
    """A new run directory holding the resolved config and where it came from: the config file's
    folder (the working directory for a config given as a dict), and the parts given as objects."""
    root = Path(cfg.output_root)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = cfg.name or "run"  # a config given as a mapping without one
    run_dir, n = root / f"{name}-{stamp}", 1
    with writing(run_dir, where="set output_root to a folder you can write"):
        # mkdir is the check: two commands started in the same second get a folder each
        while True:
            try:
                run_dir.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                run_dir = root / f"{name}-{stamp}-{n}"
    # none half-made
    with writing(run_dir, partial=run_dir, where="set output_root to a folder you can write"):
        (run_dir / CONFIG).write_text(dump(resolved(cfg)))
        config_dir = config_path.resolve().parent if config_path is not None else Path.cwd()
        meta = {
            "config_dir": str(config_dir),
            "cwd": str(Path.cwd()),
            "created": time.time(),
            "phalanx": __version__,
        }
        if objects:
            meta["objects"] = objects
        (run_dir / META).write_text(json.dumps(meta, indent=1))
    return run_dir


def resolved(cfg: Config) -> dict:
    """The config as the run takes it: every default filled in, the default hooks listed where the
    config lists none (what runs, and what a resume of it runs)."""
    raw = cfg.model_dump(mode="json", by_alias=True)
    if raw.get("hooks") is None:
        raw["hooks"] = default_hooks(cfg.main_loop.extra_streams)
    return raw


def open_run(path: str | Path, announce: bool = True) -> Path:
    """The run directory at `path`, or a RunDirError saying why it is not one. Logs where the run's
    classes will be imported from (unless `announce` is False: the caller does, later)."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunDirError(
            f"{str(run_dir)!r} is not a directory; pass a run directory such as "
            "runs/digits-20260101-120000 (`phalanx ls` lists them)"
        )
    missing = [name for name in (CONFIG, META) if not (run_dir / name).is_file()]
    ran = any((run_dir / name).exists() for name in ("checkpoints", TRACE))
    if missing and ran:
        # a run's folder (it trained) that lost a file of its own: the fix is the file
        raise RunDirError(
            f"{str(run_dir)!r} is a run directory without its {' and '.join(missing)}, which "
            f"phalanx reads to open it; restore {'it' if len(missing) == 1 else 'them'} from a "
            "backup or another copy of the run"
        )
    if missing:
        raise RunDirError(
            f"{str(run_dir)!r} is not a run directory (it has no {' and no '.join(missing)}); "
            "`phalanx ls` lists the runs"
        )
    if announce:
        announce_imports(run_dir)
    return run_dir


def announce_imports(run_dir: Path) -> None:
    """Log where the run's classes will be imported from: opening a run runs the code its config
    names."""
    config_dir, cwd = search_dirs(run_dir)
    log.info(
        "run %s imports its classes from %s%s (as its %s says)",
        run_dir,
        config_dir,
        "" if cwd == config_dir else f", then {cwd}",
        META,
    )


def search_dirs(run_dir: Path) -> list[Path]:
    """Folders to import the run's classes from: the original config's folder and working
    directory."""
    path = run_dir / META
    fix = (
        f"the run directory is damaged: restore {META} from a copy of the run, or write it again "
        'as {"config_dir": FOLDER, "cwd": FOLDER}, FOLDER being where the run\'s classes are '
        "imported from"
    )
    try:
        meta = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise RunDirError(
            f"{path} is not readable JSON ({first_line(e, os_reason=True)}); {fix}"
        ) from None
    folders = [meta.get(key) for key in ("config_dir", "cwd")] if isinstance(meta, dict) else [None]
    named = [folder for folder in folders if isinstance(folder, str) and folder]
    if len(named) != len(folders):
        raise RunDirError(f"{path} does not name the folders config_dir and cwd; {fix}")
    return [Path(folder) for folder in named]


def objects(run_dir: Path) -> dict[str, Any]:
    """The parts of a run given to `phalanx.fit` as objects: {"model": class, "dataset": class,
    "hooks": [...]}."""
    try:
        meta = read_json(run_dir / META)
    except (OSError, ValueError):
        # search_dirs says what is wrong with the file, where it is needed
        return {}
    given = meta.get("objects") if isinstance(meta, dict) else None
    return given if isinstance(given, dict) else {}


def trace(run_dir: Path, event: str, **fields: Any) -> None:
    """Append an event. A last line cut short (by a crash or a full disk) is ended first, so that it
    costs only itself and not this event too."""
    path = run_dir / TRACE
    line = json.dumps({"time": time.time(), "event": event, **fields}).encode() + b"\n"
    with writing(path), open(path, "ab+") as f:
        if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            line = b"\n" + line
        f.write(line)


def read_trace(run_dir: Path) -> list[dict]:
    """The run's events, skipping lines that are not one (a line cut short by a crash or a full
    disk, a line nested too deep to read)."""
    try:
        lines = (run_dir / TRACE).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = parse_json(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def list_runs(root: Path) -> list[Path]:
    """The runs under `root`, and those one folder deeper, in folders that are not runs themselves:
    `phalanx bench` and the Slurm script group theirs (bench-<time>/, slurm-<job id>/)."""
    found: list[Path] = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if _is_run(folder):
            found.append(folder)
        elif folder.is_dir():
            found += sorted(p for p in folder.iterdir() if _is_run(p))
    return found


def _is_run(folder: Path) -> bool:
    return (folder / CONFIG).is_file() and (folder / META).is_file()


def load_config_text(run_dir: Path) -> dict:
    """The run's resolved config, as saved; a RunDirError where the file is damaged."""
    path = run_dir / CONFIG
    fix = (
        f"the run directory is damaged: restore {CONFIG} from a copy of the run, or write it again "
        "from the config the run was trained with"
    )
    raw = read_yaml(path, fix, RunDirError)
    if not isinstance(raw, dict):
        raise RunDirError(f"{path} holds a {type(raw).__name__}, not a config; {fix}")
    return raw
