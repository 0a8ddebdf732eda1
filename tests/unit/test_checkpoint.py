"""Checkpoints: the files a step holds, integrity checks that name the damaged file, falling back to
the previous valid step, retention, atomic writes, and selecting a step."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from phalanx.checkpoint import MANIFEST, OPTIMIZER, TRAINER, WEIGHTS, Checkpoints
from phalanx.errors import CheckpointError, StorageError
from phalanx.weights import load_weights

pytestmark = pytest.mark.timeout(60)
# a value nested far deeper than json's parser recurses: it raises RecursionError
DEEP = b"[" * 100_000 + b"]" * 100_000


def _module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _optimizer_state(module: nn.Module) -> dict:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return {"optimizer": optimizer.state_dict(), "schedulers": [], "scaler": {}}


def _state(at: int, **changes) -> dict:
    """A trainer state as the trainer saves it at step `at`: counters, the seed, RNG and hook
    entries."""
    return {
        "epoch": 1,
        "step": at,
        "step_in_epoch": 0,
        "batch_size": 8,
        "seed": 0,
        "rng": {"x": [1, 2]},
        "hooks": {},
        **changes,
    }


def _save(
    ckpts: Checkpoints, step: int, best: dict | None = None, seed: int | None = None
) -> nn.Module:
    module = _module(step if seed is None else seed)
    ckpts.save(step, module, _optimizer_state(module), _state(step), best)
    return module


@pytest.fixture
def ckpts(tmp_path) -> Checkpoints:
    return Checkpoints(tmp_path / "checkpoints", keep_last=10)


def test_save_writes_every_file_and_a_manifest_of_them(ckpts):
    module = _module(1)
    opt_state = _optimizer_state(module)
    trainer_state = {
        "epoch": 2,
        "step": 7,
        "step_in_epoch": 3,
        "hooks": {"0:SaveBest": {"best": 0.5}},
    }
    folder = ckpts.save(7, module, opt_state, trainer_state)
    assert folder == ckpts.path(7) and folder.name == "step-7"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [WEIGHTS, OPTIMIZER, TRAINER, MANIFEST]
    )
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["step"] == 7
    assert set(manifest["files"]) == {WEIGHTS, OPTIMIZER, TRAINER}
    for name, meta in manifest["files"].items():
        content = (folder / name).read_bytes()
        assert meta["size"] == len(content) == os.path.getsize(folder / name)
        assert meta["sha256"] == hashlib.sha256(content).hexdigest()
    weights = load_file(str(folder / WEIGHTS))
    assert set(weights) == set(module.state_dict())
    for key, value in module.state_dict().items():
        assert torch.equal(weights[key], value)
    assert json.loads((folder / TRAINER).read_text()) == trainer_state
    loaded = torch.load(folder / OPTIMIZER, weights_only=True)
    momentum = loaded["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, opt_state["optimizer"]["state"][0]["momentum_buffer"])
    assert ckpts.steps() == [7]
    assert ckpts.verify(7) == folder


def test_load_restores_weights_and_returns_the_states(ckpts):
    saved = _save(ckpts, 3)
    fresh = _module(99)
    assert not torch.equal(fresh[0].weight, saved[0].weight)
    opt_state, trainer_state = ckpts.load(3, fresh)
    for a, b in zip(fresh.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert trainer_state == _state(3)
    assert "momentum_buffer" in opt_state["optimizer"]["state"][0]


def test_no_temporary_folders_remain(ckpts):
    for step in (1, 2, 3):
        _save(ckpts, step)
    assert [p.name for p in ckpts.root.iterdir() if p.name.startswith(".tmp")] == []


class _FillsTheDisk:
    """Pickled into optimizer.pt part-way through the step's files: the write fails as on a full
    disk."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_save_is_one_error_naming_the_step_and_leaves_nothing(ckpts):
    _save(ckpts, 1)
    module = _module(2)
    state = {**_optimizer_state(module), "scaler": {"seam": _FillsTheDisk()}}
    with pytest.raises(StorageError) as info:
        ckpts.save(
            2, module, state, {"epoch": 1, "step": 2}, best={"variable": "valid.loss", "value": 0.5}
        )
    message = str(info.value)
    assert str(ckpts.path(2)) in message and "the disk is full" in message and "\n" not in message
    assert sorted(p.name for p in ckpts.root.iterdir()) == [
        "step-1"
    ]  # no temporary folder, no best.json
    assert ckpts.steps() == [1]


def test_clean_stale_removes_interrupted_saves(ckpts):
    _save(ckpts, 1)
    stale = ckpts.root / ".tmp-step-5-12345"
    stale.mkdir()
    (stale / WEIGHTS).write_bytes(b"half")
    assert ckpts.steps() == [1]
    ckpts.clean_stale()
    assert not stale.exists()
    assert ckpts.steps() == [1]


def test_a_step_without_manifest_does_not_exist(ckpts):
    _save(ckpts, 1)
    _save(ckpts, 2)
    (ckpts.path(2) / MANIFEST).unlink()
    assert ckpts.steps() == [1]
    assert ckpts.latest_valid() == 1
    with pytest.raises(CheckpointError) as info:
        ckpts.verify(2)
    assert MANIFEST in str(info.value) and "step-2" in str(info.value)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [WEIGHTS, OPTIMIZER, TRAINER])
@pytest.mark.parametrize(
    "damage, words",
    [
        (_truncate, ["truncated"]),
        (_flip_byte, ["SHA-256", "altered"]),
        (lambda path: path.unlink(), ["missing"]),
    ],
)
def test_verify_names_the_damaged_file(ckpts, name, damage, words):
    _save(ckpts, 4)
    size = (ckpts.path(4) / name).stat().st_size
    damage(ckpts.path(4) / name)
    if damage is _flip_byte:
        assert (ckpts.path(4) / name).stat().st_size == size
    with pytest.raises(CheckpointError) as info:
        ckpts.verify(4)
    message = str(info.value)
    assert str(ckpts.path(4) / name) in message
    for word in words:
        assert word in message
    with pytest.raises(CheckpointError):
        ckpts.load(4, _module())


@pytest.mark.parametrize("name", [OPTIMIZER, TRAINER])
def test_a_damaged_optimizer_or_trainer_state_keeps_no_one_from_the_weights(ckpts, name):
    """Evaluating, predicting and exporting read the weights alone: a step whose optimizer or
    trainer state is damaged still gives them (`weights_only`), and is still the latest for
    them, where a resume passes over it to the step before."""
    _save(ckpts, 2)
    saved = _save(ckpts, 4)
    _truncate(ckpts.path(4) / name)
    with pytest.raises(CheckpointError, match="truncated"):
        ckpts.select(4)
    assert ckpts.select("latest") == 2  # a resume's
    assert ckpts.select("latest", weights_only=True) == 4
    assert ckpts.select(4, weights_only=True) == 4
    module = _module(seed=99)
    ckpts.load_weights(4, module)
    for a, b in zip(module.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    _truncate(ckpts.path(4) / WEIGHTS)  # the weights themselves: refused either way
    with pytest.raises(CheckpointError, match="truncated"):
        ckpts.select(4, weights_only=True)


def test_verify_rejects_an_unreadable_manifest_and_another_format(ckpts):
    _save(ckpts, 1)
    manifest = ckpts.path(1) / MANIFEST
    text = manifest.read_text()
    manifest.write_text(text[:10])
    with pytest.raises(CheckpointError, match="missing or unreadable"):
        ckpts.verify(1)
    manifest.write_text(json.dumps({**json.loads(text), "format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        ckpts.verify(1)


@pytest.mark.parametrize(
    "manifest, words",
    [
        (lambda m: {**m, "files": list(m["files"])}, "does not list its files"),
        (
            lambda m: {**m, "files": {k: [v["size"]] for k, v in m["files"].items()}},
            "does not list",
        ),
        (lambda m: {**m, "files": {k: {**v, "size": "9"} for k, v in m["files"].items()}}, "size"),
        (lambda m: [m], "holds a list, not a manifest"),
        (DEEP, "nests deeper than 100 levels"),
    ],
    ids=["files-a-list", "entries-lists", "size-text", "a-list", "nested-too-deep"],
)
def test_a_manifest_of_another_shape_is_a_damaged_step_and_the_one_before_is_taken(
    ckpts, manifest, words
):
    _save(ckpts, 1)
    _save(ckpts, 2)
    path = ckpts.path(2) / MANIFEST
    if callable(manifest):
        manifest = json.dumps(manifest(json.loads(path.read_text()))).encode()
    path.write_bytes(manifest)
    with pytest.raises(CheckpointError, match=words) as info:
        ckpts.verify(2)
    assert str(path) in str(info.value)
    assert ckpts.latest_valid() == 1


@pytest.fixture
def phalanx_warnings(caplog, monkeypatch):
    # `logs.setup` (run by other tests in this process) turns propagation off; caplog listens on
    # root
    monkeypatch.setattr(logging.getLogger("phalanx"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="phalanx")
    return caplog


def test_latest_valid_falls_back_with_a_warning(ckpts, phalanx_warnings):
    for step in (1, 2, 3):
        _save(ckpts, step)
    _flip_byte(ckpts.path(3) / WEIGHTS)
    assert ckpts.latest_valid() == 2
    warnings = [
        r for r in phalanx_warnings.records if r.name == "phalanx" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    assert str(ckpts.path(3) / WEIGHTS) in warnings[0].getMessage()
    _truncate(ckpts.path(2) / TRAINER)
    assert ckpts.latest_valid() == 1
    assert ckpts.select("latest") == 1
    (ckpts.path(1) / OPTIMIZER).unlink()
    assert ckpts.latest_valid() is None
    with pytest.raises(CheckpointError, match="no latest checkpoint"):
        ckpts.select("latest")


def test_latest_valid_without_checkpoints(tmp_path):
    assert Checkpoints(tmp_path / "none").latest_valid() is None
    assert Checkpoints(tmp_path / "none").steps() == []


def test_retention_keeps_the_last_k_and_the_best(tmp_path):
    ckpts = Checkpoints(tmp_path / "checkpoints", keep_last=2)
    _save(ckpts, 1)
    _save(ckpts, 2, best={"variable": "valid.loss", "value": 0.1, "epoch": 2})
    for step in (3, 4, 5, 6):
        _save(ckpts, step)
        assert ckpts.steps() == sorted({2, step - 1, step})
    assert sorted(p.name for p in ckpts.root.iterdir() if p.is_dir()) == [
        "step-2",
        "step-5",
        "step-6",
    ]
    assert ckpts.best() == 2
    _save(ckpts, 7, best={"variable": "valid.loss", "value": 0.05, "epoch": 7})
    assert ckpts.steps() == [6, 7]  # the old best is no longer the best nor among the last two
    assert ckpts.best() == 7


def test_a_best_json_that_names_no_step_deletes_no_checkpoint(tmp_path, caplog):
    """Which step is best is not known: the old best must not go with the steps past the last
    two. Said once; pruning resumes when a SaveBest names a step again."""
    ckpts = Checkpoints(tmp_path / "checkpoints", keep_last=2)
    _save(ckpts, 1, best={"variable": "valid.loss", "value": 0.1, "epoch": 1})
    (ckpts.root / "best.json").write_text('{"step": 1, "varia')  # cut short
    with caplog.at_level("WARNING", logger="phalanx"):
        for step in (2, 3, 4):
            _save(ckpts, step)
    assert ckpts.steps() == [1, 2, 3, 4]
    said = [r.getMessage() for r in caplog.records if "best.json" in r.getMessage()]
    assert len(said) == 1 and "none is deleted until it names one" in said[0]
    _save(ckpts, 5, best={"variable": "valid.loss", "value": 0.05, "epoch": 5})
    assert ckpts.steps() == [4, 5]


def test_saving_an_existing_step_again_can_mark_it_best(ckpts):
    first = _save(ckpts, 5, seed=1)
    _save(ckpts, 5, best={"variable": "valid.loss", "value": 0.2, "epoch": 1}, seed=2)
    assert ckpts.best() == 5
    assert json.loads((ckpts.root / "best.json").read_text()) == {
        "step": 5,
        "variable": "valid.loss",
        "value": 0.2,
        "epoch": 1,
    }
    ckpts.verify(5)
    weights = load_file(str(ckpts.path(5) / WEIGHTS))
    assert torch.equal(weights["0.weight"], first[0].weight)  # the first save of a step stands


def test_select_best_latest_and_a_step(ckpts):
    for step in (2, 4, 6):
        _save(
            ckpts,
            step,
            best={"variable": "valid.loss", "value": 1.0, "epoch": 1} if step == 4 else None,
        )
    assert ckpts.select("latest") == 6
    assert ckpts.select("best") == 4
    assert ckpts.select(2) == 2
    assert ckpts.select("6") == 6
    with pytest.raises(CheckpointError, match="no checkpoint at step 3"):
        ckpts.select(3)
    with pytest.raises(CheckpointError, match="not best, latest, auto or a step number"):
        ckpts.select("newest")
    _truncate(ckpts.path(2) / WEIGHTS)
    with pytest.raises(CheckpointError, match="truncated"):
        ckpts.select(2)


def test_a_step_whose_folder_has_no_manifest_is_said_damaged_not_missing(ckpts):
    """A save cut short (or a manifest deleted): asked for by number or as the best, the step is
    named incomplete or damaged, not absent."""
    for step in (2, 4):
        _save(
            ckpts,
            step,
            best={"variable": "valid.loss", "value": 1.0, "epoch": 1} if step == 4 else None,
        )
    (ckpts.path(4) / MANIFEST).unlink()
    for which in (4, "best"):
        with pytest.raises(CheckpointError, match=r"step-4/manifest.json is missing.*damaged"):
            ckpts.select(which)
    assert ckpts.select("latest") == 2  # the latest valid one, as before


def test_a_file_the_system_will_not_let_us_read_is_said_not_passed_over(ckpts, monkeypatch):
    """A permission refused is not damage: the step is not skipped for an older one (a resume
    would then write over it), and the error names the file and the fix."""
    from phalanx import checkpoint
    from phalanx.errors import StorageError

    for step in (2, 4):
        _save(ckpts, step)

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "_sha256", refused)
    for call in (lambda: ckpts.select(4), ckpts.latest_valid):
        with pytest.raises(StorageError, match=r"cannot read .*step-4/.*Permission denied; make"):
            call()


def test_a_damaged_best_says_where_the_valid_ones_are(ckpts):
    for step in (2, 4):
        _save(
            ckpts,
            step,
            best={"variable": "valid.loss", "value": 1.0, "epoch": 1} if step == 4 else None,
        )
    _truncate(ckpts.path(4) / WEIGHTS)
    with pytest.raises(CheckpointError) as info:
        ckpts.select("best")
    said = str(info.value)
    assert "truncated" in said and "--checkpoint latest takes the newest checkpoint that" in said
    assert said.endswith("there are [2, 4]")
    assert ckpts.select("latest") == 2


def test_a_step_folder_not_named_as_phalanx_names_it_is_no_step(ckpts):
    """step-060 beside step-60 (a copy by hand) is neither counted nor pruned as step 60."""
    _save(ckpts, 60)
    shutil.copytree(ckpts.path(60), ckpts.root / "step-060")
    assert ckpts.steps() == [60]


def test_select_best_without_a_best(ckpts):
    _save(ckpts, 1)
    with pytest.raises(CheckpointError, match="no best checkpoint"):
        ckpts.select("best")
    _save(ckpts, 2)
    assert (
        ckpts.select("auto") == 2
    )  # auto, the default of eval, predict and export: the latest, without a best
    _save(ckpts, 3, best={"variable": "valid.loss", "value": 0.5, "epoch": 1})
    _save(ckpts, 4)
    assert ckpts.select("auto") == 3  # and the best where there is one


@pytest.mark.parametrize(
    "content", ["[]", "{}", '{"step": "4"}', "not json", '{"step": -1}', DEEP.decode()]
)
def test_a_best_json_that_names_no_step_is_an_error_saying_so(ckpts, content):
    _save(ckpts, 1)
    (ckpts.root / "best.json").write_text(content)
    assert ckpts.best() is None  # retention and ls go on without it
    ckpts.prune()
    for which in ("best", "auto"):  # auto: eval's default, which would pass over it unsaid
        with pytest.raises(
            CheckpointError, match="best.json does not name a step; choose one with --checkpoint"
        ):
            ckpts.select(which)


def test_a_best_json_that_names_a_step_that_is_gone_says_so(ckpts):
    _save(ckpts, 1)
    _save(ckpts, 2)
    (ckpts.root / "best.json").write_text('{"step": 999}')
    for which in ("best", "auto"):
        with pytest.raises(CheckpointError) as info:
            ckpts.select(which)
        assert str(info.value) == (
            f"{ckpts.root / 'best.json'} names step 999, which has no checkpoint (there are "
            "[1, 2]); choose one with --checkpoint latest or N, or delete best.json: the next "
            "SaveBest writes it again"
        )
    assert ckpts.select("latest") == 2


def test_loading_weights_into_another_model_is_an_error(ckpts):
    _save(ckpts, 1)
    with pytest.raises(CheckpointError) as info:
        ckpts.load(1, nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double())
    assert WEIGHTS in str(info.value) and "does not fit this model" in str(info.value)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_weights(nn.Linear(3, 1).double(), ckpts.path(1) / WEIGHTS)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_weights(
            nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Linear(1, 1)).double(),
            ckpts.path(1) / WEIGHTS,
        )


# --- a damaged step is replaced; files that verify but do not parse -------------------------------


@pytest.mark.parametrize(
    "damage",
    [_truncate, lambda path: path.parent.joinpath(MANIFEST).unlink()],
    ids=["truncated-weights", "no-manifest"],
)
def test_saving_over_a_damaged_step_replaces_it(ckpts, damage):
    _save(ckpts, 4, seed=1)
    damage(ckpts.path(4) / WEIGHTS)
    fresh = Checkpoints(ckpts.root, keep_last=10)  # a resumed run: another process, another object
    module = _save(fresh, 4, seed=2)
    assert fresh.verify(4) == ckpts.path(4)
    assert torch.equal(load_file(str(ckpts.path(4) / WEIGHTS))["0.weight"], module[0].weight)
    assert [p.name for p in ckpts.root.iterdir() if p.name.startswith(".")] == []


def test_saving_over_an_intact_step_keeps_it(ckpts):
    saved = _save(ckpts, 4, seed=1)
    before = (ckpts.path(4) / MANIFEST).stat().st_ino
    _save(Checkpoints(ckpts.root, keep_last=10), 4, seed=2)
    assert (ckpts.path(4) / MANIFEST).stat().st_ino == before
    assert torch.equal(load_file(str(ckpts.path(4) / WEIGHTS))["0.weight"], saved[0].weight)


def _rewrite(ckpts: Checkpoints, step: int, name: str, data: bytes) -> None:
    """Replace one file of a step and update the manifest, so that the step still verifies."""
    folder = ckpts.path(step)
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _refused_pickle() -> bytes:
    """A real torch pickle whose class `weights_only` will not construct."""
    import argparse
    import io

    buffer = io.BytesIO()
    torch.save({"optimizer": argparse.Namespace(x=1), "schedulers": [], "scaler": {}}, buffer)
    return buffer.getvalue()


def test_a_plain_pickle_in_place_of_the_optimizer_state_is_one_error_without_torchs_warning(ckpts):
    import pickle
    import warnings

    _save(ckpts, 3)
    _rewrite(ckpts, 3, OPTIMIZER, pickle.dumps({"optimizer": print}, protocol=4))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="cannot be read as optimizer state"):
            ckpts.load(3, _module(99))
    assert [str(w.message) for w in warned] == []  # torch's "Detected pickle protocol 4" unsaid


def test_what_torch_warns_of_a_load_that_goes_through_is_still_said(ckpts, monkeypatch):
    import warnings

    from phalanx import stepfiles

    _save(ckpts, 3)
    load = torch.load

    def warns(*args, **kwargs):
        warnings.warn("a note from torch.load", UserWarning, stacklevel=2)
        return load(*args, **kwargs)

    monkeypatch.setattr(stepfiles.torch, "load", warns)
    with pytest.warns(UserWarning, match="a note from torch.load"):
        ckpts.load(3, _module(99))


@pytest.mark.parametrize(
    "name, data, words",
    [
        (TRAINER, b"{}", "lacks epoch"),
        (TRAINER, b"not json at all", "not readable JSON"),
        (TRAINER, b"[1, 2]", "holds a list"),
        (TRAINER, json.dumps(_state(3, step=-1)).encode(), "step=-1"),
        (TRAINER, json.dumps(_state(3, epoch=True)).encode(), "epoch=True"),
        (TRAINER, json.dumps(_state(3, epoch=5)).encode(), "step 3 after 5 epochs"),
        (OPTIMIZER, os.urandom(4096), "cannot be read as optimizer state"),
        (OPTIMIZER, _refused_pickle(), "cannot be read as optimizer state"),
        (OPTIMIZER, b"", "cannot be read as optimizer state"),
        (WEIGHTS, b"\x08" + bytes(15), "not a readable safetensors file"),
        (TRAINER, DEEP, "not readable JSON \\(it nests deeper than 100 levels"),
        (
            TRAINER,
            json.dumps(_state(3, grad_norms={"sum": "x", "max": 0, "count": 0, "nonfinite": 0})),
            "malformed grad_norms",
        ),
        (TRAINER, json.dumps(_state(3, rounds=-2, rng_ranks="x")), "malformed rounds, rng_ranks"),
    ],
    ids=[
        "empty-object",
        "not-json",
        "a-list",
        "negative-step",
        "bool-epoch",
        "more-epochs-than-steps",
        "random-bytes",
        "refused-pickle",
        "empty-file",
        "weights-not-safetensors",
        "nested-too-deep",
        "grad-norms-of-text",
        "rounds-and-ranks-malformed",
    ],
)
def test_files_that_verify_but_do_not_parse_are_a_checkpoint_error_naming_them(
    ckpts, name, data, words
):
    saved = _save(ckpts, 3)
    _rewrite(ckpts, 3, name, data.encode() if isinstance(data, str) else data)
    assert ckpts.verify(3)
    fresh = _module(99)
    with pytest.raises(CheckpointError, match=words) as info:
        ckpts.load(3, fresh)
    assert str(ckpts.path(3) / name) in str(info.value)
    assert not torch.equal(fresh[0].weight, saved[0].weight)  # nothing was loaded from the bad step
