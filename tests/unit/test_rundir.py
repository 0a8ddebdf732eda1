"""The run directory's own files read back: a damaged run.json or config.yaml is one RunDirError
naming the file and the fix, the trace skips lines that are not events, and opening a run says
where its classes will be imported from."""

from __future__ import annotations

import json
import logging

import pytest

from phalanx import commands, rundir
from phalanx.errors import RunDirError, StorageError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "toy-20260101-120000"
    folder.mkdir()
    (folder / rundir.CONFIG).write_text("name: toy\nseed: 0\n")
    (folder / rundir.META).write_text(
        json.dumps({"config_dir": str(tmp_path / "exp"), "cwd": str(tmp_path)})
    )
    return folder


def test_opening_a_run_logs_the_folders_its_classes_are_imported_from(
    run, tmp_path, caplog, monkeypatch
):
    # `logs.setup` (run by other tests in this process) turns propagation off; caplog listens on
    # root
    monkeypatch.setattr(logging.getLogger("phalanx"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="phalanx"):
        assert rundir.open_run(run) == run
    assert (
        f"imports its classes from {tmp_path / 'exp'}, then {tmp_path} (as its run.json says)"
        in caplog.text
    )


@pytest.mark.parametrize(
    "removed, said",
    [
        (["config.yaml"], "it has no config.yaml)"),
        (["run.json"], "it has no run.json)"),
        (["config.yaml", "run.json"], "it has no config.yaml and no run.json)"),
    ],
)
def test_a_folder_that_is_not_a_run_names_what_it_lacks(run, removed, said):
    for name in removed:
        (run / name).unlink()
    with pytest.raises(RunDirError) as info:
        rundir.open_run(run)
    assert str(info.value) == (
        f"{str(run)!r} is not a run directory ({said}; `phalanx ls` lists the runs"
    )


@pytest.mark.parametrize("removed", [["config.yaml"], ["run.json"], ["config.yaml", "run.json"]])
def test_a_run_that_trained_and_lost_its_own_file_is_told_to_restore_it(run, removed):
    """A folder with a trace or checkpoints is a run: the fix is its missing file, not another
    folder."""
    (run / rundir.TRACE).write_text('{"event": "started"}\n')
    for name in removed:
        (run / name).unlink()
    with pytest.raises(RunDirError) as info:
        rundir.open_run(run)
    assert str(info.value).startswith(
        f"{str(run)!r} is a run directory without its {' and '.join(removed)}, which phalanx "
        "reads to open it; restore"
    )


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("run.json", b'{"config_dir": "/x"', "not readable JSON"),
        ("run.json", b'{"config_dir": "/x"}', "does not name the folders config_dir and cwd"),
        ("run.json", b"[1, 2]", "does not name the folders"),
        ("run.json", b"\xff\xfe\x00binary", "not readable JSON"),
        ("config.yaml", b"model: [toy.Linear\n", "not valid YAML"),
        ("config.yaml", b"- a\n- b\n", "holds a list, not a config"),
        ("config.yaml", "name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ],
    ids=[
        "json-truncated",
        "json-a-key-missing",
        "json-not-a-mapping",
        "json-binary",
        "yaml-not-yaml",
        "yaml-a-list",
        "yaml-latin-1",
    ],
)
def test_a_damaged_run_file_names_itself_and_the_fix(run, name, content, words):
    (run / name).write_bytes(content)
    with pytest.raises(RunDirError) as info:
        rundir.load_config_text(rundir.open_run(run))
    message = str(info.value)
    assert str(run / name) in message and words in message and f"restore {name}" in message
    assert "\n" not in message


def test_the_trace_skips_lines_that_are_not_events(run):
    rundir.trace(run, "started", step=0)
    with open(run / rundir.TRACE, "a") as f:
        f.write('[1, 2]\n{"step": 3}\n{"event": "epo')
    assert [e["event"] for e in rundir.read_trace(run)] == ["started"]


def test_an_event_after_a_line_cut_short_is_kept(run):
    rundir.trace(run, "started", step=0)
    with open(run / rundir.TRACE, "a") as f:
        f.write('{"event": "epo')  # a crash in the middle of a line
    rundir.trace(run, "interrupted", step=3)
    assert [e["event"] for e in rundir.read_trace(run)] == ["started", "interrupted"]


def test_a_trace_that_cannot_be_written_is_one_error_naming_it(run):
    (run / rundir.TRACE).mkdir()  # as unwritable as a full disk, without filling one
    with pytest.raises(StorageError, match="trace.jsonl"):
        rundir.trace(run, "started")


def test_the_saved_config_lists_the_hooks_that_run_where_the_config_lists_none(tmp_path):
    import toy
    import yaml

    from phalanx import config
    from phalanx.hooks import build_hooks

    raw = toy.regression_config(main_loop={"epochs": 1, "extra_streams": ["valid"]})
    del raw["hooks"]
    cfg = config.validate({**raw, "output_root": str(tmp_path / "runs")})
    run_dir = rundir.create(cfg, None)
    saved = yaml.safe_load((run_dir / rundir.CONFIG).read_text())["hooks"]
    names = [spec if isinstance(spec, str) else next(iter(spec)) for spec in saved]
    assert names == [type(hook).__name__ for hook in build_hooks(cfg, [])]
    assert "SaveBest" in names  # the default list's, with valid among the extra streams
    # what a resume of the run builds from its config
    again = build_hooks(config.validate(rundir.load_config_text(run_dir)), [])
    assert [type(hook).__name__ for hook in again] == names


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than json's parser recurses


def test_a_line_nested_too_deep_is_skipped_as_any_that_is_no_event(run):
    rundir.trace(run, "started", step=0)
    with open(run / rundir.TRACE, "a") as f:
        f.write(DEEP + "\n" + '{"event": ' * 200 + '"x"' + "}" * 200 + "\n")
    rundir.trace(run, "finished", step=3)
    assert [e["event"] for e in rundir.read_trace(run)] == ["started", "finished"]


def test_ls_lists_a_run_whose_files_are_crafted_beside_the_others(run, tmp_path):
    """A trace line and best.json nested too deep, a time no clock can show, a best value too
    large for a float: the run is listed with what can be read, and so are the others."""
    other = tmp_path / "toy-20260101-130000"
    other.mkdir()
    for name in (rundir.CONFIG, rundir.META):
        (other / name).write_bytes((run / name).read_bytes())
    rundir.trace(other, "finished", epoch=2, step=10)
    rundir.trace(run, "started", epoch=0, step=0)
    with open(run / rundir.TRACE, "a") as f:
        f.write(DEEP + "\n" + json.dumps({"event": "epoch", "epoch": [1], "time": 1e300}) + "\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "best.json").write_text(DEEP)
    assert commands.list_runs(str(tmp_path))[0]["best"] == "best.json unreadable"
    (run / "checkpoints" / "best.json").write_text(
        json.dumps({"variable": "valid.loss", "value": 10**400, "step": 5})
    )
    rows = commands.list_runs(str(tmp_path))
    assert [(r["run"], r["status"], r["epoch"], r["best"], r["updated"]) for r in rows] == [
        (run.name, "epoch", "", "best.json unreadable", ""),
        (other.name, "finished", 2, "", rows[1]["updated"]),
    ]
    assert rows[1]["updated"]


def test_ls_of_a_folder_that_is_not_there_says_so(tmp_path, capsys):
    assert commands.list_runs(str(tmp_path / "nope")) == []
    assert "(there is no such folder)" in capsys.readouterr().out
    assert commands.list_runs(str(tmp_path)) == []
    assert "no such folder" not in capsys.readouterr().out
    (tmp_path / "a-file").write_text("")
    assert commands.list_runs(str(tmp_path / "a-file")) == []
    assert "(it is a file)" in capsys.readouterr().out
