"""How models are named in records (``model.names``): absolute local paths, built-ins and hub ids as
given, and older relative records read against their own folder."""

from __future__ import annotations

import os

from gap_engine.model.names import recorded_name, resolve_recorded


def test_a_local_folder_is_recorded_absolute_and_names_stay_as_given(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert recorded_name("m") == str(tmp_path / "m")
    assert recorded_name("./m/../m") == str(tmp_path / "m")
    assert recorded_name("w.gguf") == str(tmp_path / "w.gguf")
    assert recorded_name(str(tmp_path / "m")) == str(tmp_path / "m")
    assert recorded_name("smollm2-135m") == "smollm2-135m"
    assert recorded_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # nothing local of that name
    (tmp_path / "link").symlink_to(tmp_path / "m")
    assert recorded_name("link") == str(tmp_path / "link")  # the user's name for it, not where it points


def test_a_relative_record_is_read_against_the_records_folder(tmp_path, monkeypatch):
    (tmp_path / "records" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # not the records' folder
    assert resolve_recorded("m", tmp_path / "records") == str(tmp_path / "records" / "m")
    assert resolve_recorded("gone", tmp_path / "records") == "gone"  # nothing there: as it is, the loader says why
    assert resolve_recorded("/abs/m", tmp_path / "records") == "/abs/m"
    assert resolve_recorded("smollm2-135m", tmp_path / "records") == "smollm2-135m"
    assert resolve_recorded(None, tmp_path) is None
    assert os.path.isabs(resolve_recorded("m/../m", tmp_path / "records") or "")
