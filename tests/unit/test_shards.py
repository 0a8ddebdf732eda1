"""Sharded checkpoint steps in one process: torch.distributed.checkpoint files inside the atomic
commit and the manifest, a damaged shard named and skipped, pickles in the shards refused, a model
of another shape refused, and `export` of whole and sharded steps to one plain state-dict file."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from phalanx.checkpoint import MANIFEST, OPTIMIZER, SHARDS, TRAINER, Checkpoints
from phalanx.errors import CheckpointError, CheckpointMismatch, StorageError
from phalanx.shards import load_shards

pytestmark = pytest.mark.timeout(60)
MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / "phalanx-unpickled-marker"


class OneRank:
    """A group of one process, as a strategy without a process group is."""

    is_main = True

    def gather(self, value):
        return [value]

    def broadcast(self, value):
        return value


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    module(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return module, optimizer


def _write(module: nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None):
    def write(folder: Path) -> None:
        model_state, optimizer_state = get_state_dict(module, optimizer)
        optimizer_state["param_groups"][0].update(extra or {})
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # "assuming the intent is to save in a single process": it is
            dcp.save(
                {"model": model_state, "optim": optimizer_state}, checkpoint_id=folder, no_dist=True
            )

    return write


def _state(step: int) -> dict:
    return {
        "epoch": 0,
        "step": step,
        "step_in_epoch": step,
        "batch_size": 8,
        "seed": 0,
        "rng": {},
        "hooks": {},
    }


def _save(
    ckpts: Checkpoints, step: int, seed: int | None = None, extra: dict | None = None
) -> nn.Module:
    module, optimizer = _trained(step if seed is None else seed)
    ckpts.save_sharded(
        step,
        _write(module, optimizer, extra),
        {"optimizer": None, "schedulers": [], "scaler": {}},
        _state(step),
        OneRank(),
    )
    return module, optimizer


def _rewrite_manifest(folder: Path) -> None:
    """Make the manifest match the files again, as someone who replaced a file on purpose would."""
    import hashlib

    manifest = json.loads((folder / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def ckpts(tmp_path) -> Checkpoints:
    return Checkpoints(tmp_path / "checkpoints", keep_last=10)


def test_a_sharded_step_holds_the_shards_under_its_manifest_and_loads_model_and_optimizer(ckpts):
    module, optimizer = _save(ckpts, 4)
    folder = ckpts.path(4)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["layout"] == "sharded"
    assert set(manifest["files"]) == {
        OPTIMIZER,
        TRAINER,
        f"{SHARDS}/.metadata",
        f"{SHARDS}/__0_0.distcp",
    }
    assert not list(ckpts.root.glob(".tmp-*"))
    fresh, fresh_optimizer = _trained(99)
    optimizer_state, trainer_state = ckpts.load(
        4, lambda path: load_shards(path, fresh, fresh_optimizer)
    )
    assert optimizer_state["optimizer"] is None and trainer_state["step"] == 4
    for mine, saved in zip(fresh.parameters(), module.parameters(), strict=True):
        assert torch.equal(mine, saved)
    for mine, saved in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert torch.equal(mine["exp_avg_sq"], saved["exp_avg_sq"]) and float(
            mine["step"]
        ) == float(saved["step"])
    weights_only, _ = _trained(98)
    ckpts.load_weights(4, weights_only)  # a module: the model's part of the shards only
    assert torch.equal(weights_only[0].weight, module[0].weight)


def test_a_damaged_shard_is_named_and_the_previous_step_is_taken(ckpts):
    _save(ckpts, 2)
    _save(ckpts, 4)
    shard = ckpts.path(4) / SHARDS / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its SHA-256"):
        ckpts.verify(4)
    assert ckpts.latest_valid() == 2


def test_a_step_that_verifies_is_kept_and_a_failed_write_leaves_nothing(ckpts):
    _save(ckpts, 3)
    before = (ckpts.path(3) / MANIFEST).read_bytes()
    again = Checkpoints(
        ckpts.root
    )  # another process: it verifies the step instead of writing it again
    again.save_sharded(
        3, lambda folder: pytest.fail("wrote a step that was intact"), {}, _state(3), OneRank()
    )
    assert (ckpts.path(3) / MANIFEST).read_bytes() == before

    def full_disk(folder: Path) -> None:
        (folder / "__0_0.distcp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(StorageError, match="step-5: the disk is full"):
        ckpts.save_sharded(5, full_disk, {}, _state(5), OneRank())
    assert not ckpts.path(5).exists() and not list(ckpts.root.glob(".tmp-*"))


def test_pickled_objects_in_the_shards_are_refused_not_run(ckpts, tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    _save(
        ckpts, 1, extra={"lr": Evil()}
    )  # among the optimizer's settings: non-tensor items, pickled
    module, optimizer = _trained(7)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_shards(ckpts.path(1) / SHARDS, module, optimizer)
    assert not marker.exists()

    _save(ckpts, 2)
    metadata = ckpts.path(2) / SHARDS / ".metadata"
    import pickle

    metadata.write_bytes(pickle.dumps(Evil()))
    _rewrite_manifest(ckpts.path(2))
    with pytest.raises(
        CheckpointError, match=r"\.metadata cannot be read .*posix.system is not allowed"
    ):
        ckpts.load_weights(2, module)
    assert not marker.exists()


def test_shards_of_another_model_are_a_mismatch(ckpts):
    _save(ckpts, 1)
    other = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    with pytest.raises(CheckpointMismatch, match=r"shapes differ: 0.bias \(4,\) vs \(5,\)"):
        ckpts.load_weights(1, other)
    with pytest.raises(CheckpointMismatch, match="missing 3.bias, 3.weight"):
        ckpts.load_weights(1, nn.Sequential(*_trained(0)[0], nn.Linear(1, 1).double()))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight


def test_export_writes_every_name_for_plain_load_state_dict(ckpts, tmp_path):
    module, _ = _save(ckpts, 2)
    out = tmp_path / "sharded.safetensors"
    assert ckpts.export(2, out) == len(get_model_state_dict(module))
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    fresh.load_state_dict(load_file(str(out)))  # strict: every name, no more
    assert torch.equal(fresh[2].weight, module[2].weight)

    tied = Tied()
    ckpts.save(3, tied, {"optimizer": {}, "schedulers": [], "scaler": {}}, _state(3))
    out = tmp_path / "whole.safetensors"
    assert ckpts.export(3, out) == 2  # the tied weight under both of its names
    fresh = Tied()
    fresh.load_state_dict(load_file(str(out)))
    assert torch.equal(fresh.out.weight, tied.embed.weight)


def test_export_refuses_a_file_whose_metadata_ties_more_copies_than_it_holds(ckpts, tmp_path):
    """Each alias in a safetensors file's metadata is a name export writes a copy under: 200 of
    them would make a file 200 times its size. A reader that only loads the weights into a model
    gets the tied names as the same tensor, whatever their number."""
    from safetensors.torch import save_file

    from phalanx.weights import WEIGHTS, whole_state

    tied = Tied()
    ckpts.save(3, tied, {"optimizer": {}, "schedulers": [], "scaler": {}}, _state(3))
    weights = ckpts.path(3) / WEIGHTS
    aliases = {f"copy{i}": "embed.weight" for i in range(200)}
    save_file({"embed.weight": tied.embed.weight.detach()}, str(weights), metadata=aliases)
    _rewrite_manifest(ckpts.path(3))
    state = whole_state(weights)
    assert len(state) == 201 and all(state[name] is state["embed.weight"] for name in aliases)
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="ties 200 more names to its tensors") as info:
        ckpts.export(3, out)
    assert str(weights) in str(info.value) and not out.exists()


def _crafted_metadata(ckpts: Checkpoints, step: int, change) -> Path:
    """Step `step`'s `.metadata` as torch wrote it, with `change(metadata)` made to it, its manifest
    rewritten to match (as a crafted run would be)."""
    import pickle

    path = ckpts.path(step) / SHARDS / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # a test's own file: the real records, read in full
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(ckpts.path(step))
    return path


def _tensor(metadata, key: str = "model.0.weight"):
    return metadata.state_dict_metadata[key]


def _stored(metadata, index: int = 0):
    return sorted(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset))[index]


def _referenced(metadata) -> None:
    """One chunk record listed 20,000 times: the pickle refers to it again at 2 bytes each, and
    torch's reader would read it 20,000 times."""
    entry = _tensor(metadata)
    entry.chunks = [entry.chunks[0]] * 20_000


def _huge(metadata) -> None:
    """A float64 tensor of 2^41 elements (16 TB), in the chunk that holds 12."""
    entry = _tensor(metadata)
    entry.size = entry.chunks[0].sizes = torch.Size([2**20, 2**21])


def _overlapping(metadata) -> None:
    _stored(metadata, 1).offset = _stored(metadata, 0).offset


@pytest.mark.parametrize(
    "change, words",
    [
        (_referenced, "its tensors have 20,0.. chunks, but .. stored items"),
        (_huge, "model.0.weight' at \\(0, 0\\) has 2,199,023,255,552 elements, more than"),
        (lambda m: setattr(_stored(m), "offset", 10**9), "which has"),
        (_overlapping, "overlap"),
        (lambda m: setattr(_stored(m), "transform_descriptors", ["zstd"]), "stored transformed"),
        (lambda m: _tensor(m).chunks.append(_tensor(m).chunks[0]), "at \\(0, 0\\) twice"),
        (lambda m: setattr(_tensor(m).chunks[0], "sizes", torch.Size([2, 3])), "hold 6 elements"),
    ],
    ids=["one-chunk-many-times", "16-tb", "past-its-file", "overlap", "compressed", "twice", "gap"],
)
def test_metadata_that_claims_more_than_its_files_hold_is_a_damaged_step(
    ckpts, tmp_path, change, words
):
    """Every claim of `.metadata` is bounded by the files its step holds, before anything is read
    or allocated: the error is the metadata's (not a read's, nor the allocator's), and a resume,
    `init_from` and `export` read through the same check."""
    _save(ckpts, 2)
    _save(ckpts, 4)
    path = _crafted_metadata(ckpts, 4, change)
    assert path.stat().st_size < 50_000
    model, _ = _trained(7)
    refused = rf"\.metadata is not checkpoint metadata as torch writes it \(.*{words}"
    with pytest.raises(CheckpointError, match=refused):
        ckpts.load_weights(4, model)
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match=refused):
        ckpts.export(4, out)
    assert not out.exists()
    assert ckpts.export(2, out) == 4  # the step before is sound


def _crafted(module: str, name: str, *args: str) -> bytes:
    """A pickle that calls module.name(*args) when loaded: what a crafted `.metadata` may hold."""
    import pickle

    text = b"".join(pickle.dumps(a, protocol=2)[2:-1] for a in args)  # each argument pushed
    return (
        b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"(" + text + b"tR."
    )  # GLOBAL, MARK, the arguments, TUPLE, REDUCE, STOP


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint._async_process_executor", "_AsyncCheckpointProcess"),
        ("torch.distributed.checkpoint.staging", "_ReplicationStager"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.nn", "Linear"),
    ],
)
def test_metadata_that_names_any_other_torch_class_is_a_damaged_step(ckpts, tmp_path, module, name):
    """A crafted `.metadata` (its manifest rewritten to match, as a whole crafted run would be) that
    names a class beyond torch's metadata records: refused before anything is built, and the step
    is damaged, so that a resume takes the one before."""
    _save(ckpts, 2)
    _save(ckpts, 4)
    made = tmp_path / "made-by-the-file"
    (ckpts.path(4) / SHARDS / ".metadata").write_bytes(_crafted(module, name, str(made)))
    _rewrite_manifest(ckpts.path(4))
    model, _ = _trained(7)
    with pytest.raises(CheckpointError, match=rf"{name} is not allowed in a checkpoint's metadata"):
        ckpts.load_weights(4, model)
    with pytest.raises(CheckpointError, match="the checkpoint is damaged"):
        ckpts.export(4, tmp_path / "model.safetensors")
    assert not made.exists() and not (tmp_path / "model.safetensors").exists()


def test_metadata_of_the_wrong_type_or_naming_a_file_outside_the_step_is_damaged(ckpts, tmp_path):
    import pickle

    _save(ckpts, 2)
    folder = ckpts.path(2)
    metadata_path = folder / SHARDS / ".metadata"
    original = metadata_path.read_bytes()
    model, _ = _trained(7)
    metadata_path.write_bytes(pickle.dumps(["not", "metadata"]))
    _rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match="it holds a list, not checkpoint metadata"):
        ckpts.load_weights(2, model)
    # the tensors said to lie outside the step, in a file no hash covers
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((folder / SHARDS / "__0_0.distcp").read_bytes())
    metadata = pickle.loads(original)  # a test's own file: the real records, read in full
    for info in metadata.storage_data.values():
        info.relative_path = "../../../outside.distcp"
    metadata_path.write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match="'../../../outside.distcp', which is not a file of"):
        ckpts.export(2, tmp_path / "model.safetensors")
    # a manifest that names a file outside the step is damaged itself
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["../outside.distcp"] = {"size": 1, "sha256": "0" * 64}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a file inside the step"):
        ckpts.verify(2)


@pytest.mark.timeout(180)
def test_a_resume_falls_back_past_a_step_whose_metadata_names_another_class(tmp_path, monkeypatch):
    """fsdp on one device (a group of one, in this process) saves sharded steps; the newest one's
    `.metadata` crafted to build a stager: the resume names it and takes the one before."""
    import toy

    import phalanx

    monkeypatch.chdir(tmp_path)
    raw = toy.regression_config(
        parallel={"accelerator": "cpu", "strategy": "fsdp"},
        checkpoints={"keep_last": 5},
        hooks=["SaveLatest"],
    )
    run = phalanx.fit(raw)
    steps = Checkpoints(run.run_dir / "checkpoints").steps()
    assert run.code == 0 and len(steps) == 2 and any((run.run_dir / "checkpoints").glob("*/shards"))
    newest = run.run_dir / "checkpoints" / f"step-{steps[-1]}"
    made = tmp_path / "made-by-the-file"
    (newest / SHARDS / ".metadata").write_bytes(
        _crafted("torch.distributed.checkpoint.staging", "_ReplicationStager", str(made))
    )
    _rewrite_manifest(newest)
    again = phalanx.resume(run.run_dir, overrides=["main_loop.epochs=3"])
    said = (run.run_dir / "log.txt").read_text()
    assert again.code == 0 and not made.exists()
    assert f"skipping checkpoint step-{steps[-1]}: " in said and "_ReplicationStager" in said
    assert f"resuming {run.run_dir} from step {steps[0]}" in said


def test_shards_keep_the_optimizers_settings_per_parameter_and_load_into_a_part_of_the_model(
    ckpts,
):
    """`save_shards` writes the optimizer's settings per parameter, as a pipeline's stages, each
    holding different parameters, must; the whole model reads them back, and so does a part of it
    (a stage), checked against the whole model's names."""
    from phalanx.shards import save_shards

    module, optimizer = _trained(5)
    for group in optimizer.param_groups:
        group["lr"] = 0.125  # a setting that is not the default: it must come back

    def write(folder: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a single process without a group
            save_shards(folder, module, optimizer)

    ckpts.save_sharded(
        5, write, {"optimizer": None, "schedulers": [], "scaler": {}}, _state(5), OneRank()
    )
    shards = ckpts.path(5) / SHARDS
    fresh, fresh_optimizer = _trained(99)
    load_shards(shards, fresh, fresh_optimizer)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.125
    for mine, saved in zip(fresh.parameters(), module.parameters(), strict=True):
        assert torch.equal(mine, saved)
    for mine, saved in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert torch.equal(mine["exp_avg"], saved["exp_avg"])

    whole = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    part, _ = _trained(98)
    part[0] = nn.Identity()  # the first stage's module gone: this process holds the rest
    part_optimizer = torch.optim.AdamW(part.parameters(), lr=0.01)
    load_shards(shards, part, part_optimizer, whole=whole)
    assert torch.equal(part[2].weight, module[2].weight)
    assert part_optimizer.param_groups[0]["lr"] == 0.125
    with pytest.raises(CheckpointMismatch, match="unexpected 0.bias, 0.weight"):
        load_shards(shards, part, part_optimizer)  # a part, unless it says so
    other = {**whole, "2.weight": (2, 4)}
    with pytest.raises(CheckpointMismatch, match="shapes differ: 2.weight"):
        load_shards(shards, part, part_optimizer, whole=other)
