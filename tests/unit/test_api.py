"""phalanx from Python: `fit` with a config file or a dict, and a model, dataset and hooks given as
objects, trains exactly what `phalanx train` trains; `resume` continues such a run; `load` gives the
model back. The command is written on these functions, so `phalanx train` is tested with it."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
import toy
import yaml
from procs import run as phalanx_cli
from safetensors.torch import load_file

import phalanx
from phalanx import rundir
from phalanx.checkpoint import Checkpoints
from phalanx.errors import ConfigError, DataError, ModelError, PhalanxError, RunDirError
from phalanx.hooks import Hook, StopAfter

pytestmark = pytest.mark.timeout(180)


def _raw(**more) -> dict:
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        optimizer={"class": "AdamW", "lr": 0.01, "warmup_steps": 2},
        dataset={"class": "toy.Regression", "batch_size": 8, "n_train": 37},
        parallel={"accelerator": "cpu"},
    )
    raw["hooks"] = [
        {"ComputeStats": {"variables": ["loss"]}},
        "WriteCSV",
        "SaveLatest",
        {"SaveBest": {"variable": "valid.loss", "mode": "min"}},
    ]
    return {**raw, **more}


def _objects() -> tuple[torch.nn.Module, dict]:
    """The config's model and dataset, built as the trainer builds them: from the config's seed."""
    torch.manual_seed(0)
    streams = toy.Regression(n_train=37).streams()
    return toy.Linear(features=3, hidden=4), {"train": streams["train"], "valid": streams["valid"]}


def _latest(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoints = Checkpoints(run_dir / "checkpoints")
    return load_file(checkpoints.path(checkpoints.select("latest")) / "model.safetensors")


class Record(Hook):
    """Every after_epoch call, and whether training ended well."""

    def __init__(self) -> None:
        self.epochs, self.ended = [], None

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        self.epochs.append((epoch, epoch_data["valid"]["loss"]))

    def after_training(self, success: bool) -> None:
        self.ended = success


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    result = phalanx_cli("train", str(toy.write_config(folder, _raw())), cwd=folder)
    assert result.returncode == 0, result.stderr
    [run_dir] = list((folder / "runs").iterdir())
    return run_dir


def test_fit_with_objects_trains_what_phalanx_train_trains(cli_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, streams = _objects()
    record = Record()
    raw = _raw(output_root=str(tmp_path / "runs"))
    run = phalanx.fit(raw, model=model, dataset=streams, hooks=[record])
    assert run.code == 0 and run.status == "finished"
    assert run.model is model  # the object given, trained in place
    want = _latest(cli_run)
    got = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the run's numbers: the last evaluation's, as the CSV has them; the hook ran after the config's
    last = (cli_run / "metrics.csv").read_text().splitlines()[-1].split(",")
    header = (cli_run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert run.metrics["valid.loss"] == float(last[header.index("valid.loss")])
    assert [epoch for epoch, _ in record.epochs] == [1, 2] and record.ended is True
    assert record.epochs[-1][1] == run.metrics["valid.loss"]
    # the saved config names the objects' classes and keeps the framework's keys; run.json says they
    # were given
    saved = rundir.load_config_text(run.run_dir)
    assert (
        saved["model"] == {**saved["model"], "class": "toy.Linear"}
        and "hidden" not in saved["model"]
    )
    assert (
        saved["dataset"]["class"] == "phalanx.objects.Streams"
        and saved["dataset"]["batch_size"] == 8
    )
    assert rundir.objects(run.run_dir) == {
        "model": "toy.Linear",
        "dataset": "phalanx.objects.Streams",
        "hooks": ["test_api.Record"],
    }
    assert (
        "model: the object given replaces class toy.Linear and its arguments features, hidden"
        in (run.run_dir / "log.txt").read_text()
    )


def test_fit_of_a_config_file_is_phalanx_train(cli_run, tmp_path):
    path = toy.write_config(tmp_path, _raw())
    run = phalanx.fit(path, overrides=["main_loop.epochs=2"])
    assert run.code == 0 and run.run_dir.parent == tmp_path / "runs"
    want, got = _latest(cli_run), _latest(run.run_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(run.model.state_dict()[k], want[k]) for k in want)
    assert run.metrics == pytest.approx(_traced(run.run_dir))


def _traced(run_dir: Path) -> dict:
    return [e for e in rundir.read_trace(run_dir) if e["event"] == "epoch"][-1]["metrics"]


def test_load_gives_the_model_back(cli_run):
    best = phalanx.load(cli_run)  # auto: the best
    checkpoints = Checkpoints(cli_run / "checkpoints")
    want = load_file(checkpoints.path(checkpoints.select("best")) / "model.safetensors")
    assert isinstance(best, toy.Linear) and not best.training
    assert all(torch.equal(best.state_dict()[k], want[k]) for k in want)
    latest = phalanx.load(cli_run, checkpoint="latest")
    assert all(torch.equal(latest.state_dict()[k], v) for k, v in _latest(cli_run).items())
    with pytest.raises(PhalanxError, match="not best, latest"):
        phalanx.load(cli_run, checkpoint="newest")
    with pytest.raises(PhalanxError, match="does not fit this model"):
        phalanx.load(cli_run, model=toy.Linear(features=3, hidden=5))


def test_evaluate_and_predict_return_what_the_readme_says_and_print_nothing(cli_run, capsys):
    """evaluate returns the metrics (the command prints them); predict returns CPU tensors, as the
    README says; a stream the dataset lacks is one error that lists those it has."""
    metrics = phalanx.evaluate(cli_run, "valid")
    values = phalanx.predict(cli_run, "valid")
    assert capsys.readouterr().out == ""
    assert set(metrics) == {"loss"} and isinstance(metrics["loss"], float)
    assert values and all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in values.values()
    )
    assert values["loss"].mean().item() == pytest.approx(metrics["loss"], rel=1e-12)
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert "is `phalanx predict`: a dict of CPU tensors" in readme
    for call in (phalanx.evaluate, phalanx.predict):
        with pytest.raises(DataError, match=r"no stream 'tset'; it has train, valid, test\. Give"):
            call(cli_run, "tset")


def test_the_eval_command_keeps_the_run_name_whole_on_a_narrow_terminal(cli_run, monkeypatch):
    import io

    from rich.console import Console

    from phalanx import commands

    out = io.StringIO()
    monkeypatch.setattr(
        "phalanx.logs.out", Console(file=out, width=40, force_terminal=True, color_system=None)
    )
    result = commands.evaluate(str(cli_run), "valid", "latest")
    lines = [line.strip() for line in out.getvalue().splitlines()]
    assert f"run {cli_run}" in lines, lines  # the name whole, on a line of its own
    assert f"valid at step {result['checkpoint']}" in lines, lines


def test_eval_on_a_run_it_cannot_write_prints_the_metrics_then_says_why_none_is_saved(
    cli_run, tmp_path, monkeypatch
):
    """A read-only run directory: the metrics are not lost with the file, and the error names
    no --output, which eval does not have."""
    import errno
    import io

    from rich.console import Console

    from phalanx import commands, files
    from phalanx.errors import StorageError

    run_dir = tmp_path / cli_run.name
    shutil.copytree(cli_run, run_dir)
    for earlier in run_dir.glob("eval-*.json"):  # another test's eval of the shared run
        earlier.unlink()
    out = io.StringIO()
    monkeypatch.setattr("phalanx.logs.out", Console(file=out, width=120, color_system=None))

    def refused(path, write, sync=False, where=files.WHERE):
        raise files.storage_error(path, OSError(errno.EROFS, "Read-only file system"), where)

    monkeypatch.setattr(files, "write_atomic", refused)
    with pytest.raises(StorageError) as info:
        commands.evaluate(str(run_dir), "valid", "latest")
    assert "valid at step" in out.getvalue() and "loss" in out.getvalue()
    said = str(info.value)
    assert said.startswith(f"cannot write {run_dir}/eval-valid-step-") and "--output" not in said
    assert "eval saves its metrics in the run directory alone; they are printed above" in said
    assert not list(run_dir.glob("eval-*.json"))


def test_a_resume_of_a_run_with_no_epoch_left_is_refused_before_anything_is_written(
    cli_run, tmp_path
):
    run_dir = tmp_path / cli_run.name
    shutil.copytree(cli_run, run_dir)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    with pytest.raises(ConfigError) as refused:
        phalanx.resume(run_dir, overrides=["main_loop.epochs=1"])
    said = str(refused.value)
    assert "main_loop.epochs=1: the run has trained 2 epochs already" in said
    assert "would train nothing" in said and "main_loop.epochs=4" in said
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_a_finished_run_resumed_as_it_was_trains_nothing_and_writes_nothing_but_its_log(
    cli_run, tmp_path
):
    """No hook starts: no writer's new file, no checkpoint saved again, no trace event; the log
    says the run has finished."""
    run_dir = tmp_path / cli_run.name
    shutil.copytree(cli_run, run_dir)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert phalanx.resume(run_dir).code == 0
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    log = run_dir / "log.txt"
    assert {p: b for p, b in after.items() if p != log} == {
        p: b for p, b in before.items() if p != log
    }
    assert "the run has finished its 2 epochs" in log.read_text()


def test_a_run_of_objects_resumes_and_loads_with_them_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, streams = _objects()
    straight = phalanx.fit(
        _raw(main_loop={"epochs": 3, "extra_streams": ["valid"]}), model=model, dataset=streams
    )
    model, streams = _objects()
    first = phalanx.fit(_raw(), model=model, dataset=streams, hooks=[StopAfter(epochs=1)])
    assert first.code == 0 and first.metrics.keys() == straight.metrics.keys()
    with pytest.raises(
        RunDirError,
        match=r"phalanx.resume\(.*model=toy.Linear\(...\), dataset=phalanx.objects.Streams",
    ):
        phalanx.resume(first.run_dir)
    fresh, streams = _objects()
    resumed = phalanx.resume(
        first.run_dir, overrides=["main_loop.epochs=3"], model=fresh, dataset=streams
    )
    assert resumed.code == 0 and resumed.model is fresh and resumed.run_dir == first.run_dir
    want = straight.model.state_dict()
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    assert resumed.metrics == straight.metrics
    with pytest.raises(RunDirError, match=r"phalanx.load\("):
        phalanx.load(first.run_dir)
    loaded = phalanx.load(first.run_dir, model=toy.Linear(features=3, hidden=4))
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    result = phalanx_cli("eval", str(first.run_dir), "--stream", "valid", cwd=tmp_path)
    assert result.returncode == 2 and "given to phalanx.fit as objects" in result.stderr
    assert "phalanx.evaluate(" in result.stderr and "Traceback" not in result.stderr
    # evaluated and predicted from Python, given the objects again
    metrics = phalanx.evaluate(
        first.run_dir, "valid", "latest", model=toy.Linear(features=3, hidden=4), dataset=streams
    )
    assert metrics["loss"] == resumed.metrics["valid.loss"]
    output = tmp_path / "valid.safetensors"
    arrays = phalanx.predict(
        first.run_dir,
        "valid",
        "latest",
        output=str(output),
        model=toy.Linear(features=3, hidden=4),
        dataset=streams,
    )
    assert arrays["loss"].mean().item() == pytest.approx(metrics["loss"], rel=1e-12)
    assert torch.equal(arrays["index"], torch.arange(10)) and torch.equal(
        arrays["y"], streams["valid"].y.double()
    )
    assert all(torch.equal(v, arrays[k]) for k, v in load_file(output).items())
    with pytest.raises(RunDirError, match=r"phalanx.predict\("):
        phalanx.predict(first.run_dir, "valid", model=toy.Linear(features=3, hidden=4))


def test_objects_train_on_towers_as_on_one_device(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, streams = _objects()
    one = phalanx.fit(_raw(hooks=[]), model=model, dataset=streams)
    model, streams = _objects()
    towers = phalanx.fit(
        _raw(hooks=[], parallel={"accelerator": "cpu", "devices": 2, "strategy": "towers"}),
        model=model,
        dataset=streams,
    )
    want = one.model.state_dict()
    assert all(
        torch.allclose(towers.model.state_dict()[k], want[k], rtol=1e-10, atol=0) for k in want
    )


def test_fit_from_another_thread(tmp_path, monkeypatch):
    """A notebook's or a server's worker thread: signals stay with the main thread, training goes
    on."""
    monkeypatch.chdir(tmp_path)
    model, streams = _objects()
    runs = []
    thread = threading.Thread(
        target=lambda: runs.append(phalanx.fit(_raw(hooks=[]), model=model, dataset=streams))
    )
    thread.start()
    thread.join(120)
    assert runs and runs[0].code == 0


def test_bad_objects_are_errors_that_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, streams = _objects()
    with pytest.raises(ModelError, match="not a torch.nn.Module"):
        phalanx.fit(_raw(), model=lambda x: x)
    with pytest.raises(ConfigError, match="no streams\\(\\) method"):
        phalanx.fit(_raw(), dataset=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"hooks\[0\] is a str"):
        phalanx.fit(_raw(), hooks=["StopAfter"])
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        phalanx.fit(
            _raw(parallel={"accelerator": "cpu", "devices": 2}), model=model, dataset=streams
        )
    with pytest.raises(ConfigError, match="the config is a list"):
        phalanx.fit([1])
    with pytest.raises(ConfigError, match="batch_size"):
        phalanx.fit(
            {"model": {}, "optimizer": {"class": "SGD", "lr": 0.1}, "dataset": {}},
            model=model,
            dataset=streams,
        )
    assert not (tmp_path / "runs").exists() or not list(
        (tmp_path / "runs").iterdir()
    )  # nothing half-made


class Tied(torch.nn.Module):
    """Two layers that share their weight (as a language model's embedding and output layer do)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 1)
        self.head2 = torch.nn.Linear(3, 1)
        self.head2.weight = self.head.weight  # tied

    def forward(self, x, y):
        prediction = (self.head(x) + self.head2(x)).squeeze(-1)
        return {"prediction": prediction, "loss": (prediction - y) ** 2}


def test_load_keeps_tied_weights_tied_and_needs_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, streams = _objects()
    run = phalanx.fit(_raw(hooks=["SaveLatest"]), model=Tied(), dataset=streams)
    loaded = phalanx.load(run.run_dir, model=Tied())
    assert loaded.head2.weight is loaded.head.weight and loaded.head.weight.dtype == torch.float64
    assert torch.equal(loaded.head.weight, run.model.head.weight.detach().cpu())
    none = phalanx.fit(_raw(hooks=[]), model=Tied(), dataset=streams)
    with pytest.raises(PhalanxError, match="has no checkpoint yet"):
        phalanx.load(none.run_dir, model=Tied())


def test_a_run_in_worker_processes_has_no_model_here(tmp_path):
    run = phalanx.Run(tmp_path, 0, {})
    with pytest.raises(PhalanxError, match="phalanx.load"):
        _ = run.model


def test_a_resume_that_stop_after_would_end_at_once_says_which_override_goes_on(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    three = {"epochs": 3, "extra_streams": ["valid"]}
    straight = phalanx.fit(_raw(main_loop=three))
    for key, limit, step in (("steps", 7, 7), ("epochs", 1, 5)):
        raw = _raw(main_loop=three)
        raw["hooks"] = [*raw["hooks"], {"StopAfter": {key: limit}}]
        first = phalanx.fit(raw)
        assert first.code == 0 and Checkpoints(first.run_dir / "checkpoints").steps()[-1] == step
        again = phalanx.resume(first.run_dir)
        assert again.code == 0
        assert Checkpoints(first.run_dir / "checkpoints").steps()[-1] == step  # not one step more
        said = (first.run_dir / "log.txt").read_text().splitlines()[-1]
        assert "before this run's first step" in said, said
        assert f"hooks.StopAfter.{key}={2 * limit}" in said and "~hooks.StopAfter" in said
        # one string is one override
        rest = phalanx.resume(first.run_dir, overrides="~hooks.StopAfter")
        assert rest.code == 0 and rest.metrics == straight.metrics
        assert all(
            torch.equal(v, _latest(straight.run_dir)[k]) for k, v in _latest(rest.run_dir).items()
        )


class _Uneven(torch.nn.Module):
    """Outputs a prediction, one whose width is the batch's size, and names that are no tensor."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.layer, self.weight = torch.nn.Linear(3, 1), weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        prediction = self.layer(x).squeeze(-1)
        return {
            "loss": (prediction - y) ** 2,
            "loss_weight": torch.full_like(y, self.weight),
            "prediction": prediction,
            "ragged": prediction[:, None].expand(-1, len(x)),
            "names": [f"sample {i}" for i in range(len(x))],
        }


def test_predict_leaves_out_what_has_no_one_array_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    streams = toy.Regression(n_train=37).streams()
    torch.manual_seed(0)
    run = phalanx.fit(_raw(hooks=["SaveLatest"]), model=_Uneven(), dataset=streams)
    assert run.code == 0
    arrays = phalanx.predict(run.run_dir, "valid", model=_Uneven(), dataset=streams)  # 8 + 2
    assert {"index", "x", "y", "loss", "prediction"} <= arrays.keys()
    assert "ragged" not in arrays and "names" not in arrays
    said = capsys.readouterr().err
    assert "left out of the predictions: " in said
    assert "ragged (its shape per sample changes between batches ([2], [8])" in said
    assert "names (a list, not a tensor)" in said


def test_negative_loss_weights_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    streams = toy.Regression(n_train=37).streams()
    with pytest.raises(ModelError, match="'loss_weight' holds negative weights"):
        phalanx.fit(_raw(hooks=[]), model=_Uneven(weight=-1.0), dataset=streams)


def test_workers_of_a_script_read_from_standard_input_are_refused_before_they_start(
    tmp_path, monkeypatch
):
    """`python - < script.py`: a spawned worker runs the main module again from its file, which
    does not exist, and ended before it could say why (reported as killed from outside)."""
    import sys

    monkeypatch.chdir(tmp_path)
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None)
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)
    with pytest.raises(PhalanxError) as info:
        phalanx.fit(_raw(parallel={"accelerator": "cpu", "devices": 2}))
    said = str(info.value)
    assert said.startswith(
        "the 2 worker processes would each run this program's main module again, from its file, "
    )
    assert said.endswith(
        "/<stdin>, which does not exist (a script read from standard input, `python - < "
        "script.py`, has none): save the script to a file and run `python script.py`, or set "
        "parallel.devices: 1"
    )
    assert list((tmp_path / "runs").iterdir()) == []  # no run directory is left


def test_accumulation_over_more_micro_batches_than_samples_is_said(tmp_path, monkeypatch):
    """gradient_accumulation above the batch size: the step takes one sample a micro-batch (no
    empty ones), and the start of the log says so, with the setting to change."""
    monkeypatch.chdir(tmp_path)
    parallel = {"accelerator": "cpu", "gradient_accumulation": 16}
    run = phalanx.fit(_raw(hooks=[], parallel=parallel))
    assert run.code == 0
    said = (run.run_dir / "log.txt").read_text()
    assert "global batch 8 per optimizer step, 8 micro-batches of up to 1, 1 per device" in said
    assert (
        "WARNING parallel.gradient_accumulation is 16 but dataset.batch_size is 8: a step splits "
        "its batch into 8 micro-batches of one sample; set gradient_accumulation to 8 or less"
    ) in said


def test_a_batch_larger_than_the_training_stream_is_said(tmp_path, monkeypatch):
    """A batch of 64 over 37 samples: each step takes the 37, and lr_scaling reads the 64."""
    monkeypatch.chdir(tmp_path)
    raw = _raw(hooks=[])
    raw["dataset"] = {**raw["dataset"], "batch_size": 64}
    raw["optimizer"] = {**raw["optimizer"], "lr_scaling": {"rule": "linear", "base_batch_size": 8}}
    run = phalanx.fit(raw)
    assert run.code == 0
    assert (
        "WARNING dataset.batch_size is 64 but the training stream has 37 samples: each step takes "
        "all 37, while optimizer.lr_scaling scales the learning rate by 64; set batch_size to 37 "
        "or less"
    ) in (run.run_dir / "log.txt").read_text()


def test_the_log_says_first_what_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    towers = {"accelerator": "cpu", "devices": 3, "strategy": "towers", "gradient_accumulation": 2}
    run = phalanx.fit(_raw(hooks=[], parallel=towers))
    said = (run.run_dir / "log.txt").read_text()
    threads = torch.get_num_threads()
    assert (
        f"strategy towers: 1 process driving 3 cpu devices with {threads} thread"
        f"{'s' if threads > 1 else ''}; precision fp64; global batch 8 per optimizer step, "
        "2 micro-batches of up to 4, 1 to 2 per device; dropout and augmentation keyed by "
        "sample\n" in said
    )
    if not torch.cuda.is_available():  # accelerator auto: the CPU, and the log says so
        run = phalanx.fit(
            _raw(hooks=[], parallel={"devices": 2, "strategy": "towers"}, per_sample_random=False)
        )
        said = (run.run_dir / "log.txt").read_text()
        assert (
            "4 per device; dropout and augmentation drawn per process (per_sample_random: false) "
            "(no GPU is visible: the 2 devices are shares of the CPU)" in said
        )


def test_a_placement_the_run_does_not_apply_is_a_warning_that_names_its_strategy(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    placed = {"accelerator": "cpu", "placement": {"net.0": "cpu"}}
    run = phalanx.fit(_raw(hooks=[], main_loop={"epochs": 1}, parallel=placed))
    said = (run.run_dir / "log.txt").read_text()
    assert (
        "WARNING parallel.placement pins net.0 to devices for parallel.strategy=placement only; "
        "this run's strategy, single, ignores it: set parallel.strategy=placement, or remove "
        "parallel.placement\n" in said
    )
    placed["strategy"] = "placement"
    run = phalanx.fit(_raw(hooks=[], main_loop={"epochs": 1}, parallel=placed))
    assert "parallel.placement pins" not in (run.run_dir / "log.txt").read_text()


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", "two\nlines", "ABSOLUTE"])
def test_a_run_name_that_is_not_one_folder_name_is_refused_and_nothing_is_made(
    tmp_path, monkeypatch, name
):
    monkeypatch.chdir(tmp_path)
    if name == "ABSOLUTE":
        name = str(tmp_path / "elsewhere" / "run")
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    with pytest.raises(ConfigError, match="name: a run name is one folder's name"):
        phalanx.fit(_raw(name=name, output_root=str(tmp_path / "runs" / "deep")))
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda raw: phalanx.fit(raw, hooks=StopAfter(epochs=1)),
            "hooks= is a StopAfter; give a list",
        ),
        (lambda raw: phalanx.fit(raw, hooks=[StopAfter]), "hooks[0] is the class StopAfter"),
        (lambda raw: phalanx.fit(raw, overrides=3), "overrides= is a int; give a KEY=VALUE string"),
        (lambda raw: phalanx.fit(raw, overrides=None), "overrides= is a NoneType"),
        (lambda raw: phalanx.fit(raw, overrides=b"seed=1"), "overrides= is a bytes"),
        (lambda raw: phalanx.fit(raw, nodes=2), "nodes= is a int; give a phalanx.nodes.Nodes"),
        (lambda raw: phalanx.load(5), "the run directory is a int; give its path"),
        (lambda raw: phalanx.evaluate(None), "the run directory is a NoneType"),
    ],
)
def test_arguments_of_the_wrong_kind_are_one_config_error(tmp_path, monkeypatch, call, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        call(_raw(hooks=[]))
    assert words in str(info.value)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_numpy_and_tensor_numbers_in_a_config_dict_are_taken_as_numbers(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    raw = _raw(hooks=[])
    raw["optimizer"] = {
        **raw["optimizer"],
        "lr": np.float32(0.01),
        "weight_decay": torch.tensor(0.0),
    }
    raw["main_loop"] = {"epochs": np.int64(1)}
    run = phalanx.fit(raw)
    assert run.code == 0
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert saved["optimizer"]["lr"] == pytest.approx(0.01) and saved["main_loop"]["epochs"] == 1


def test_a_failed_fit_ends_its_loader_workers_before_it_raises(tmp_path, monkeypatch):
    """An item that a DataLoader worker cannot read: the error reaches the caller with the loader's
    workers ended already (a notebook or a server goes on after it), and the workers were told to
    end with the process that started them."""
    from procs import alive

    monkeypatch.chdir(tmp_path)
    record = tmp_path / "processes.txt"
    dataset = toy.unreadable_dataset(record)
    with pytest.raises(ValueError, match="training item 29 cannot be read") as caught:
        phalanx.fit(_raw(dataset=dataset, hooks=[]))
    assert caught.value.__traceback__ is not None
    workers = [line.split() for line in record.read_text().splitlines()]
    assert workers and not [pid for _, pid, *_ in workers if alive(int(pid))]
    assert {int(line[3]) for line in workers} == {signal.SIGKILL}
