"""The one-line form of an error that phalanx's messages quote."""

from __future__ import annotations

import errno

import pytest
import torch

from phalanx.errors import count, first_line, named


def test_first_line_is_the_first_line_with_text_its_spaces_collapsed():
    error = RuntimeError("\n  shapes   differ:\t(2, 3)\nTraceback follows\n")
    assert first_line(error) == "shapes differ: (2, 3)"


def test_an_error_without_text_is_named_by_its_type():
    assert first_line(KeyError()) == "KeyError"
    assert first_line(ValueError("  \n ")) == "ValueError"


def test_first_line_is_cut_to_its_limit():
    assert first_line(RuntimeError("x" * 1000), 300) == "x" * 300


def test_an_os_error_gives_its_reason_without_its_number_and_path():
    error = OSError(errno.ENOSPC, "No space left on device", "/runs/a/model.safetensors")
    assert first_line(error, os_reason=True) == "No space left on device"
    assert "/runs/a/model.safetensors" in first_line(error)
    # an OSError raised with a message alone has no reason of its own: the message
    assert first_line(OSError("read-only file system"), os_reason=True) == "read-only file system"


def test_count_names_one_and_many():
    assert count(1, "worker") == "1 worker"
    assert [count(0, "worker"), count(2, "process", "es")] == ["0 workers", "2 processes"]


def test_named_gives_the_type_and_the_text_once():
    assert named(ConnectionError("the server\n went away")) == "ConnectionError: the server"
    # an error without text is its type, not the type twice
    assert named(RuntimeError()) == "RuntimeError"
    assert named(TimeoutError("x" * 900), 10) == "TimeoutError: " + "x" * 10


def test_an_error_is_the_users_where_their_code_or_a_library_it_called_raised(tmp_path):
    """The user's frames and the error where the user's code raised, or a library it called;
    None (the whole traceback) where phalanx's own code raised under it, or no frame is theirs."""
    import importlib
    import sys

    from phalanx.errors import in_your_code

    (tmp_path / "users_module_for_errors.py").write_text(
        "import json\n"
        "from phalanx import construct\n\n"
        "def own():\n"
        "    raise ValueError('bad item')\n\n"
        "def library():\n"
        "    return json.loads('{')\n\n"
        "def phalanx_under():\n"
        "    return construct.import_object('nodots')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        users = importlib.import_module("users_module_for_errors")
    finally:
        sys.path.remove(str(tmp_path))
    said = {}
    for name in ("own", "library", "phalanx_under"):
        try:
            getattr(users, name)()
        except Exception as e:  # noqa: BLE001 - each kind of error, as the CLI catches it
            said[name] = in_your_code(e)
    assert said["own"].startswith("phalanx: error: your code raised this")
    assert "in own\n    raise ValueError('bad item')\nValueError: bad item" in said["own"]
    assert "in library\n    return json.loads('{')\n" in said["library"]
    assert "json/" not in said["library"] and said["library"].endswith("(char 1)")
    assert said["phalanx_under"] is None
    try:
        int("x")  # this test's own frame is outside phalanx and the libraries, as a user's is
    except ValueError as e:
        assert in_your_code(e) is not None


class _Unreadable(torch.utils.data.Dataset):
    """Item 3 cannot be read: a ValueError raised while handling a KeyError (a chain, whose last
    traceback is the error's)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            try:
                {}["missing"]
            except KeyError:
                raise ValueError(f"item {i}: no such record")  # noqa: B904 - the chain is the case
        return torch.tensor(i)


@pytest.mark.timeout(120)
def test_an_error_raised_in_a_dataloader_worker_is_said_by_the_users_frames_in_that_worker():
    """torch raises a worker's error again in the loader's process with the worker's traceback
    as text in its message: that text's frames of the user's code, and its error, are what is
    said, with the worker named."""
    from phalanx.errors import in_your_code

    loader = torch.utils.data.DataLoader(_Unreadable(), batch_size=2, num_workers=1)
    with pytest.raises(ValueError) as caught:
        list(loader)
    said = in_your_code(caught.value)
    assert said is not None, str(caught.value)
    head, *frames = said.splitlines()
    assert head == (
        "phalanx: error: your code raised this in DataLoader worker process 0 (--debug shows the "
        "whole traceback):"
    )
    assert "in __getitem__" in frames[0] and frames[1].strip().startswith("raise ValueError(")
    assert frames[-1] == "ValueError: item 3: no such record"
    assert "site-packages" not in said and "Caught" not in said and "^" not in said
    assert "KeyError" not in said and "During handling" in str(caught.value)
    # a message of that form that names no frame of the user's: said whole, as before
    assert in_your_code(RuntimeError("Caught RuntimeError in DataLoader worker process 0.")) is None
