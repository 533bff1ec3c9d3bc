"""The one rule for tests that read ../shared (conftest.shared_path): skip when absent, fail when required."""

import pathlib

import pytest
from conftest import REQUIRE_SHARED_ENV, SHARED, shared_path

MISSING = ("no-such-folder", "no-such-file.jsonl")


def test_absent_path_skips_with_its_name(monkeypatch):
    monkeypatch.delenv(REQUIRE_SHARED_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-file.jsonl") as info:
        shared_path(*MISSING)
    assert REQUIRE_SHARED_ENV in str(info.value)  # the reason says how to make it a failure


@pytest.mark.parametrize("value", ["0", ""])
def test_unset_or_zero_means_not_required(monkeypatch, value):
    monkeypatch.setenv(REQUIRE_SHARED_ENV, value)
    with pytest.raises(pytest.skip.Exception):
        shared_path(*MISSING)


def test_absent_path_fails_when_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_SHARED_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no-such-file.jsonl"):
        shared_path(*MISSING)


def test_present_path_is_returned(monkeypatch):
    monkeypatch.setenv(REQUIRE_SHARED_ENV, "1")
    if not SHARED.is_dir():
        pytest.skip(f"needs {SHARED}")
    present = next(SHARED.iterdir())
    assert shared_path(present.name) == present
    assert shared_path() == SHARED


def test_shared_is_beside_the_repository():
    repo = pathlib.Path(__file__).resolve().parents[1]
    assert SHARED == repo.parent / "shared"
