"""A job on several machines: the command line's checks, and what a node says when it cannot serve
or reach the rendezvous (the two-machine run itself: tests/e2e/test_multidevice.py)."""

from __future__ import annotations

import socket
import threading

import pytest
import toy

from phalanx import cli, nodes
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
    # a join that ignored the 2 s would wait out the test's 60 s timeout
    with pytest.raises(
        PhalanxError, match=r"node 1 cannot reach node 0 at 127.0.0.1:\d+ within 2 s"
    ):
        nodes.join(nodes.Nodes(2, 1, "127.0.0.1", _free_port()), timeout_s=2)


def _another_service() -> int:
    """A port where something that is not a store answers (an HTTP server's refusal)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            peer, _ = server.accept()
            with peer:
                peer.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


@pytest.mark.parametrize("there", ["nothing", "another service"])
def test_a_node_pointed_at_a_wrong_rendezvous_says_so_in_lines_of_its_own(
    there, capfd, caplog, monkeypatch
):
    """torch's store client prints its C++ stack for every try (hundreds of lines a minute): the
    terminal gets phalanx's warning and error alone, which name the address, the timeout and the
    fix."""
    monkeypatch.setattr(nodes, "SAY_AFTER_S", 0)
    port = _free_port() if there == "nothing" else _another_service()
    with pytest.raises(PhalanxError) as info:
        nodes.join(nodes.Nodes(2, 1, "127.0.0.1", port), timeout_s=2)
    assert str(info.value).startswith(f"node 1 cannot reach node 0 at 127.0.0.1:{port} within 2 s")
    assert str(info.value).endswith(
        "start node 0 with the same --rdzv, and check that this machine reaches that address"
    )
    said = capfd.readouterr().err
    assert "frame #" not in said and "c10d" not in said and "TCPStore" not in said, said
    [warning] = [r.getMessage() for r in caplog.records if r.name == "phalanx"]
    state = (
        "nothing answers at"
        if there == "nothing"
        else "what answers at 127.0.0.1:{port} is not node 0's rendezvous"
    )
    assert f"node 1: {state.format(port=port)}" in warning
    assert f"is node 0 started with --rdzv 127.0.0.1:{port}" in warning
    assert "Trying again until 2 s have passed" in warning


def test_node_0_serves_only_an_address_of_its_own_and_a_free_port():
    with pytest.raises(PhalanxError, match="node 0 cannot serve the rendezvous on 192.0.2.1"):
        nodes.join(nodes.Nodes(2, 0, "192.0.2.1", _free_port()))  # TEST-NET-1: no machine's address
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PhalanxError, match=f"on 127.0.0.1:{port} .*a free port"):
            nodes.join(nodes.Nodes(2, 0, "127.0.0.1", port))


# --- two launchers, as two machines would start them ---------------------------------------------


def _node(path, rank: int, rdzv: str, *extra: str, nnodes: int = 2):
    from procs import start

    return start(
        "train",
        str(path),
        *extra,
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(rank),
        "--rdzv",
        rdzv,
        cwd=path.parent,
    )


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("phalanx: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.timeout(400)
def test_a_node_started_with_another_config_or_node_count_fails_every_node(tmp_path):
    """Node 1 with an override node 0 lacks (it used to train with node 0's config, silently), or
    with another --nnodes (both used to go on past the end of training): one line on each node
    that names the difference, and no run directory."""
    from procs import finish

    path = toy.write_config(tmp_path, toy.regression_config(parallel={"accelerator": "cpu"}))
    for extra, nnodes, said in (
        (["optimizer.lr=0.5"], 2, "optimizer.lr: node 0 0.05, node 1 0.5"),
        ([], 3, "node 0: --nnodes 2, node 1: --nnodes 3"),
    ):
        rdzv = f"127.0.0.1:{_free_port()}"
        both = [_node(path, 0, rdzv), _node(path, 1, rdzv, *extra, nnodes=nnodes)]
        results = [finish(proc, timeout=180) for proc in both]
        for result in results:
            assert result.returncode == 2, result.stderr
            line = _error_line(result.stderr)
            assert line.startswith("phalanx: error: the nodes were started with different")
            assert said in line
        assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(400)
def test_a_node_waiting_for_the_others_says_so_and_a_signal_ends_the_wait_at_once(tmp_path):
    """Node 1 pointed at an address where nothing answers says so within seconds; node 0 waiting
    for a node that never comes says what it waits for; a signal ends either wait at once (it used
    to be ignored until torch's 600 s timeout), leaving nothing."""
    import signal

    from procs import wait_until

    path = toy.write_config(tmp_path, toy.regression_config(parallel={"accelerator": "cpu"}))
    lost = _node(path, 1, f"127.0.0.1:{_free_port()}")
    lonely = _node(path, 0, f"127.0.0.1:{_free_port()}")
    said: dict[int, list[str]] = {0: [], 1: []}
    for rank, proc in ((0, lonely), (1, lost)):  # each one's stderr, read as it comes
        threading.Thread(
            target=lambda p=proc, r=rank: said[r].extend(p.stderr), daemon=True
        ).start()

    def says(rank: int, words: str) -> bool:
        return any(words in line for line in list(said[rank]))

    wait_until(
        lambda: says(1, "nothing answers at 127.0.0.1:"),
        lost,
        timeout=180,
        what="node 1 to say that nothing answers",
    )
    wait_until(
        lambda: says(0, "waiting for node 1 to join"),
        lonely,
        timeout=180,
        what="node 0 to say what it waits for",
    )
    # at once, not after the nodes' 600 s wait
    for proc, signum in ((lost, signal.SIGINT), (lonely, signal.SIGTERM)):
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == 128 + signum
    assert says(1, "is node 0 started with --rdzv")
    assert not says(1, "frame #")  # torch's store client's C++ stack, every try: held back
    assert not (tmp_path / "runs").exists()
