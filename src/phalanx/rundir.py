"""The run directory: `runs/<name>-<time>/` with the resolved config, logs, metrics, checkpoints
and `trace.jsonl`, an append-only record of the run's status."""
from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.config import Config, dump, safe_load
from phalanx.errors import RunDirError

CONFIG, META, TRACE = "config.yaml", "run.json", "trace.jsonl"


def create(cfg: Config, config_path: Path) -> Path:
    """A new run directory holding the resolved config and where it came from."""
    root = Path(cfg.output_root)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir, n = root / f"{cfg.name}-{stamp}", 1
    while True:  # mkdir is the check: two commands started in the same second get a folder each
        try:
            run_dir.mkdir(parents=True)
            break
        except FileExistsError:
            n += 1
            run_dir = root / f"{cfg.name}-{stamp}-{n}"
    (run_dir / CONFIG).write_text(dump(resolved(cfg)))
    meta = {"config_dir": str(config_path.resolve().parent), "cwd": str(Path.cwd()),
            "created": time.time(), "phalanx": __version__}
    (run_dir / META).write_text(json.dumps(meta, indent=1))
    return run_dir


def resolved(cfg: Config) -> dict:
    return cfg.model_dump(mode="json", by_alias=True)


def open_run(path: str | Path) -> Path:
    """The run directory at `path`, or a RunDirError saying why it is not one."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunDirError(f"{str(run_dir)!r} is not a directory; pass a run directory such as "
                          "runs/digits-20260101-120000 (`phalanx ls` lists them)")
    if not (run_dir / CONFIG).is_file() or not (run_dir / META).is_file():
        raise RunDirError(f"{str(run_dir)!r} is not a run directory (it has no {CONFIG} and {META}); "
                          "`phalanx ls` lists the runs")
    return run_dir


def search_dirs(run_dir: Path) -> list[Path]:
    """Folders to import the run's classes from: the original config's folder and working directory."""
    meta = json.loads((run_dir / META).read_text())
    return [Path(meta["config_dir"]), Path(meta["cwd"])]


def trace(run_dir: Path, event: str, **fields: Any) -> None:
    with open(run_dir / TRACE, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")


def read_trace(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / TRACE).read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def list_runs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / CONFIG).is_file() and (p / META).is_file())


def load_config_text(run_dir: Path) -> dict:
    return safe_load((run_dir / CONFIG).read_text())
