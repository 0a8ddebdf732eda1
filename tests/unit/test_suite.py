"""The suite as `make test` runs it (`pytest tests`): every test file under tests/ is collected."""

from __future__ import annotations

import fnmatch
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_folder_of_test_files_is_collected_by_pytest_tests(pytestconfig):
    # pytest leaves out a folder whose name matches one of `norecursedirs` (its default list has
    # "dist", which once kept the multi-process tests out of every run of the suite)
    skipped = pytestconfig.getini("norecursedirs")
    folders = {f.parent for f in TESTS.rglob("test_*.py")}
    assert TESTS / "dist" in folders
    left_out = {
        str(folder.relative_to(TESTS)): pattern
        for folder in folders
        for part in folder.relative_to(TESTS).parts
        for pattern in skipped
        if fnmatch.fnmatch(part, pattern)
    }
    assert not left_out, f"pytest tests would not collect these folders: {left_out}"
    assert [pytestconfig.rootpath / p for p in pytestconfig.getini("testpaths")] == [TESTS]
