"""A job on several machines: the command line's checks, and what a node says when it cannot serve
or reach the rendezvous (the two-machine run itself: tests/e2e/test_multidevice.py)."""

from __future__ import annotations

import socket
import time

import pytest
import toy

from phalanx import cli, launch
from phalanx.errors import PhalanxError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--nnodes", "2"],
            "--nnodes 2 needs --node-rank (this machine's, 0 .. 1) and --rdzv HOST:PORT",
        ),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1"],
            "--node-rank 2 is not among 0 .. 1",
        ),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv", "h"], "--rdzv 'h' is not HOST:PORT"),
        (
            ["--nnodes", "2", "--node-rank", "0", "--rdzv", "h:99999"],
            "--rdzv 'h:99999' is not HOST:PORT",
        ),
        (
            ["--rdzv", "h:1"],
            "--node-rank and --rdzv are for a job on several machines; give --nnodes too",
        ),
        (["--nnodes", "0"], "--nnodes '0' is not a machine count (such as 2) or MIN:MAX"),
        (
            ["--nnodes", "3:2", "--node-rank", "0", "--rdzv", "h:1"],
            "--nnodes '3:2' is not a machine count",
        ),
    ],
)
def test_node_flags_that_do_not_make_a_job_are_one_line_errors(flags, message, tmp_path, capsys):
    path = toy.write_config(tmp_path, toy.regression_config())
    assert cli.main(["train", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_strategy_of_one_process_is_refused_on_several_machines(tmp_path, capsys):
    path = toy.write_config(
        tmp_path,
        toy.regression_config(parallel={"accelerator": "cpu", "devices": 2, "strategy": "towers"}),
    )
    assert (
        cli.main(["train", str(path), "--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:1"])
        == 2
    )
    assert "parallel.strategy=towers runs in one process, but --nnodes 2" in capsys.readouterr().err


def test_restarts_need_an_elastic_job_and_an_elastic_job_needs_restarts(tmp_path, capsys):
    fixed = toy.write_config(
        tmp_path / "fixed",
        toy.regression_config(parallel={"accelerator": "cpu", "max_restarts": 2}),
    )
    assert (
        cli.main(
            ["train", str(fixed), "--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:1"]
        )
        == 2
    )
    assert "a job on a fixed number of machines cannot restart" in capsys.readouterr().err
    elastic = toy.write_config(tmp_path / "elastic", toy.regression_config())
    assert (
        cli.main(
            ["train", str(elastic), "--nnodes", "1:2", "--node-rank", "0", "--rdzv", "127.0.0.1:1"]
        )
        == 2
    )
    assert "an elastic job (--nnodes MIN:MAX) restarts its workers" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_that_cannot_reach_node_0_says_so_within_its_timeout():
    started = time.monotonic()
    with pytest.raises(
        PhalanxError, match=r"node 1 cannot reach node 0 at 127.0.0.1:\d+ within 2 s"
    ):
        launch.join(launch.Nodes(2, 1, "127.0.0.1", _free_port()), timeout_s=2)
    assert time.monotonic() - started < 20


def test_node_0_serves_only_an_address_of_its_own_and_a_free_port():
    with pytest.raises(PhalanxError, match="node 0 cannot serve the rendezvous on 192.0.2.1"):
        launch.join(
            launch.Nodes(2, 0, "192.0.2.1", _free_port())
        )  # TEST-NET-1: no machine's address
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PhalanxError, match=f"on 127.0.0.1:{port} .*a free port"):
            launch.join(launch.Nodes(2, 0, "127.0.0.1", port))
