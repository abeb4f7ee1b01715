"""A model is its content: weights edited in place (same size, same modification time), a
changed config.json or a changed tokenizer give a new fingerprint, so the table cache, the
no-load lookup and the table-versus-model check never serve a table of other inputs.

A tiny Llama saved as a folder (MLP matrices of 64 x 256 values, large enough that a strided
sample of each tensor skips most of them) and real news text, each test in a cache of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import TableError
from gap_engine.core.fingerprint import sampled_state_fingerprint
from gap_engine.data.windows import load_corpus
from gap_engine.model.loading import load_model
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.lookup import find_table

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

TEXT = "calibration.txt"  # a file of the test's own: a text read earlier in this process records its hash in no new cache


def spec_in(folder: Path) -> TableSpec:
    windows = WindowSpec(str(folder.parent / TEXT), n_samples=2, seq_len=16, batch_size=2)
    return TableSpec(windows=windows, estimator="fisher", rate_grid=(0.0, 0.5))


@pytest.fixture
def folder(tmp_path, monkeypatch, make_tiny) -> Path:
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / TEXT).write_text("\n\n".join(load_corpus("news-sample").calibration[:40]) + "\n")
    out = tmp_path / "tiny"
    tiny = make_tiny("llama", intermediate_size=256, initializer_range=0.2)
    tiny.model.save_pretrained(out)
    tiny.tokenizer.save_pretrained(out)
    return out


def edit_in_place(path: Path, edit) -> None:
    """Rewrite ``path`` through ``edit`` (text -> text, or tensors -> tensors for safetensors),
    then give it back its modification time."""
    before = os.stat(path)
    if path.suffix == ".safetensors":
        save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    else:
        path.write_text(edit(path.read_text()))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def scale_unsampled_mlp_values(state):
    """Multiply every fourth MLP value, starting at the second, by 8: the values a strided
    sample of ~4,096 per tensor never reads (a 16,384-value matrix is sampled every 4th)."""
    for name, tensor in state.items():
        if ".mlp." in name:
            flat = tensor.reshape(-1)
            flat[1::4] *= 8
    return state


def test_weights_edited_in_place_get_a_new_table(folder):
    spec = spec_in(folder)
    weights = folder / "model.safetensors"
    lm = load_model(str(folder))
    old = loss_table(lm, spec)
    assert find_table(str(folder), spec) is not None
    size, old_sample = weights.stat().st_size, sampled_state_fingerprint(load_file(weights))
    edit_in_place(weights, scale_unsampled_mlp_values)
    assert weights.stat().st_size == size and sampled_state_fingerprint(load_file(weights)) == old_sample  # what the sample saw
    assert find_table(str(folder), spec) is None  # the no-load lookup misses: the file's stamp changed
    edited = load_model(str(folder))
    assert edited.fingerprint != lm.fingerprint
    with pytest.raises(TableError, match="fingerprint"):
        old.check_model(edited)  # `gap plan --model m --table old.json`
    new = loss_table(edited, spec)
    assert new.key != old.key and new.model_fingerprint == edited.fingerprint
    assert (new.delta != old.delta).any()  # the edited model's cells, measured, not the old ones served


@pytest.mark.parametrize(
    ("file", "edit"),
    [
        ("config.json", lambda text: json.dumps(json.loads(text) | {"rms_norm_eps": 1e-3})),
        ("config.json", lambda text: json.dumps(json.loads(text) | {"hidden_act": "gelu"})),
        ("config.json", lambda text: json.dumps(json.loads(text) | {"rope_theta": 50_000.0, "rope_parameters": None})),
        ("tokenizer.json", lambda text: json.dumps(json.loads(text) | {"normalizer": {"type": "Lowercase"}})),
    ],
    ids=["rms_norm_eps", "hidden_act", "rope_theta", "tokenizer"],
)
def test_a_changed_config_or_tokenizer_gets_a_new_table(folder, file, edit):
    spec = spec_in(folder)
    lm = load_model(str(folder))
    old = loss_table(lm, spec)
    edit_in_place(folder / file, edit)
    assert find_table(str(folder), spec) is None
    changed = load_model(str(folder))
    assert changed.fingerprint != lm.fingerprint
    new = loss_table(changed, spec)
    assert new.key != old.key


def test_an_unchanged_folder_keeps_its_fingerprint_without_hashing_again(folder, monkeypatch):
    first = load_model(str(folder))
    from gap_engine.model import loaded

    def refuse(*args, **kwargs):
        raise AssertionError("unchanged files were hashed again")

    monkeypatch.setattr(loaded, "weights_fingerprint", refuse)
    assert load_model(str(folder)).fingerprint == first.fingerprint


def test_a_fingerprint_is_the_same_on_every_path_to_the_same_model(folder, tmp_path):
    """Loaded from the folder, recomputed in memory, and saved again then loaded: one identity."""
    from gap_engine.model.loaded import model_fingerprint

    lm = load_model(str(folder))
    assert model_fingerprint(lm.model, lm.tokenizer) == lm.fingerprint
    again = tmp_path / "again"
    lm.model.save_pretrained(again)
    lm.tokenizer.save_pretrained(again)
    assert load_model(str(again)).fingerprint == lm.fingerprint


def test_a_checkpoint_from_before_content_fingerprints_still_loads_and_is_still_checked(folder, tmp_path):
    """Its marker records a sample of the weights (format 1): loading verifies that sample, and
    `gap plan`'s no-load check does not compare it with a table's content fingerprint."""
    from gap_engine.model.checkpoint import PRUNED_MARKER, save_pruned
    from gap_engine.model.loading import recorded_identity
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.prune.importance import compute_importance
    from gap_engine.prune.surgery import apply_plan

    lm = load_model(str(folder))
    ids = lm.tokenizer("A short text to score the heads and channels of a tiny model.", return_tensors="pt").input_ids
    result = apply_plan(lm, uniform_plan(lm, 0.25, "magnitude"), compute_importance(lm, ids, "magnitude"))
    out = save_pruned(lm, result.plan, result.kept_indices(), tmp_path / "old", dtype="float32")
    marker_path = out / PRUNED_MARKER
    marker = json.loads(marker_path.read_text())
    assert recorded_identity(str(out))[1] == marker["fingerprint"] == lm.fingerprint
    del marker["fingerprint_format"]
    marker["fingerprint"] = sampled_state_fingerprint(load_file(out / "model.safetensors"))
    marker_path.write_text(json.dumps(marker))
    assert recorded_identity(str(out))[1] is None
    assert load_model(str(out)).fingerprint == lm.fingerprint
    marker["fingerprint"] = "0" * 16
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(Exception, match="differs from the recorded"):
        load_model(str(out))


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_a_builtin_has_one_fingerprint_converted_and_read_back(name, tmp_path, monkeypatch):
    """The first load converts the GGUF in memory; later loads read the converted folder. Both
    must name the model alike, or a table built on the first run would be missed (and a
    checkpoint pruned from it refused) on every later one. (Gemma's tokenizer converted from
    GGUF says add_bos_token True, read back False; both add the same BOS.)"""
    from gap_engine.model.loaded import model_fingerprint

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    converted = load_model(name)
    read_back = load_model(name)
    assert model_fingerprint(read_back.model, read_back.tokenizer) == converted.fingerprint
