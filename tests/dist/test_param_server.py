"""The param_server strategy on real gloo processes: at staleness 0 exactly one process's training,
in float64; above 0, workers that do not wait for a slow one, within the bound."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402
from test_invariance import assert_same_run, rel, scenario  # noqa: E402
from test_weighted import lm  # noqa: E402

from phalanx import config, rundir, strategies, worker  # noqa: E402
from phalanx.checkpoint import Checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SCENARIOS = {
    # 41 samples: the last batch of 1 is smaller than the workers
    "batch7": scenario(7, 1),
    "batch10-accum3": scenario(10, 3),
    "adamw-warmup-clipped": scenario(
        10,
        2,
        optimizer={
            "class": "AdamW",
            "lr": 0.01,
            "warmup_steps": 3,
            "momentum": None,
            "max_grad_norm": 0.05,
        },
    ),
    "weighted-tokens": lm(3, model="toy.WeighingLM"),
}


def served(raw: dict, devices: int, servers: int, staleness: int = 0) -> dict:
    parallel = {
        **raw["parallel"],
        "devices": devices,
        "strategy": "param_server",
        "param_server": {"servers": servers, "staleness": staleness},
    }
    return {**raw, "parallel": parallel}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {name: workers.train(raw) for name, raw in SCENARIOS.items()}


@pytest.mark.parametrize(
    ("devices", "servers"), [(3, 1), (4, 2)], ids=["1-server-2-workers", "2-servers-2-workers"]
)
def test_staleness_zero_trains_as_one_process(devices, servers, reference):
    raws = [served(raw, devices, servers) for raw in SCENARIOS.values()]
    per_rank = workers.run_ranks(devices, workers.train_all, raws)
    for rank_results in per_rank[: devices - servers]:  # every worker: the same run as one process
        for name, got in zip(SCENARIOS, rank_results, strict=True):
            if name == "weighted-tokens":  # compared below: its valid stream is not of 10
                continue
            assert_same_run(got, reference[name])
            # a gathering hook sees each global batch whole, in dataset order, on every worker
            assert got["ids"] == reference[name]["ids"], name
    for name in ("weighted-tokens",):
        got, want = per_rank[0][list(SCENARIOS).index(name)], reference[name]
        for key, value in want["params"].items():
            assert rel(torch.tensor(got["params"][key]), torch.tensor(value)) < 1e-10, key
        assert rel(torch.tensor(got["losses"]), torch.tensor(want["losses"])) < 1e-10
        assert got["epochs"][-1]["train"]["loss"] == pytest.approx(
            want["epochs"][-1]["train"]["loss"], rel=1e-10
        )


def test_workers_that_do_not_wait_for_a_slow_one_stay_within_the_bound_and_learn():
    """Staleness 2, worker 1 computing slower (20 ms more a chunk): worker 0 takes more of each
    batch and runs ahead, every gradient is at most 2 updates old (the logged histogram), every
    sample is trained on once an epoch, and the digits are learnt."""
    raw = {
        "name": "digits",
        "model": {"class": "toy.SlowDigitsMLP", "hidden": 128, "rank": 1, "seconds": 0.02},
        "optimizer": {"class": "AdamW", "lr": 0.003},
        "dataset": {"class": "toy.DigitsWithIds", "batch_size": 32},
        "main_loop": {"epochs": 8, "extra_streams": ["test"]},
        "hooks": [],
    }
    raw = served({**raw, "parallel": {"accelerator": "cpu"}}, 3, 1, staleness=2)
    first, second, _ = workers.run_ranks(3, workers.dealt, raw, timeout=300)
    n_train = len(toy.DigitsWithIds().streams()["train"])
    for epoch, (mine, theirs) in enumerate(zip(first["ids"], second["ids"], strict=True)):
        assert sorted(mine + theirs) == list(range(n_train)), epoch  # each sample once
        assert len(mine) > 1.5 * len(theirs)  # the fast worker took more
    lines = [line for line in first["lines"] if line.startswith("param_server | ")]
    assert len(lines) == 8  # an epoch each
    histogram = [re.search(r"updates old\): ([^;]*);", line) for line in lines]
    staleness = {int(pair.split(": ")[0]) for found in histogram for pair in found[1].split(", ")}
    assert max(staleness) <= 2 and any(k > 0 for k in staleness), lines
    assert first["metrics"]["test.accuracy"] >= 0.95
    assert not [line for line in second["lines"] if line.startswith("param_server | ")]


def _new_run(folder: Path, raw: dict) -> Path:
    path = toy.write_config(folder, raw)
    cfg, _ = config.load(str(path), [])
    return rundir.create(cfg, path)


def test_a_run_stopped_mid_epoch_resumes_between_param_server_ddp_and_one_process(tmp_path):
    """Stopped after step 6 (mid-epoch 2) and resumed: param_server -> ddp and one process; ddp ->
    param_server with 2 servers. The checkpoints hold the whole model and the servers' optimizer states as
    one optimizer's (AdamW's moments of every parameter): each run ends as the run without a
    stop."""
    raw = scenario(10, 1, optimizer={"class": "AdamW", "lr": 0.01, "momentum": None})
    raw = {**raw, "main_loop": {"epochs": 3, "extra_streams": []}}
    whole = workers.train({**raw, "hooks": []})
    raw = {**raw, "hooks": ["SaveLatest", {"StopAfter": {"steps": 6}}]}
    ps = _new_run(tmp_path / "ps", served(raw, 3, 1))
    assert workers.run_ranks(3, workers.run_dir_worker, str(ps), False, []) == [0, 0, 0]
    ddp = _new_run(tmp_path / "ddp", {**raw, "parallel": {**raw["parallel"], "devices": 2}})
    assert workers.run_ranks(2, workers.run_dir_worker, str(ddp), False, []) == [0, 0]
    served_again = ["parallel.strategy=param_server", "parallel.param_server.servers=2"]
    resumed = {
        "ps-ddp": (ps, 2, ["parallel.strategy=ddp", "parallel.devices=2"]),
        "ps-single": (ps, 1, ["parallel.strategy=single", "parallel.devices=1"]),
        "ddp-ps": (ddp, 4, ["parallel.devices=4", *served_again]),
    }
    for name, (run, processes, overrides) in resumed.items():
        copy = tmp_path / name
        shutil.copytree(run, copy)
        more = ["hooks.1.StopAfter.steps=1000", *overrides]
        if processes == 1:
            assert worker.run_worker(copy, True, more) == 0
        else:
            codes = workers.run_ranks(processes, workers.run_dir_worker, str(copy), True, more)
            assert codes == [0] * processes
        assert f"resuming {copy} from step 6 " in (copy / "log.txt").read_text(), name
        latest = Checkpoints(copy / "checkpoints")
        assert latest.latest_valid() == 15, name
        got = load_file(str(latest.path(15) / "model.safetensors"))
        for key, value in whole["params"].items():
            assert rel(got[key], torch.tensor(value, dtype=torch.float64)) < 1e-10, (name, key)


def test_servers_that_leave_no_worker_and_one_process_are_one_error_each():
    raw = served(scenario(10, 1), 2, 2)
    for line in workers.run_ranks(2, workers.error_lines, raw, timeout=120):
        assert "servers=2 leaves no worker among the 2 processes" in line
        assert "parallel.devices to at least 3" in line
    with pytest.raises(config.ConfigError, match=r"runs 1 server\(s\) and at least one worker"):
        strategies.create(config.validate(served(scenario(10, 1), 1, 1)))


def test_a_stop_asked_on_one_worker_stops_every_worker_at_the_same_step(reference):
    """A SIGTERM to worker 1 after step 5: both workers stop at the same step, soon after, save
    and exit with SIGTERM's code; the losses up to there are one process's."""
    raw = served(SCENARIOS["batch7"], 3, 1)
    ends = workers.run_ranks(3, workers.stop_on_one_rank, raw, 1, 5, timeout=120)
    assert [end["code"] for end in ends] == [143, 143, 0]
    first, second = ends[0]["step"], ends[1]["step"]
    assert first == second and 6 <= first <= 7
    want = torch.tensor(reference["batch7"]["losses"][:first])
    for end in ends[:2]:
        assert torch.allclose(torch.tensor(end["losses"]), want, rtol=1e-10)


def test_a_signal_ends_a_process_that_waits_for_a_peer_which_never_answers(tmp_path):
    """A worker or server waiting for a message from a process that died can run no Python, so
    its handler never sees the launcher's SIGTERM: inside `signals.waiting()` a thread of its own
    ends it (128 + the signal) once the wait outlasts a grace of 2 s."""
    import multiprocessing as mp
    import os
    import signal
    import time

    ctx = mp.get_context("spawn")
    ready = tmp_path / "ready"
    port = workers.free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = []
    for rank in range(2):
        os.environ.update({**env, "RANK": str(rank)})
        procs.append(ctx.Process(target=workers.wait_for_a_peer_that_never_sends, args=(rank, str(ready))))
        procs[-1].start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        # again every half second until it ends: a signal that comes before the wait starts is
        # the handler's alone (on a busy machine the ready file can come well before the wait)
        start = time.monotonic()
        while procs[0].is_alive() and time.monotonic() - start < 120:
            os.kill(procs[0].pid, signal.SIGTERM)
            procs[0].join(timeout=0.5)
        assert procs[0].exitcode == 128 + signal.SIGTERM
        # not before the grace: the handler alone would not end it (a lower bound, which a busy
        # machine cannot break)
        assert time.monotonic() - start > 1.5
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for key in (*env, "RANK"):
            os.environ.pop(key, None)
