"""Tests of gap_engine.core.filestamps: a remembered value is recalled only while its files are unchanged."""

import json
import os

import pytest

from gap_engine.core.filestamps import recall, record_path, remember, stamp_files


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("a.bin", "b.json"):
        (folder / name).write_bytes(name.encode() * 10)
    return sorted(folder.iterdir())


def test_a_value_is_recalled_while_its_files_are_unchanged(files):
    remember("model", "subject", stamp_files(files), {"fingerprint": "abc"})
    assert recall("model", "subject", stamp_files(files)) == {"fingerprint": "abc"}
    assert recall("model", "another subject", stamp_files(files)) is None
    assert recall("text", "subject", stamp_files(files)) is None


def test_a_rewritten_replaced_or_touched_back_file_is_a_miss(files):
    remember("model", "subject", stamp_files(files), {"fingerprint": "abc"})
    before = os.stat(files[0])
    files[0].write_bytes(b"x" * before.st_size)  # same size, new content
    assert recall("model", "subject", stamp_files(files)) is None

    remember("model", "subject", stamp_files(files), {"fingerprint": "def"})
    before = os.stat(files[0])
    files[0].write_bytes(b"y" * before.st_size)
    os.utime(files[0], ns=(before.st_atime_ns, before.st_mtime_ns))  # `touch -r`: the old modification time back
    assert os.stat(files[0]).st_mtime_ns == before.st_mtime_ns
    assert recall("model", "subject", stamp_files(files)) is None  # the status-change time moved

    remember("model", "subject", stamp_files(files), {"fingerprint": "ghi"})
    replacement = files[0].with_name("new.bin")
    replacement.write_bytes(files[0].read_bytes())
    os.replace(replacement, files[0])  # same bytes, another file
    assert recall("model", "subject", stamp_files(files)) is None


def test_an_added_or_missing_file_is_a_miss(files):
    remember("model", "subject", stamp_files(files), {"fingerprint": "abc"})
    extra = files[0].with_name("c.bin")
    extra.write_bytes(b"c")
    assert recall("model", "subject", stamp_files([*files, extra])) is None
    assert stamp_files([*files, files[0].with_name("gone.bin")]) is None
    assert recall("model", "subject", None) is None


@pytest.mark.parametrize("content", ["{", "[]", '{"format": 1}', "null"])
def test_a_damaged_record_is_a_miss_not_an_error(files, content):
    remember("model", "subject", stamp_files(files), {"fingerprint": "abc"})
    record_path("model", "subject").write_text(content)
    assert recall("model", "subject", stamp_files(files)) is None


def test_a_record_for_other_stamps_is_replaced_and_an_equal_one_not_rewritten(files):
    stamps = stamp_files(files)
    remember("model", "subject", stamps, {"fingerprint": "abc"})
    path = record_path("model", "subject")
    written = os.stat(path).st_mtime_ns, os.stat(path).st_ino
    remember("model", "subject", stamps, {"fingerprint": "abc"})
    assert (os.stat(path).st_mtime_ns, os.stat(path).st_ino) == written
    remember("model", "subject", stamps, {"fingerprint": "xyz"})
    assert json.loads(path.read_text())["value"] == {"fingerprint": "xyz"}
