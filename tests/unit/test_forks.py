"""The tests' forked commands (tests/forks.py) are the processes a fresh start would give: the
test's working directory, environment, arguments and thread pools, no input, their own exit code,
and a hang guard that kills them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forks
import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import json, os, sys
import torch
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "mark": os.environ.get("FORKS_MARK"),
                  "threads": torch.get_num_threads(), "input": sys.stdin.read(),
                  "path0": sys.path[0], "main": __name__, "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _fresh(script, env, cwd) -> dict:
    done = subprocess.run(
        [sys.executable, str(script), "0"], env=env, cwd=cwd, capture_output=True, text=True
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_forked_script_starts_as_a_fresh_one_would(tmp_path, threads):
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "FORKS_MARK": "first"}
    result = forks.run(["3", "x"], tmp_path, env, 120, script=script)
    assert result.returncode == 3 and result.stderr == "to stderr\n"
    seen = json.loads(result.stdout)
    want = _fresh(script, env, tmp_path)
    for key in ("cwd", "mark", "threads", "input", "path0", "main"):
        assert seen[key] == want[key], key
    assert seen["argv"] == [str(script), "3", "x"] and seen["pid"] != os.getpid()
    # the next command has its own environment, not what the last one was given
    again = forks.run(["0"], tmp_path, {**env, "FORKS_MARK": "second"}, 120, script=script)
    assert json.loads(again.stdout)["mark"] == "second" and again.returncode == 0


def test_a_forked_command_that_outlives_its_bound_is_killed(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        forks.run([], tmp_path, env, 3, script=script)
    assert raised.value.cmd == [str(script)]
    hung = forks.start([], tmp_path, env, script=script)
    with pytest.raises(subprocess.TimeoutExpired):
        hung.communicate(1)
    hung.kill()
    assert hung.wait(30) == -9
    with pytest.raises(ProcessLookupError):  # gone, and reaped by the server
        os.kill(hung.pid, 0)
    version = forks.run(["--version"], tmp_path, env, 120)
    assert version.returncode == 0 and version.stdout.startswith("phalanx "), version
