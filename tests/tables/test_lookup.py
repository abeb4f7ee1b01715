"""Tests of gap_engine.tables.lookup: a cached table is found before anything loads, and a changed input misses.

A tiny Llama saved as a local folder and a local text file stand in for the model and the
text (the real SmolLM2 tokenizer reads real news text), each test in a cache of its own; the
last test runs the built-in model's path in a fresh process to see that it never imports torch.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from app_fixtures import link_models, tiny_table  # noqa: F401  (tiny_table: a fixture)

from gap_engine.cli import main
from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import load_corpus
from gap_engine.model.units import has_attention_ties
from gap_engine.tables import cache
from gap_engine.tables.artefact import LossTable, TableSpec
from gap_engine.tables.lookup import find_table

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

ROOT = Path(__file__).resolve().parents[2]
SPEC_ARGS = ["--samples", "2", "--seq-len", "16", "--rates", "0,0.5", "--device", "cpu"]


@pytest.fixture
def inputs(tmp_path, monkeypatch, make_tiny):
    """(model folder, text file) in a fresh cache: a tiny Llama and 40 real news articles."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tiny-model"
    tiny = make_tiny("llama", initializer_range=0.2)
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    text = tmp_path / "calibration.txt"
    text.write_text("\n\n".join(load_corpus("news-sample").calibration[:40]) + "\n")
    return folder, text


def table_argv(folder: Path, text: Path, out: Path) -> list[str]:
    return ["table", "--model", str(folder), "--data", str(text), *SPEC_ARGS, "--out", str(out)]


def spec_of(text: Path) -> TableSpec:
    return TableSpec(windows=WindowSpec(data=str(text), n_samples=2, seq_len=16), rate_grid=(0.0, 0.5), estimator="fisher", objective="kl")


def refuse(*args, **kwargs):
    raise AssertionError("a cache hit loaded a model or read the text")


class CountedLoads:
    """``load_model`` that counts its calls and loads."""

    def __init__(self):
        from gap_engine.model import loading

        self.real, self.calls = loading.load_model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def built_key(out: Path) -> str:
    return LossTable.from_json(out.read_text()).key


def test_a_hit_loads_no_model_and_reads_no_text(inputs, tmp_path, monkeypatch, caplog):
    folder, text = inputs
    caplog.set_level(logging.INFO, "gap_engine.tables.lookup")
    first = tmp_path / "first.json"
    assert main(table_argv(folder, text, first)) == 0
    for target in ("model.loading.load_model", "model.loading.load_tokenizer", "data.windows.read_corpus", "pipeline.stages.loss_table"):
        monkeypatch.setattr(f"gap_engine.{target}", refuse)
    again = tmp_path / "again.json"
    assert main(table_argv(folder, text, again)) == 0
    assert again.read_bytes() == first.read_bytes()
    assert "found without loading the model" in caplog.text
    assert find_table(str(folder), spec_of(text)).key == built_key(first)


def test_a_rewritten_weight_file_misses(inputs, tmp_path, monkeypatch, make_tiny):
    folder, text = inputs
    first = tmp_path / "first.json"
    assert main(table_argv(folder, text, first)) == 0
    other = make_tiny("llama", initializer_range=0.2, seed=1)  # same shapes and sizes, other weights
    other.model.save_pretrained(folder)
    assert find_table(str(folder), spec_of(text)) is None
    loads = CountedLoads()
    monkeypatch.setattr("gap_engine.model.loading.load_model", loads)
    second = tmp_path / "second.json"
    assert main(table_argv(folder, text, second)) == 0
    assert loads.calls == 1
    assert built_key(second) != built_key(first)
    assert LossTable.from_json(second.read_text()).model_fingerprint == other.fingerprint
    # Recorded by that load: the next identical command is a hit again.
    assert find_table(str(folder), spec_of(text)).key == built_key(second)


def test_a_weight_file_written_again_unchanged_misses_the_lookup_but_not_the_cache(inputs, tmp_path, monkeypatch):
    folder, text = inputs
    first = tmp_path / "first.json"
    assert main(table_argv(folder, text, first)) == 0
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data)  # the same bytes, a new stamp: the lookup cannot know they are the same
    assert find_table(str(folder), spec_of(text)) is None
    loads = CountedLoads()
    monkeypatch.setattr("gap_engine.model.loading.load_model", loads)
    monkeypatch.setattr("gap_engine.pipeline.stages.measure_table", refuse)  # found under the loaded model's key
    again = tmp_path / "again.json"
    assert main(table_argv(folder, text, again)) == 0
    assert loads.calls == 1 and again.read_bytes() == first.read_bytes()


def test_an_edited_text_misses(inputs, tmp_path, monkeypatch):
    folder, text = inputs
    first = tmp_path / "first.json"
    assert main(table_argv(folder, text, first)) == 0
    text.write_text(text.read_text().replace("the", "a", 1))
    assert find_table(str(folder), spec_of(text)) is None
    loads = CountedLoads()
    monkeypatch.setattr("gap_engine.model.loading.load_model", loads)
    second = tmp_path / "second.json"
    assert main(table_argv(folder, text, second)) == 0
    assert loads.calls == 1
    assert LossTable.from_json(second.read_text()).data_fingerprint != LossTable.from_json(first.read_text()).data_fingerprint


def test_other_settings_or_device_dtype_miss(inputs, tmp_path):
    folder, text = inputs
    assert main(table_argv(folder, text, tmp_path / "first.json")) == 0
    from gap_engine.core.device import DeviceSpec

    assert find_table(str(folder), spec_of(text), DeviceSpec("cpu", "float32")) is not None
    assert find_table(str(folder), spec_of(text), DeviceSpec("cpu", "bfloat16")) is None  # a bf16 table has its own key
    other = TableSpec(
        windows=WindowSpec(data=str(text), n_samples=2, seq_len=16), rate_grid=(0.0, 0.25), estimator="fisher", objective="kl"
    )
    assert find_table(str(folder), other) is None


def test_an_entry_that_is_not_for_these_inputs_is_not_served(inputs, tmp_path):
    # Another model's table put under this key, with its checksum made to match: the cache's
    # own checks pass, the identity the lookup expects does not.
    folder, text = inputs
    first = tmp_path / "first.json"
    assert main(table_argv(folder, text, first)) == 0
    key = built_key(first)
    data = json.loads(first.read_text())
    data["model_fingerprint"] = "0" * 16
    forged = LossTable.from_json(json.dumps(data))
    cache.put_table(forged)
    assert cache.get_table(key) is not None
    assert find_table(str(folder), spec_of(text)) is None


def test_prune_budget_takes_the_cached_table(inputs, tmp_path, monkeypatch):
    folder, text = inputs
    assert main(table_argv(folder, text, tmp_path / "first.json")) == 0
    monkeypatch.setattr("gap_engine.pipeline.iterative.loss_table", refuse)
    argv = ["prune", "--model", str(folder), "--data", str(text), *SPEC_ARGS, "--budget", "0.2", "--out", str(tmp_path / "pruned")]
    assert main(argv) == 0
    assert (tmp_path / "pruned" / "gap_pruned.json").is_file()


@pytest.mark.slow
def test_the_builtin_models_hit_imports_no_torch(tiny_table, smol, tmp_path, monkeypatch):
    from gap_engine.data.bos import window_start
    from gap_engine.data.sources import record_fingerprint, text_stamps
    from gap_engine.model.identity import ModelIdentity, model_stamps, record_model

    cache_dir = tmp_path / "cache"
    link_models(cache_dir)
    monkeypatch.setenv("GAP_CACHE_DIR", str(cache_dir))
    cache.put_table(tiny_table)
    # What loading the model and reading the text record (the tiny folder tests above see them do it).
    record_model(
        model_stamps("smollm2-135m"),
        ModelIdentity(smol.fingerprint, smol.num_layers, window_start(smol.tokenizer), has_attention_ties(smol)),
    )
    record_fingerprint(text_stamps("news-sample"), load_corpus("news-sample").fingerprint)
    out = tmp_path / "t.json"
    argv = ["table", "--model", "smollm2-135m", "--data", "news-sample", "--samples", "2", "--seq-len", "16"]
    argv += ["--estimator", "taylor", "--objective", "nll", "--rates", "0,0.25,0.5,0.75", "--device", "cpu", "--out", str(out)]
    code = f"import sys; from gap_engine.cli import main; rc = main({argv!r}); print(rc, 'torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.stdout.splitlines()[-1:] == ["0 False"], done.stdout + done.stderr
    assert LossTable.from_json(out.read_text()).key == tiny_table.key


@pytest.mark.slow
def test_a_mixed_table_is_found_without_loading_and_keyed_apart_from_each_source(smol, tmp_path, monkeypatch):
    from gap_engine.data.bos import window_start
    from gap_engine.data.sources import record_fingerprint, text_stamps
    from gap_engine.model.identity import ModelIdentity, model_stamps, record_model
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.tables.artefact import table_key

    cache_dir = tmp_path / "cache"
    link_models(cache_dir)
    monkeypatch.setenv("GAP_CACHE_DIR", str(cache_dir))
    # What loading the model and reading each text record (the built-in texts are read once per process).
    record_model(
        model_stamps("smollm2-135m"),
        ModelIdentity(smol.fingerprint, smol.num_layers, window_start(smol.tokenizer), has_attention_ties(smol)),
    )
    fingerprints = {source: load_corpus(source).fingerprint for source in ("wiki-sample", "news-sample")}
    for source, fingerprint in fingerprints.items():
        record_fingerprint(text_stamps(source), fingerprint)

    def spec(data: str) -> TableSpec:
        return TableSpec(windows=WindowSpec(data=data, n_samples=2, seq_len=32), rate_grid=(0.0, 0.5), estimator="fisher", objective="kl")

    mixed = spec("wiki-sample,news-sample")
    assert find_table("smollm2-135m", mixed) is None
    built = loss_table(smol, mixed)
    for target in ("model.loading.load_model", "model.loading.load_tokenizer", "data.windows.read_corpus"):
        monkeypatch.setattr(f"gap_engine.{target}", refuse)
    found = find_table("smollm2-135m", mixed)
    assert found is not None and found.key == built.key and found.spec.windows.sources() == ("wiki-sample", "news-sample")
    singles = {table_key(smol, spec(source), fingerprint) for source, fingerprint in fingerprints.items()}
    assert built.key not in singles and len(singles) == 2
    assert find_table("smollm2-135m", spec("news-sample,wiki-sample")) is None  # the order is part of the key
