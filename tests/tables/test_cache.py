"""Tests of gap_engine.tables.cache and the table commands: hits, corruption, cancel/resume, locking, CLI.

Every test builds through ``pipeline.loss_table`` on a tiny model with real tokenised text, in a
cache folder of its own (GAP_CACHE_DIR points at tmp_path; the real model is never loaded
here, so the shared model cache is not needed).
"""

import json
import threading

import numpy as np
import pytest

from gap_engine.cli import main
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import CacheError, CancelledError
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import load_corpus
from gap_engine.pipeline.stages import loss_table as build_table
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec, table_key

SPEC = TableSpec(
    windows=WindowSpec(n_samples=2, seq_len=16, batch_size=2), rate_grid=(0.0, 0.25, 0.5, 0.75), estimator="exact", objective="nll"
)


def key_of(lm, spec: TableSpec) -> str:
    return table_key(lm, spec, load_corpus(spec.windows.data).fingerprint)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny(make_tiny):
    return make_tiny("llama", initializer_range=0.2)


class Counter:
    """A progress callback that counts the cells it is told about (one call per measured cell)."""

    def __init__(self, cancel_after: int | None = None, event: threading.Event | None = None):
        self.calls = []
        self.cancel_after = cancel_after
        self.event = event

    def __call__(self, done, total, eta):
        self.calls.append((done, total, eta))
        if self.cancel_after is not None and done >= self.cancel_after:
            self.event.set()

    @property
    def measured(self) -> int:
        return max(0, len(self.calls) - 1)  # the first call reports the starting point


def assert_same_table(a, b):
    assert a.key == b.key and a.components == b.components
    for name in ("delta", "smoothed", "cell_objective", "removed"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_second_build_is_a_cache_hit(tmp_cache, tiny):
    first_progress, second_progress = Counter(), Counter()
    first = build_table(tiny, SPEC, hooks=Hooks(progress=first_progress))
    assert first_progress.measured == first.extras["distinct_cells"] > 0
    second = build_table(tiny, SPEC, hooks=Hooks(progress=second_progress))
    assert second_progress.calls == []
    assert_same_table(first, second)
    entry = tmp_cache / "tables" / first.key
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "table.json"]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == first.key and meta["model"] == "tiny-llama" and meta["spec"]["n_samples"] == 2
    rows = cache.list_tables()
    assert [r["key"] for r in rows] == [first.key] and rows[0]["size"] > 0


@pytest.mark.slow
def test_no_cache_neither_reads_nor_writes(tmp_cache, tiny):
    build_table(tiny, SPEC, use_cache=False)
    assert cache.list_tables() == []
    build_table(tiny, SPEC)
    counter = Counter()
    build_table(tiny, SPEC, hooks=Hooks(progress=counter), use_cache=False)
    assert counter.measured > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "bad_meta", "no_table"])
@pytest.mark.slow
def test_a_corrupt_entry_is_detected_removed_and_rebuilt(tmp_cache, tiny, damage, caplog):
    table = build_table(tiny, SPEC)
    entry = tmp_cache / "tables" / table.key
    data = (entry / "table.json").read_bytes()
    if damage == "flip":
        pos = data.index(b'"delta":') + 12
        (entry / "table.json").write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :])
    elif damage == "truncate":
        (entry / "table.json").write_bytes(data[: len(data) // 2])
    elif damage == "bad_meta":
        (entry / "meta.json").write_text("{")
    else:
        (entry / "table.json").unlink()
    with caplog.at_level("WARNING", logger="gap_engine.tables.cache"):
        assert cache.get_table(table.key) is None
    assert "corrupt" in caplog.text
    assert not (entry / "table.json").exists() and not (entry / "meta.json").exists()
    counter = Counter()
    rebuilt = build_table(tiny, SPEC, hooks=Hooks(progress=counter))
    assert counter.measured == rebuilt.extras["distinct_cells"]
    assert_same_table(table, rebuilt)
    assert cache.get_table(table.key) is not None


def test_an_unfinished_entry_is_not_a_table(tmp_cache, tiny):
    key = key_of(tiny, SPEC)
    cache.PartialCells(key).save({(0, 1): (1.0, "units")})
    assert cache.get_table(key) is None
    assert cache.list_tables() == []


@pytest.mark.slow
def test_cancel_then_resume_gives_the_uninterrupted_table(tmp_cache, tiny):
    reference = build_table(tiny, SPEC, use_cache=False)
    total = reference.extras["distinct_cells"]
    event = threading.Event()
    first = Counter(cancel_after=3, event=event)
    with pytest.raises(CancelledError, match="3 of"):
        build_table(tiny, SPEC, hooks=Hooks(progress=first, cancel=event))
    assert first.measured == 3
    assert cache.get_table(reference.key) is None
    assert len(cache.PartialCells(reference.key).load()) == 3
    second = Counter()
    resumed = build_table(tiny, SPEC, hooks=Hooks(progress=second))
    assert second.calls[0][0] == 3  # starts from the saved cells
    assert first.measured + second.measured == total
    assert resumed.extras.pop("cpu_seconds") > 0  # this process's CPU time for the build: measured, so only its sign is known
    assert resumed.extras == {"cells_measured": total - 3, "cells_resumed": 3, "distinct_cells": total, "model_type": "llama"}
    assert_same_table(reference, resumed)
    assert not cache.PartialCells(reference.key).path.exists()


@pytest.mark.parametrize("estimator", ["exact", "refine"])
@pytest.mark.slow
def test_a_resume_whose_scores_rank_units_anew_measures_those_cells_again(tmp_cache, tiny, monkeypatch, estimator):
    from dataclasses import replace

    from gap_engine.tables import build

    spec = replace(SPEC, estimator=estimator)
    event = threading.Event()

    def progress(done, total, eta):
        if total > 1 and done >= 5:  # refine's estimate is one batch here: past it, cells are counted
            event.set()

    with pytest.raises(CancelledError):
        build_table(tiny, spec, hooks=Hooks(progress=progress, cancel=event))
    saved = cache.PartialCells(key_of(tiny, spec)).load()
    kept = [cell for cell in saved if cell[0] != 1]  # cells of every component but layer 0's MLP (component 1)
    assert 0 < len(kept) < len(saved)  # some of layer 0's MLP cells were measured before the cancel
    # The resume scores layer 0's MLP channels in the reverse order, as a near-tie can flip on
    # another device: its MLP cells now remove other channels; every other cell, the same units.
    score = build.compute_importance

    def channels_reversed(*args, **kwargs):
        scores = score(*args, **kwargs)
        scores.layers[0].channel = scores.layers[0].channel.flip(0)
        return scores

    monkeypatch.setattr(build, "compute_importance", channels_reversed)
    resumed = build_table(tiny, spec)
    assert_same_table(build_table(tiny, spec, use_cache=False), resumed)  # as if nothing had been saved
    assert resumed.extras["cells_resumed"] <= len(kept)  # never a cell cut on other channels
    if estimator == "exact":  # (refine's rounds may not ask for every saved cell again)
        assert resumed.extras["cells_resumed"] == len(kept)


@pytest.mark.slow
def test_unreadable_partial_cells_are_ignored(tmp_cache, tiny, caplog):
    key = key_of(tiny, SPEC)
    partial = cache.PartialCells(key)
    partial.path.parent.mkdir(parents=True)
    partial.path.write_text("[1, 2")
    with caplog.at_level("WARNING", logger="gap_engine.tables.cache"):
        assert partial.load() == {}
    assert "ignoring" in caplog.text
    counter = Counter()
    table = build_table(tiny, SPEC, hooks=Hooks(progress=counter))
    assert counter.measured == table.extras["distinct_cells"]


@pytest.mark.slow
def test_two_concurrent_builds_measure_the_table_once(tmp_cache, tiny):
    counters, results, errors = [Counter(), Counter()], [None, None], []

    def build(i):
        try:
            results[i] = build_table(tiny, SPEC, hooks=Hooks(progress=counters[i]))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(c.measured for c in counters) == results[0].extras["distinct_cells"]
    assert_same_table(results[0], results[1])


@pytest.mark.slow
def test_remove_table(tmp_cache, tiny):
    table = build_table(tiny, SPEC)
    cache.remove_table(table.key)
    assert cache.list_tables() == [] and cache.get_table(table.key) is None
    with pytest.raises(CacheError, match="no cached loss table"):
        cache.remove_table(table.key)
    for bad in ("../outside", "", "a/b"):
        with pytest.raises(CacheError):
            cache.get_table(bad)


@pytest.mark.slow
def test_tables_put_in_the_same_second_are_ordered_by_when_they_were_stored(tmp_cache, tiny):
    # The explorer opens the newest cached table; whole seconds tied two quick builds (CI saw it).
    import dataclasses

    first = build_table(tiny, SPEC)
    later = dataclasses.replace(first, key=first.key + "-later")
    cache.put_table(later)
    created = {row["key"]: row["created"] for row in cache.list_tables()}
    assert created[later.key] > created[first.key], created
    assert max(created, key=created.get) == later.key


# ---- the CLI -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_table_then_cache_ls_and_rm(tmp_cache, tiny, tmp_path, capsys):
    from gap_engine.tables.artefact import LossTable

    folder = tmp_path / "tiny-model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    out = tmp_path / "out" / "table.json"
    argv = [
        "table",
        "--model",
        str(folder),
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--rates",
        "0,0.5",
        "--estimator",
        "exact",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    table = LossTable.from_json(out.read_text())
    assert table.delta.shape == (4, 2) and table.spec.rate_grid == (0.0, 0.5)
    stdout = capsys.readouterr()
    assert table.key in stdout.out and "table cells: " in stdout.err

    assert main(argv[:-1] + [str(tmp_path / "table.csv")]) == 0
    assert (tmp_path / "table.csv").read_text().startswith("layer,component,rate,delta,smoothed,removed,measured,tokens\n")

    assert main(["cache", "ls"]) == 0
    assert table.key in capsys.readouterr().out
    assert main(["cache", "ls", "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == [table.key]

    assert main(["cache", "rm", table.key]) == 0
    assert cache.list_tables() == []
    capsys.readouterr()
    assert main(["cache", "rm", table.key]) == 2
    assert "no cached loss table" in capsys.readouterr().err


def _no_model_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the bad input was refused")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rates", "0.5,0.25"], "strictly increasing"),
        (["--rates", "0,x"], "comma-separated numbers"),
        (["--rates", "0.25,0.5"], "must start at 0"),
        (["--samples", "0"], "--samples must be at least 1"),
        (["--objective", "kl", "--estimator", "taylor"], "identically zero"),
        (["--out", "table.txt"], "must end in .json or .csv"),
    ],
)
def test_cli_table_rejects_bad_input_before_loading_a_model(tmp_cache, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setattr("gap_engine.model.loading.load_model", _no_model_load)
    argv = ["table", "--model", "smollm2-135m", "--out", str(tmp_path / "t.json"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gap: error: ") and message in err[0]


def test_cli_table_old_approx_flag_still_works(tmp_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("gap_engine.model.loading.load_model", _no_model_load)
    argv = ["table", "--model", "smollm2-135m", "--approx", "fisher", "--rates", "0.25,0.5", "--out", str(tmp_path / "t.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--approx is deprecated and will be removed in gap-engine 0.3.0; use --estimator" in err and "must start at 0" in err
