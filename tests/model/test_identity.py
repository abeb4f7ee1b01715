"""Tests of gap_engine.model.identity: what a load records, read back while the model's files are unchanged."""

import pytest

from gap_engine.data.bos import window_start
from gap_engine.model.identity import BUILTIN_MODEL_NAMES, ModelIdentity, model_files, recorded_model
from gap_engine.model.loading import BUILTIN_MODELS, load_model
from gap_engine.model.units import has_attention_ties


def test_the_builtin_names_are_the_loaders():
    assert tuple(BUILTIN_MODELS) == BUILTIN_MODEL_NAMES


@pytest.fixture
def tiny_folder(tmp_path, monkeypatch, make_tiny):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    tiny = make_tiny("llama")
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_load_records_what_it_found_and_a_new_file_forgets_it(tiny_folder):
    assert recorded_model(str(tiny_folder)) is None
    lm = load_model(str(tiny_folder))
    recorded = ModelIdentity(lm.fingerprint, lm.num_layers, window_start(lm.tokenizer), has_attention_ties(lm))
    assert recorded_model(str(tiny_folder)) == recorded
    assert recorded_model(str(tiny_folder) + "/") == recorded  # one folder, however it is typed
    (tiny_folder / "notes.txt").write_text("a new file in the folder")
    assert recorded_model(str(tiny_folder)) is None


def test_what_has_no_files_here_has_no_record(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))  # no converted built-in in it
    assert model_files("smollm2-135m") is None
    assert model_files("HuggingFaceTB/SmolLM2-135M") is None
    assert model_files(str(tmp_path / "missing")) is None
    assert recorded_model("smollm2-135m") is None


def test_a_model_may_load_unless_it_is_a_local_path_that_is_gone(tmp_path):
    from gap_engine.model.identity import model_may_load

    assert model_may_load("smollm2-135m") and model_may_load("HuggingFaceTB/SmolLM2-135M")  # built-in, hub id
    assert model_may_load(str(tmp_path))
    for gone in (str(tmp_path / "deleted"), "./deleted", "~/no-such-model-here", "no-such-name", "a/b/c"):
        assert not model_may_load(gone), gone
