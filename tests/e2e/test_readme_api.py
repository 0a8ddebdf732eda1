"""The README's Python example, run as a user would: a script in a fresh folder."""

from __future__ import annotations

import re
from pathlib import Path

import forks
import pytest
from procs import ENV

pytestmark = pytest.mark.timeout(240)
README = Path(__file__).resolve().parents[2] / "README.md"

CHECKS = """
import json
from safetensors.torch import load_file
step = json.loads((run.run_dir / "checkpoints" / "best.json").read_text())["step"]
want = load_file(next((run.run_dir / "checkpoints").glob(f"step-*{step}")) / "model.safetensors")
assert all(torch.equal(best.state_dict()[k], v) for k, v in want.items()), "load gave other weights"
assert not best.training
assert run.model.net.weight.shape == (1, 8) and run.metrics["valid.loss"] < 0.1, run.metrics
"""


def test_the_readmes_python_example_runs(tmp_path):
    text = README.read_text()
    marker = text.index("<!-- the test suite runs this example (tests/e2e/test_readme_api.py) -->")
    code = re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code + CHECKS)
    result = forks.run([], tmp_path, ENV, 200, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    status, loss, run_dir = result.stdout.split()
    assert status == "finished" and float(loss) < 0.1
    assert (tmp_path / run_dir).parent == tmp_path / "runs" and (
        tmp_path / run_dir / "metrics.csv"
    ).is_file()
