"""WriteMLflow and WriteWandb, offline: MLflow's local file store and W&B's offline files hold the
run's resolved config, every epoch variable at its step (the numbers metrics.csv has), and how the
run ended; a resumed run continues the same tracker run. A missing package is a one-line error."""

from __future__ import annotations

import csv
import importlib.util
import json
import signal
import socket
import threading
import time
from pathlib import Path

import procs
import pytest
import toy
from procs import run as phalanx_cli

import phalanx
from phalanx.errors import ConfigError
from phalanx.hooks import Hook, TrainingTerminated

pytestmark = pytest.mark.timeout(180)


def _raw(tmp_path: Path, tracker: dict, epochs: int = 2) -> dict:
    raw = toy.regression_config(
        main_loop={"epochs": epochs, "extra_streams": ["valid"]},
        parallel={"accelerator": "cpu"},
        output_root=str(tmp_path / "runs"),
    )
    raw["hooks"] = [{"ComputeStats": {"variables": ["loss"]}}, "WriteCSV", "SaveLatest", tracker]
    return raw


def _csv(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


class Fail(Hook):
    def after_epoch(self, epoch, epoch_data):
        raise TrainingTerminated("the test fails the run", success=False)


# --- MLflow ------------------------------------------------------------------------------------


def test_mlflow_file_store_holds_the_config_the_variables_and_the_end(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"  # where it is by default
    tracker = {"WriteMLflow": {"experiment": "toy", "every_n_steps": 2}}
    run = phalanx.fit(_raw(tmp_path, tracker), model=toy.Linear(), dataset=toy.Regression())
    assert run.code == 0
    client = MlflowClient(tracking_uri=store)
    [found] = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == run.run_dir.name
    assert found.data.tags["phalanx.run_dir"] == str(run.run_dir.resolve())
    assert (
        found.data.params["optimizer.lr"] == "0.05"
        and found.data.params["dataset.batch_size"] == "8"
    )
    assert found.data.params["model.class"] == "toy.Linear"
    rows = _csv(run.run_dir)
    for name in ("train.loss", "valid.loss"):
        history = client.get_metric_history(found.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [
            (int(r["step"]), pytest.approx(float(r[name]), rel=1e-12)) for r in rows
        ]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train.step_loss")] == [
        2,
        4,
        6,
        8,
        10,
    ]
    [artifact] = (tmp_path / "runs" / "mlartifacts").glob(
        f"{found.info.run_id}/artifacts/config.yaml"
    )
    assert "optimizer:" in artifact.read_text() and "lr: 0.05" in artifact.read_text()
    assert not (tmp_path / "mlruns").exists()  # nothing in the working directory


def test_mlflow_run_continues_on_resume_and_records_failure(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = {"WriteMLflow": {"tracking_uri": store}}
    first = phalanx.fit(
        _raw(tmp_path, tracker),
        model=toy.Linear(),
        dataset=toy.Regression(),
        hooks=[phalanx.hooks.StopAfter(epochs=1)],
    )
    resumed = phalanx.resume(
        first.run_dir,
        overrides=["main_loop.epochs=3"],
        model=toy.Linear(),
        dataset=toy.Regression(),
    )
    assert resumed.code == 0
    client = MlflowClient(tracking_uri=store)
    [found] = client.search_runs(
        [client.get_experiment_by_name("phalanx").experiment_id]
    )  # one run, continued
    assert found.info.status == "FINISHED"
    epochs = [m.value for m in client.get_metric_history(found.info.run_id, "epoch")]
    assert epochs == [1.0, 2.0, 3.0]

    failed = phalanx.fit(
        _raw(tmp_path, tracker), model=toy.Linear(), dataset=toy.Regression(), hooks=[Fail()]
    )
    assert failed.code == 1
    statuses = {
        r.info.run_name: r.info.status
        for r in client.search_runs([client.get_experiment_by_name("phalanx").experiment_id])
    }
    assert statuses[failed.run_dir.name] == "FAILED"


def test_mlflow_on_two_processes_is_one_run_written_by_the_main_one(tmp_path):
    from mlflow import MlflowClient

    raw = _raw(tmp_path, {"WriteMLflow": {"every_n_steps": 0}})
    raw["parallel"] = {"accelerator": "cpu", "devices": 2}
    result = phalanx_cli("train", str(toy.write_config(tmp_path, raw)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("phalanx").experiment_id])
    assert found.info.status == "FINISHED"
    [run_dir] = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("toy-")]
    rows = _csv(run_dir)
    history = client.get_metric_history(found.info.run_id, "valid.loss")
    assert [(m.step, m.value) for m in history] == [
        (int(r["step"]), pytest.approx(float(r["valid.loss"]), rel=1e-12)) for r in rows
    ]


def test_a_tracker_that_cannot_start_is_one_error_and_one_that_fails_later_is_left(
    tmp_path, monkeypatch, caplog
):
    from phalanx.hooks import WriteMLflow

    monkeypatch.chdir(tmp_path)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the database's folder would be")
    tracker = {"WriteMLflow": {"tracking_uri": f"sqlite:///{blocked / 'mlflow.db'}"}}
    with pytest.raises(
        ConfigError, match="WriteMLflow: the tracker could not start a run .*remove the hook"
    ):
        phalanx.fit(_raw(tmp_path, tracker), model=toy.Linear(), dataset=toy.Regression())

    class Flaky(WriteMLflow):
        def _log(self, values, step):
            if step > 5:
                raise ConnectionError("the server went away")
            super()._log(values, step)

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = phalanx.fit(
        _raw(tmp_path, "WriteCSV", epochs=3),
        model=toy.Linear(),
        dataset=toy.Regression(),
        hooks=[Flaky(tracking_uri=store, every_n_steps=0)],
    )
    assert run.code == 0 and len(_csv(run.run_dir)) == 3  # training went on
    log_text = (run.run_dir / "log.txt").read_text()
    assert log_text.count("the tracker failed (ConnectionError: the server went away)") == 1


class _SilentServer:
    """A socket on loopback that takes connections, reads what they send and never answers (a hung
    tracking server); `asked` is set once an HTTP request has arrived."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.port = self.socket.getsockname()[1]
        self.asked = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self._held.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        try:
            if connection.recv(4096):
                self.asked.set()
        except OSError:
            pass

    def close(self) -> None:
        self.socket.close()
        for connection in self._held:
            connection.close()


def test_an_mlflow_server_that_is_not_there_is_one_line_within_seconds(tmp_path):
    """Nothing listens at the tracking_uri's port: said in one line, naming the address, instead
    of MLflow's minutes of retries; nothing is left of the run."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there
    uri = f"http://127.0.0.1:{port}"
    raw = _raw(tmp_path, {"WriteMLflow": {"tracking_uri": uri}})
    # MLflow's own retries would outlast `timeout`
    result = phalanx_cli("train", str(toy.write_config(tmp_path, raw)), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"phalanx: error: WriteMLflow: nothing answers at 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_signal_while_the_tracker_waits_for_its_server_ends_the_run_at_once(tmp_path):
    """A server that takes the connection and never answers holds MLflow's first request; Ctrl-C
    then ends the command at once (not after the request's timeout, made 10 minutes here), and the
    run directory, which has no checkpoint, is removed."""
    server = _SilentServer()
    try:
        uri = f"http://127.0.0.1:{server.port}"
        raw = _raw(tmp_path, {"WriteMLflow": {"tracking_uri": uri}})
        proc = procs.start(
            "train",
            str(toy.write_config(tmp_path, raw)),
            cwd=tmp_path,
            env={"MLFLOW_HTTP_REQUEST_TIMEOUT": "600"},
        )
        runs = tmp_path / "runs"
        started = lambda: any(  # noqa: E731
            '"started"' in p.read_text() for p in runs.glob("*/trace.jsonl")
        )
        procs.wait_until(started, proc, what="the run's start")
        procs.wait_until(server.asked.is_set, proc, what="MLflow's request")
        proc.send_signal(signal.SIGINT)
        result = procs.finish(proc, timeout=120)
    finally:
        server.close()
    assert result.returncode == 130, result.stderr
    assert "phalanx: interrupted" in result.stderr and "Traceback" not in result.stderr
    assert "finishing the current step" not in result.stderr
    assert not any(runs.iterdir())  # nothing trained, nothing kept


# --- W&B ---------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The records of a W&B offline file: a 7-byte header, then LevelDB-log records in 32 KiB blocks
    (crc 4, length 2, type 1: full, first, middle, last), each a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # the end of a block: padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _wandb(run_dir: Path) -> tuple[dict, list[dict], int | None]:
    """The config, the history rows and the exit code of the offline runs in a run directory."""
    config, history, code = {}, [], None
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                history.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
            elif kind == "exit":
                code = record.exit.exit_code
    return config, history, code


def _wandb_ended(run_dir: Path) -> tuple[dict, list[dict], int | None]:
    """`_wandb` once the files hold their exit record. W&B's own process writes them: a run's
    `finish` returns once that process has taken the exit, and tells it to close the file without
    waiting (a loaded machine once read a file before its exit record was in it)."""
    deadline = time.monotonic() + 60
    while (found := _wandb(run_dir))[2] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_wandb_offline_files_hold_the_config_the_variables_and_the_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = {"WriteWandb": {"mode": "offline", "project": "toy", "every_n_steps": 0}}
    run = phalanx.fit(_raw(tmp_path, tracker), model=toy.Linear(), dataset=toy.Regression())
    assert run.code == 0
    config, history, code = _wandb_ended(run.run_dir)
    assert code == 0
    assert config["optimizer"]["lr"] == 0.05 and config["model"]["class"] == "toy.Linear"
    rows = _csv(run.run_dir)
    got = [(h["_step"], h["epoch"], h["train/loss"], h["valid/loss"]) for h in history]
    assert got == [
        (
            int(r["step"]),
            int(r["epoch"]),
            pytest.approx(float(r["train.loss"]), rel=1e-12),
            pytest.approx(float(r["valid.loss"]), rel=1e-12),
        )
        for r in rows
    ]

    failed = phalanx.fit(
        _raw(tmp_path, tracker), model=toy.Linear(), dataset=toy.Regression(), hooks=[Fail()]
    )
    assert failed.code == 1 and _wandb_ended(failed.run_dir)[2] == 1


def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = {"WriteWandb": {"mode": "offline"}}
    first = phalanx.fit(
        _raw(tmp_path, tracker),
        model=toy.Linear(),
        dataset=toy.Regression(),
        hooks=[phalanx.hooks.StopAfter(epochs=1)],
    )
    phalanx.resume(first.run_dir, model=toy.Linear(), dataset=toy.Regression())
    ids = {
        p.name.split("-")[3] for p in first.run_dir.glob("wandb/offline-run-*")
    }  # offline-run-TIME-ID[-N]
    assert len(ids) == 1  # the resumed part is the same W&B run
    _, history, code = _wandb_ended(first.run_dir)
    assert [h["epoch"] for h in history] == [1, 2] and code == 0


# --- missing packages --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hook, package", [("WriteMLflow", "mlflow-skinny sqlalchemy alembic"), ("WriteWandb", "wandb")]
)
def test_a_tracker_without_its_package_is_an_error_naming_it(tmp_path, monkeypatch, hook, package):
    real = importlib.util.find_spec
    module = "mlflow" if hook == "WriteMLflow" else "wandb"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=f"{hook} needs the {module} package.*pip install {package}"
    ):
        phalanx.fit(_raw(tmp_path, hook), model=toy.Linear(), dataset=toy.Regression())
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
