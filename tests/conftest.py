import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import toy` in tests


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each test runs in its own working directory, so stray `runs/` never land in the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _reset_logging():
    """`logs.setup` points the phalanx logger's handlers at one test's files and stops it
    propagating; detach them and let it propagate again afterwards."""
    yield
    logger = logging.getLogger("phalanx")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = True
