import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import toy` in tests


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each test runs in its own working directory, so stray `runs/` never land in the repo."""
    monkeypatch.chdir(tmp_path)
