"""The `phalanx` command end to end, in real processes: train, resume, eval, predict, ls, info,
--help, and bad input, which must end in one line on stderr, exit code 2 and no damage to runs.

Processes cost seconds each (importing torch), so runs are shared through module fixtures and the
bad-input commands run side by side.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import forks
import pytest
import torch
import toy
import yaml
from safetensors.torch import load_file

from phalanx import commands, config
from phalanx.trainer import Trainer

# a hang guard, with room for the module's fixtures of some 40 commands on a busy machine
pytestmark = pytest.mark.timeout(1500)

TESTS = Path(toy.__file__).parent
ENV = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TIMEOUT = 300  # a hang guard for one command

HOOKS = [
    {"ComputeStats": {"variables": ["loss"]}},
    "LogVariables",
    "WriteCSV",
    # mode max on a falling loss keeps the best at epoch 1, so best, latest and a middle
    # step are three different checkpoints
    {"SaveBest": {"variable": "valid.loss", "mode": "max"}},
    "SaveLatest",
]

BAD_PARTS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

import toy


class TupleData(toy.Regression):
    """Streams whose items are (x, y) tuples, not dicts."""

    def streams(self):
        return {name: TensorDataset(s.x, s.y) for name, s in super().streams().items()}


class Ragged(toy.Regression):
    """Training items whose `x` has 3 values, except sample 5's, which has 4."""

    def streams(self):
        streams = super().streams()
        streams["train"] = RaggedItems(streams["train"])
        return streams


class Wrapped(torch.utils.data.Dataset):
    """A stream's items as they are; subclasses change one thing of them."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class RaggedItems(Wrapped):
    def __getitem__(self, i):
        item = self.items[i]
        return {**item, "x": torch.cat([item["x"], item["x"][:1]])} if i == 5 else item


class MissingFile(toy.Regression):
    """A dataset whose constructor opens a file that is not there."""

    def __init__(self, **kwargs):
        open("/nonexistent/phalanx-tests/train.bin", "rb")


class NegativeLength(toy.Regression):
    """A training stream whose __len__ is -1."""

    def streams(self):
        streams = super().streams()
        streams["train"] = Negative(streams["train"])
        return streams


class Negative(Wrapped):
    def __len__(self):
        return -1


class NoLoss(nn.Module):
    """forward returns a prediction and no loss."""

    def __init__(self, features=3):
        super().__init__()
        self.net = nn.Linear(features, 1)

    def forward(self, x):
        return {"prediction": self.net(x).squeeze(-1)}
'''


def phalanx(*args: str, cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """`phalanx ARGS...` to its end, forked from a process that imported phalanx once (`forks`)."""
    return forks.run(list(args), cwd, ENV, timeout)


def phalanx_all(
    commands: dict[str, tuple[list[str], Path]], parallel: int = 3, timeout: float = TIMEOUT
) -> dict[str, subprocess.CompletedProcess]:
    """Run several commands side by side (at most `parallel` at once); results by key. A command
    still running `timeout` seconds after it started is taken for hung (a bound on each command,
    not on all of them: on a busy machine they take turns)."""
    pending, running, done = list(commands.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                key, (args, cwd) = pending.pop(0)
                running[key] = (args, forks.start(args, cwd, ENV), time.monotonic())
            for key, (args, proc, started) in list(running.items()):
                if proc.poll() is not None:
                    out, err = proc.communicate()
                    done[key] = subprocess.CompletedProcess(args, proc.returncode, out, err)
                    del running[key]
                elif time.monotonic() - started > timeout:
                    raise TimeoutError(f"{key} still running after {timeout} s: {args}")
            time.sleep(0.05)
    finally:
        for _, proc, _ in running.values():
            proc.kill()
            proc.communicate()
    return done


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under a folder, by relative path, with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def trace(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines()]


def metrics_rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))


def hand_losses(w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample squared errors on the test stream, computed by hand from toy.Linear weights."""
    items = toy.Regression().streams()["test"]
    prediction = items.x.double() @ w["net.weight"].double().T + w["net.bias"].double()
    return (prediction.squeeze(-1) - items.y.double()) ** 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One `phalanx train` of 3 epochs (15 steps) with overrides, shared by the tests below."""
    folder = tmp_path_factory.mktemp("cli")
    exp = folder / "exp"
    path = toy.write_config(exp, toy.regression_config(hooks=HOOKS))
    (exp / "badparts.py").write_text(BAD_PARTS)
    (exp / "latin1.yaml").write_bytes(path.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    (exp / "bomb.yaml").write_text(path.read_text() + ALIAS_BOMB)
    (exp / "deep.yaml").write_text("model: " + "[" * 100_000 + "]" * 100_000 + "\n")
    (exp / "syntax.yaml").write_text("name: toy\nmodel:\n  class: [toy.Linear\n  features: : 3\n")
    (folder / "a-file").write_text("an output_root below a file cannot be created\n")
    result = phalanx(
        "train", "config.yaml", "main_loop.epochs=3", "optimizer.lr=0.04", "name=cli", cwd=exp
    )
    assert result.returncode == 0, output(result)
    runs = sorted((exp / "runs").iterdir())
    assert len(runs) == 1, runs
    return SimpleNamespace(folder=folder, exp=exp, run=runs[0], result=result)


def copy_run(trained, name: str) -> Path:
    """A copy of the trained run (it still imports from the config's folder), for tests that change
    it."""
    target = trained.folder / "copies" / name / trained.run.name
    shutil.copytree(trained.run, target)
    return target


# --- train -------------------------------------------------------------------------------------


def test_train_creates_a_run_directory_with_the_resolved_config(trained):
    run = trained.run
    assert re.fullmatch(r"cli-\d{8}-\d{6}", run.name)
    for name in ("config.yaml", "log.txt", "metrics.csv", "trace.jsonl", "run.json"):
        assert (run / name).is_file(), name
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (
        saved["main_loop"]["epochs"] == 3
        and saved["optimizer"]["lr"] == 0.04
        and saved["name"] == "cli"
    )
    assert (
        saved["checkpoints"]["keep_last"] == 3 and saved["parallel"]["strategy"] == "auto"
    )  # defaults resolved
    assert saved["hooks"] == HOOKS
    assert config.validate(saved).main_loop.epochs == 3  # the saved config is itself valid
    assert [int(r["epoch"]) for r in metrics_rows(run)] == [1, 2, 3]
    events = trace(run)
    assert events[0]["event"] == "started" and events[-1] == {
        **events[-1],
        "event": "finished",
        "step": 15,
    }
    assert "epoch 3 (step 15)" in (run / "log.txt").read_text()
    assert str(run.name) in trained.result.stderr  # the run directory is announced


def test_train_checkpoints_have_manifests_matching_their_files(trained):
    root = trained.run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["best.json", "step-10", "step-15", "step-5"]
    for step in (5, 10, 15):
        folder = root / f"step-{step}"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["step"] == step
        assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "trainer.json"}
        for name, meta in manifest["files"].items():
            blob = (folder / name).read_bytes()
            assert meta == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        assert json.loads((folder / "trainer.json").read_text())["step"] == step
    assert json.loads((root / "best.json").read_text())["step"] == 5


# --- every other command, run side by side on the trained run --------------------------------

# Bad input: (id, command, words the error line must hold). RUN stands for a fresh copy of the
# trained run, NOTRUN for a folder that is not a run; train commands get an output_root of their
# own.
BAD = [
    ("misspelt-key", ["train", "config.yaml", "main_loop.epoch=3"], ["main_loop.epoch", "epochs"]),
    (
        "wrong-type",
        ["train", "config.yaml", "dataset.batch_size=abc"],
        ["dataset.batch_size", "abc"],
    ),
    ("class-does-not-import", ["train", "config.yaml", "model.class=nopkg.Linear"], ["nopkg"]),
    ("item-not-a-dict", ["train", "config.yaml", "dataset.class=badparts.TupleData"], ["dict"]),
    ("model-without-loss", ["train", "config.yaml", "model={class: badparts.NoLoss}"], ["loss"]),
    (
        "unknown-hook",
        ["train", "config.yaml", "hooks=[ComputeStats, SaveLatests]"],
        ["SaveLatests", "SaveLatest"],
    ),
    ("not-a-run-dir", ["resume", "NOTRUN"], ["not a run directory"]),
    ("resume-another-model", ["resume", "RUN", "model.hidden=4"], ["does not fit", "model"]),
    ("eval-another-model", ["eval", "RUN", "--stream", "test"], ["does not fit", "model"]),
    (
        "config-latin-1",
        ["train", "latin1.yaml"],
        ["latin1.yaml", "not UTF-8", "save the config as UTF-8"],
    ),
    (
        "output-root-not-writable",
        ["train", "config.yaml", "output_root=AFILE/runs"],
        ["a-file", "Not a directory", "output_root"],
    ),
    (
        "items-of-different-shapes",
        ["train", "config.yaml", "dataset.class=badparts.Ragged"],
        ["stream 'train', key 'x'", "different shapes", "[3]", "[4]"],
    ),
    (
        "empty-train-stream",
        ["train", "config.yaml", "dataset.n_train=0"],
        ["stream 'train'", "is empty"],
    ),
    (
        "yaml-alias-bomb",
        ["train", "bomb.yaml"],
        ["bomb.yaml", "more than 200,000 values", "aliases"],
    ),
    ("yaml-nested-deep", ["train", "deep.yaml"], ["deep.yaml", "nested more than 64 levels"]),
    (
        "yaml-syntax",
        ["train", "syntax.yaml"],
        ["syntax.yaml", "not valid YAML at line 4, column 11"],
    ),
    (
        "constructor-file-missing",
        ["train", "config.yaml", "dataset.class=badparts.MissingFile"],
        ["dataset: MissingFile", "FileNotFoundError", "fix the values in the dataset section"],
    ),
    (
        "stream-length-negative",
        ["train", "config.yaml", "dataset.class=badparts.NegativeLength"],
        ["stream 'train' of NegativeLength: len() failed", "__len__ must return"],
    ),
    (
        "loss-refuses-the-batch",
        [
            "train",
            "config.yaml",
            "model={class: torch.nn.Linear, in_features: 3, out_features: 2, inputs: {x: input}, "
            "loss: {function: cross_entropy, target: y}}",
        ],
        ["model.loss: cross_entropy(output 'output' of shape [8, 2]", "check model.loss"],
    ),
    (
        "loss-function-a-class",
        [
            "train",
            "config.yaml",
            "model={class: torch.nn.Linear, in_features: 3, out_features: 1, inputs: {x: input}, "
            "loss: {function: torch.nn.MSELoss, target: y}}",
        ],
        ["model.loss.function: torch.nn.MSELoss is a class"],
    ),
    (
        "init-from-checkpoint-word",
        ["train", "config.yaml", "model.init_from={path: elsewhere, checkpoint: newest}"],
        ["model.init_from.checkpoint", "best, latest, auto or a step number"],
    ),
    (
        "fraction-for-an-integer",
        ["train", "config.yaml", "model.hidden=2.5"],
        ["model: Linear's hidden takes an integer, got 2.5"],
    ),
    (
        "quoted-number-for-an-integer",
        ["train", "config.yaml", "model.hidden='8'"],
        ["model: Linear's hidden takes an integer, got the string '8'"],
    ),
    ("run-config-malformed", ["eval", "RUN"], ["config.yaml", "not valid YAML", "restore"]),
    ("run-json-malformed", ["resume", "RUN"], ["run.json", "not readable JSON", "restore"]),
    (
        "predict-output-a-directory",
        ["predict", "RUN", "--output", "RUN/predictions"],
        ["--output", "is a directory"],
    ),
    (
        "export-output-a-directory",
        ["export", "RUN", "--output", "RUN/predictions"],
        ["--output", "is a directory"],
    ),
    (
        "predict-output-of-no-kind",
        ["predict", "RUN", "--output", "RUN.json"],
        ["--output", "the name's ending says what to write", ".csv or .safetensors"],
    ),
    (
        "export-output-of-no-kind",
        ["export", "RUN", "--output", "RUN.txt"],
        ["--output", "the name's ending", ".safetensors or .keras or .weights.h5"],
    ),
    (
        "export-over-a-runs-file",
        ["export", "RUN", "--output", "RUN/run.json"],
        ["--output", "would write over what run", "(run.json)"],
    ),
    (
        "predict-into-the-checkpoints",
        ["predict", "RUN", "--output", "RUN/checkpoints/p.csv"],
        ["--output", "would write over what run", "checkpoints/p.csv", "outside the run"],
    ),
    (
        "export-no-such-step",
        ["export", "RUN", "--checkpoint", "99", "--output", "RUN.safetensors"],
        ["no checkpoint at step 99", "there are"],
    ),
]
# 1 KB of YAML that stands for 10**9 values: each level repeats the one before ten times
ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)
)
DAMAGE = {  # what a case writes into its copy of the run first
    "run-config-malformed": ("config.yaml", b"model: [toy.Linear\n"),
    "run-json-malformed": ("run.json", b'{"config_dir": "/somewhere", "cw'),
}
BAD_IDS = [case for case, _, _ in BAD]


def _bad_command(trained, case: str, args: list[str], runs: dict, before: dict) -> list[str]:
    args = [arg.replace("AFILE", str(trained.folder / "a-file")) for arg in args]
    if args[0] == "train" and not any(arg.startswith("output_root=") for arg in args):
        args.append(f"output_root={trained.folder / 'bad' / case}")
    if "RUN" in args:
        runs[case] = copy_run(trained, case)
        if case == "eval-another-model":  # as if the run's config had been edited by hand
            path = runs[case] / "config.yaml"
            saved = yaml.safe_load(path.read_text())
            saved["model"]["hidden"] = 4
            path.write_text(yaml.safe_dump(saved, sort_keys=False))
        if case in DAMAGE:
            name, content = DAMAGE[case]
            (runs[case] / name).write_bytes(content)
        args = [
            str(runs[case]) + arg[3:] if arg == "RUN" or arg.startswith("RUN/") else arg
            for arg in args
        ]
        if f"{runs[case]}/predictions" in args:  # an --output that is a directory
            (runs[case] / "predictions").mkdir()
    if "NOTRUN" in args:
        runs[case] = trained.folder / "not-a-run"
        runs[case].mkdir()
        (runs[case] / "notes.txt").write_text("a folder, but not a run\n")
        args[args.index("NOTRUN")] = str(runs[case])
    if case in runs:
        before[case] = snapshot(runs[case])
    return args


@pytest.fixture(scope="module")
def ran(trained):
    """eval, predict, ls, info, resume, a diverging run and every bad command, side by side."""
    run, exp, folder = trained.run, trained.exp, trained.folder
    runs, before = {}, {}
    commands = {
        f"eval-{which}": (["eval", str(run), "--stream", "test", "--checkpoint", which], exp)
        for which in ("best", "latest", "10")
    }
    commands["predict"] = (
        ["predict", str(run), "--stream", "test", "--output", str(folder / "pred.csv")],
        exp,
    )
    commands["export"] = (
        ["export", str(run), "--checkpoint", "10", "--output", str(folder / "model.safetensors")],
        exp,
    )
    commands["ls"] = (["ls", str(exp / "runs")], folder)
    commands["info"] = (["info"], folder)
    runs["resume"] = copy_run(trained, "resume")
    commands["resume"] = (["resume", str(runs["resume"]), "main_loop.epochs=5"], folder)
    commands["nan"] = (
        [
            "train",
            "config.yaml",
            "optimizer.lr=1e150",
            "main_loop.epochs=50",
            "hooks=[StopOnNaN, SaveLatest]",
            f"output_root={folder / 'nan'}",
        ],
        exp,
    )
    for case, args, _ in BAD:
        commands[case] = (_bad_command(trained, case, args, runs, before), exp)
    # --debug is offered after the subcommand and before it
    commands["debug"] = (
        [
            "train",
            "--debug",
            "config.yaml",
            "main_loop.epoch=3",
            f"output_root={folder / 'bad' / 'debug'}",
        ],
        exp,
    )
    commands["debug-first"] = (
        [
            "--debug",
            "train",
            "config.yaml",
            "main_loop.epoch=3",
            f"output_root={folder / 'bad' / 'debug-first'}",
        ],
        exp,
    )
    # flags and overrides in any order
    commands["intermixed"] = (
        [
            "train",
            "config.yaml",
            "--nnodes",
            "1",
            "main_loop.epochs=1",
            "--debug",
            "name=mixed",
            f"output_root={folder / 'mixed'}",
        ],
        exp,
    )
    results = phalanx_all(commands)
    return SimpleNamespace(
        results=results, runs=runs, before=before, bad=folder / "bad", **vars(trained)
    )


# --- eval, predict, ls, info, --help -----------------------------------------------------------


@pytest.mark.parametrize("which, step", [("best", 5), ("latest", 15), ("10", 10)])
def test_eval_prints_and_saves_the_metrics_of_a_checkpoint(ran, which, step):
    result = ran.results[f"eval-{which}"]
    assert result.returncode == 0, output(result)
    saved = json.loads((ran.run / f"eval-test-step-{step}.json").read_text())
    expected = hand_losses(weights(ran.run, step)).mean().item()
    assert saved == {
        "stream": "test",
        "checkpoint": step,
        "metrics": {"loss": pytest.approx(expected, rel=1e-12)},
    }
    assert f"{expected:.6g}" in output(result) and f"step {step}" in output(result)


def _predictions(ran) -> list[dict]:
    result = ran.results["predict"]
    assert result.returncode == 0, output(result)
    assert "wrote 10 rows" in output(result)
    with open(ran.folder / "pred.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_predict_writes_a_csv_row_per_sample(ran):
    rows = _predictions(ran)
    items = toy.Regression().streams()["test"]
    assert len(rows) == len(items) == 10
    assert {"index", "prediction", "loss", "y", "id"} <= set(rows[0])
    w = weights(ran.run, 5)  # --checkpoint defaults to best
    expected = (items.x.double() @ w["net.weight"].T + w["net.bias"]).squeeze(-1)
    losses = hand_losses(w)
    for i, row in enumerate(rows):
        assert float(row["index"]) == i and float(row["id"]) == i  # in dataset order
        assert float(row["prediction"]) == pytest.approx(expected[i].item(), rel=1e-5, abs=1e-6)
        assert float(row["loss"]) == pytest.approx(losses[i].item(), rel=1e-5, abs=1e-6)
        assert float(row["y"]) == pytest.approx(items.y[i].item(), rel=1e-6)


def test_predict_writes_integer_values_as_integers(ran):
    """Ids and class labels are integers; passing them through float32 prints 7 as 7.0 and changes
    ids above 2**24."""
    rows = _predictions(ran)
    assert [row["id"] for row in rows] == [str(i) for i in range(10)]


def test_export_writes_the_whole_model_for_plain_load_state_dict(ran):
    result = ran.results["export"]
    assert result.returncode == 0, output(result)
    assert f"wrote 2 tensors of {ran.run.name} at step 10" in output(result)
    exported = load_file(str(ran.folder / "model.safetensors"))
    model = toy.Linear(features=3)
    model.load_state_dict(exported)  # no phalanx: torch alone, strict
    for key, value in weights(ran.run, 10).items():
        assert torch.equal(exported[key], value)


def test_ls_lists_the_runs_with_status_and_best(ran):
    result = ran.results["ls"]
    assert result.returncode == 0, output(result)
    line = next(row for row in output(result).splitlines() if ran.run.name in row)
    assert "finished" in line and re.search(r"\b15\b", line)
    assert "valid.loss=" in line and "@ 5" in line


def test_ls_lists_a_run_whose_best_json_and_trace_are_damaged(trained):
    run = copy_run(trained, "ls-damaged")
    (run / "checkpoints" / "best.json").write_text('{"step": 5, "variable": "valid.lo')
    with open(run / "trace.jsonl", "a") as f:
        f.write('[1, 2]\n{"event": "epoch", "time": "yesterday"}\n{"tim')
    rows = commands.list_runs(str(run.parent))
    assert [(row["run"], row["status"], row["best"], row["latest"]) for row in rows] == [
        (run.name, "epoch", "best.json unreadable", 15)
    ]


def test_opening_a_run_logs_where_its_classes_are_imported_from(ran):
    for key in ("eval-best", "predict", "resume"):
        line = f"imports its classes from {ran.exp.resolve()} (as its run.json says)"
        assert line in ran.results[key].stderr, (key, ran.results[key].stderr)


def test_info_shows_versions_and_devices(ran):
    result = ran.results["info"]
    assert result.returncode == 0, output(result)
    text = output(result)
    assert torch.__version__ in text and "0.1.0" in text and "cpu cores" in text and "gloo" in text


@pytest.mark.parametrize("command", ["train", "resume", "eval", "predict", "ls", "info"])
def test_help_of_each_subcommand_shows_an_example(command, tmp_path):
    result = phalanx(command, "--help", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, output(result)
    assert "example" in result.stdout
    assert re.search(rf"^\s+phalanx {command}\b", result.stdout, re.M), result.stdout


# --- resume, a diverging run -------------------------------------------------------------------


def test_resume_continues_in_the_same_directory_as_one_uninterrupted_run(ran):
    run, result = ran.runs["resume"], ran.results["resume"]
    assert result.returncode == 0, output(result)
    assert list(run.parent.iterdir()) == [run]  # no new run directory
    assert [int(r["epoch"]) for r in metrics_rows(run)] == [1, 2, 3, 4, 5]
    assert yaml.safe_load((run / "config.yaml").read_text())["main_loop"]["epochs"] == 5
    events = trace(run)
    assert [e["event"] for e in events].count("started") == 2
    restart = max(i for i, e in enumerate(events) if e["event"] == "started")
    assert events[restart]["step"] == 15
    assert any(e["event"] == "overrides" and e["values"] == ["main_loop.epochs=5"] for e in events)
    assert events[-1]["event"] == "finished" and events[-1]["step"] == 25
    assert "resuming" in (run / "log.txt").read_text()
    # the same weights as 5 epochs in one go
    raw = toy.regression_config(main_loop={"epochs": 5}, optimizer={"lr": 0.04})
    reference = Trainer(config.validate(raw), None, [TESTS], hooks=[])
    assert reference.run() == 0
    for name, value in weights(run, 25).items():
        torch.testing.assert_close(value, reference.module.state_dict()[name], rtol=1e-12, atol=0)


def test_a_nan_loss_fails_the_process_with_exit_code_1(ran):
    result = ran.results["nan"]
    assert result.returncode == 1, output(result)
    [run] = list((ran.folder / "nan").iterdir())
    assert trace(run)[-1]["event"] == "failed"
    assert "StopOnNaN" in result.stderr


def test_flags_and_overrides_come_in_any_order(ran):
    result = ran.results["intermixed"]
    assert result.returncode == 0, output(result)
    [run] = (ran.folder / "mixed").iterdir()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert run.name.startswith("mixed-") and saved["main_loop"]["epochs"] == 1


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case, words", [(c, w) for c, _, w in BAD], ids=BAD_IDS)
def test_bad_input_is_one_error_line_and_exit_code_2(ran, case, words):
    result = ran.results[case]
    assert result.returncode == 2, output(result)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1, result.stderr  # informational log lines aside, one line: the error
    assert lines[0].startswith("phalanx: error: ")
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_input_loses_and_leaves_nothing(ran, case):
    if case in ran.before:
        assert snapshot(ran.runs[case]) == ran.before[case]
    else:
        out = ran.bad / case
        left = sorted(p.name for p in out.iterdir()) if out.exists() else []
        assert left == [], f"a failed train left {left} in {out}"


@pytest.mark.parametrize("case", ["debug", "debug-first"])
def test_debug_shows_the_traceback(ran, case):
    """`phalanx train --debug ...` and `phalanx --debug train ...`: both forms are in --help."""
    result = ran.results[case]
    assert result.returncode not in (0, 2), output(result)
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError" in result.stderr and "main_loop.epoch" in result.stderr


BROKEN = '''
import toy


class Flaky:
    """The training stream, but its item 5 cannot be read."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if i == 5:
            raise RuntimeError("item 5 is corrupt")
        return self.items[i]


class Broken(toy.Regression):
    def streams(self):
        streams = super().streams()
        return {**streams, "train": Flaky(streams["train"])}
'''


def test_an_error_the_users_code_raises_shows_that_codes_frames_alone(tmp_path):
    """A dataset whose item raises in training: the user's frames and the error, exit 1; phalanx's
    and torch's frames are left out of the terminal, not out of the run's log, and --debug shows
    them all."""
    (tmp_path / "broken.py").write_text(BROKEN)
    raw = toy.regression_config(dataset={"class": "broken.Broken", "batch_size": 8})
    toy.write_config(tmp_path, raw)
    result = phalanx("train", "config.yaml", cwd=tmp_path)
    assert result.returncode == 1, output(result)
    said = result.stderr[result.stderr.index("phalanx: error: ") :]
    assert said.startswith("phalanx: error: your code raised this (--debug shows the whole")
    line = next(i for i, text in enumerate(BROKEN.splitlines(), 1) if "raise Runtime" in text)
    assert f'File "{tmp_path / "broken.py"}", line {line}, in __getitem__' in said
    assert said.rstrip().endswith("RuntimeError: item 5 is corrupt")
    assert "Traceback" not in said and "phalanx/" not in said and "site-packages" not in said
    runs = list((tmp_path / "runs").iterdir())
    log = (runs[0] / "log.txt").read_text()
    assert "Traceback (most recent call last)" in log and "phalanx/trainer.py" in log
    debug = phalanx("train", "config.yaml", "--debug", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_a_resume_its_workers_refuse_leaves_the_run_as_it_was(tmp_path):
    """On two processes, a resume whose model the checkpoints do not fit: one error line, exit 2,
    and the run directory as it was (no failed event, log line or stacks), as on one process."""
    toy.write_config(tmp_path, toy.regression_config())
    assert phalanx("train", "config.yaml", cwd=tmp_path).returncode == 0
    [run] = list((tmp_path / "runs").iterdir())
    before = snapshot(run)
    result = phalanx(
        "resume",
        str(run),
        "main_loop.epochs=4",
        "parallel.devices=2",
        "parallel.strategy=ddp",
        "model.hidden=7",
        cwd=tmp_path,
    )
    assert result.returncode == 2, output(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error: ")]
    assert len(errors) == 1 and "fits the model its config builds" in errors[0], result.stderr
    assert snapshot(run) == before
    assert trace(run)[-1]["event"] == "finished"
