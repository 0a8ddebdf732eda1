"""BatchNorm on several devices without `parallel.sync_batchnorm`: each device normalises with its
own statistics, and the run says so once, on the main process, whatever the strategy (ddp, fsdp,
towers); with one device, or with sync_batchnorm, it says nothing."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy  # noqa: E402
import workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)
SAID = "BatchNorm on 2 devices without parallel.sync_batchnorm"


def batchnorm_run(devices: int, model: str = "toy.BatchNormNet", **parallel) -> dict:
    """Two epochs of 5 steps: a warning at every step would show."""
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", "devices": devices, **parallel},
        main_loop={"epochs": 2, "extra_streams": ["valid"]},
        hooks=[],
    )
    return {**raw, "model": {"class": model, "features": 3}}


def warnings_of(rank: int, raws: list[dict]) -> list[list[str]]:
    """Train each config in turn; the warnings each one logged on this process."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("phalanx").addHandler(handler)
    out = []
    for raw in raws:
        said.clear()
        workers.train(raw)
        out.append([line for line in said if "BatchNorm" in line])
    return out


def test_towers_on_two_devices_warn_once_and_one_device_does_not():
    two, one, plain = warnings_of(
        0,
        [
            batchnorm_run(2, strategy="towers"),
            batchnorm_run(1, strategy="towers"),
            batchnorm_run(2, model="toy.Linear", strategy="towers"),
        ],
    )
    assert len(two) == 1, two
    assert two[0].startswith(SAID) and "layers (net.1)" in two[0]
    assert two[0].endswith(
        "parallel.strategy=ddp with parallel.sync_batchnorm: true normalises over the whole "
        "micro-batch"
    )
    assert one == [] and plain == []


def test_ddp_and_fsdp_warn_once_on_the_main_process_and_not_with_sync_batchnorm():
    raws = [
        batchnorm_run(2),
        batchnorm_run(2, sync_batchnorm=True),
        batchnorm_run(2, strategy="fsdp"),
    ]
    main, other = workers.run_ranks(2, warnings_of, raws, timeout=100)
    ddp, synchronised, fsdp = main
    assert len(ddp) == 1 and ddp[0].startswith(SAID), ddp
    assert ddp[0].endswith(
        "set parallel.sync_batchnorm: true to normalise over the whole micro-batch"
    )
    assert synchronised == []
    assert len(fsdp) == 1 and fsdp[0].startswith(SAID), fsdp
    assert other == [[], [], []]  # the main process alone


def test_the_pipeline_warns_once_that_its_statistics_are_per_micro_batch():
    raw = batchnorm_run(2, strategy="pipeline")
    raw["parallel"]["pipeline"] = {"split": ["net.2"], "microbatches": 2, "schedule": "gpipe"}
    plain = batchnorm_run(2, model="toy.Deep", strategy="pipeline")
    plain["model"] = {"class": "toy.Deep", "features": 3, "hidden": 4, "layers": 4}
    plain["parallel"]["pipeline"] = {"split": ["net.4"], "microbatches": 2, "schedule": "gpipe"}
    main, other = workers.run_ranks(2, warnings_of, [raw, plain], timeout=100)
    said, none = main
    assert len(said) == 1, said
    assert said[0].startswith(
        "BatchNorm under the pipeline: the model's BatchNorm layers (net.1) normalise each "
        "micro-batch of 4 samples with its own statistics"
    )
    assert none == [] and other == [[], []]
