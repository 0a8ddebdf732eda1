"""The README's two set-up commands, as `make -n` lays them out: each installs what it needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
]


def _planned(target: str, tmp_path: Path) -> list[str]:
    """The commands `make TARGET` would run for a fresh virtual environment."""
    done = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def test_make_demo_installs_torch_and_the_examples_not_the_test_tools(tmp_path):
    installs = _installs(_planned("demo", tmp_path))
    assert any('"torch' in line for line in installs)
    assert any('-e ".[examples]"' in line for line in installs)
    assert not any("[dev]" in line or "[bench]" in line for line in installs), installs
    # pip shows what it fetches and installs: no --quiet
    assert not any("--quiet" in line or " -q " in line for line in installs)


def test_make_test_installs_the_test_tools_too(tmp_path):
    lines = _planned("test", tmp_path)
    assert any('-e ".[dev]"' in line for line in _installs(lines))
    assert any("pytest" in line for line in lines if "pip install" not in line)
