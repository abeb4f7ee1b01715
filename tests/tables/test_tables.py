"""Tests of gap_engine.tables: the fast exact build equals the naive one, and the table's invariants.

Tiny two-layer models from configs check exactness against the naive reference (one full
forward of a sliced copy per cell) for every family; the real SmolLM2-135M with tiny
settings checks the shapes, parameter counts and that the gradient estimates rank cells
like the measured table.
"""

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from reference import naive_build_table
from scipy.optimize import isotonic_regression
from scipy.stats import spearmanr

from gap_engine.core.config import FULL_RATE_GRID, WindowSpec
from gap_engine.core.errors import TableError
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loaded import model_fingerprint, weights_fingerprint
from gap_engine.model.slicing import slice_attention_, slice_mlp_, zeroed_units
from gap_engine.model.units import block_geometries
from gap_engine.tables.artefact import LossTable, TableSpec, isotonic_smooth, parse_rate_grid, table_key
from gap_engine.tables.build import measure_table
from gap_engine.tables.exact import measure_exact, window_cells
from gap_engine.tables.ledger import CellObjectives, CellRequest

GRID4 = (0.0, 0.25, 0.5, 0.75)


def random_windows(n: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))  # (N, T)


def spec_of(**fields) -> TableSpec:
    """A TableSpec from flat fields (window fields beside the table's own, as a table file records them)."""
    return TableSpec.from_dict(fields)


def tiny_spec(**kw) -> TableSpec:
    fields = dict(n_samples=3, seq_len=24, rate_grid=GRID4, batch_size=2)
    fields.update(kw)
    return spec_of(**fields)


def expected_removed(lm, table: LossTable) -> np.ndarray:
    geoms = block_geometries(lm)
    out = np.zeros_like(table.removed)
    for c, (layer, kind) in enumerate(table.components):
        parts = ("attn", "mlp") if kind == "block" else (kind,)
        for r, rate in enumerate(table.rate_grid):
            out[c, r] = sum(geoms[layer].removed_at(p, rate, table.spec.channel_multiple) for p in parts)
    return out


# ---- the spec ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"rate_grid": (0.0, 0.5, 1.0)},
        {"rate_grid": (0.0, -0.1, 0.5)},
        {"rate_grid": (0.0, 0.5, 0.25)},
        {"rate_grid": (0.0, 0.25, 0.25)},
        {"rate_grid": (0.25, 0.5)},
        {"rate_grid": (0.0,)},
        {"objective": "mse"},
        {"mode": "layer"},
        {"estimator": "hessian"},
        {"criterion": "random"},
        {"n_samples": 0},
        {"seq_len": 1},
        {"batch_size": 0},
        {"estimator": "taylor", "objective": "kl"},
    ],
)
def test_spec_rejects_bad_values_with_one_line(fields):
    with pytest.raises(TableError) as info:
        TableSpec.from_dict(fields).validate()
    assert "\n" not in str(info.value)


def test_default_spec_is_valid_and_grid_is_sixteenths():
    spec = TableSpec().validate()
    assert spec.rate_grid == FULL_RATE_GRID and len(FULL_RATE_GRID) == 16 and FULL_RATE_GRID[1] == 1 / 16


def test_parse_rate_grid():
    assert parse_rate_grid("0, 0.25,0.5") == (0.0, 0.25, 0.5)
    for bad in ("0,abc", "0,nan"):
        with pytest.raises(TableError):
            parse_rate_grid(bad)


# ---- smoothing -----------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(2, 9)), elements=st.floats(-2, 2)))
def test_isotonic_smooth_is_the_clipped_isotonic_fit(delta):
    smoothed = isotonic_smooth(delta)
    assert np.all(smoothed[:, 0] == 0)
    assert np.all(smoothed >= 0)
    assert np.all(np.diff(smoothed, axis=1) >= -1e-12)
    for c in range(delta.shape[0]):
        reference = np.maximum(isotonic_regression(delta[c, 1:]).x, 0.0)
        np.testing.assert_allclose(smoothed[c, 1:], reference, atol=1e-9)


def test_isotonic_smooth_keeps_a_monotone_row():
    row = np.array([[0.0, 0.1, 0.1, 0.4, 2.0]])
    np.testing.assert_array_equal(isotonic_smooth(row), row)


# ---- masking == slicing, exact == naive ---------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.slow
def test_masking_a_layer_equals_slicing_it(make_tiny, family):
    lm = make_tiny(family, initializer_range=0.2)
    layer = lm.adapter.layers(lm.model)[0]
    hidden = torch.randn(2, 24, 64)  # (B, T, d)
    captured = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: captured.update(args=a[1:], kwargs=dict(k)), with_kwargs=True)
    lm.model(input_ids=random_windows(2, 24), use_cache=False)
    handle.remove()
    kept_kv, kept_heads, kept_channels = [1], [2, 3], list(range(0, 96, 3))
    sliced = copy.deepcopy(layer)
    slice_attention_(lm.adapter, sliced, kept_kv, kept_heads)
    slice_mlp_(lm.adapter, sliced, kept_channels)
    removed_heads = (0, 1)
    removed_channels = tuple(c for c in range(96) if c not in kept_channels)
    before = weights_fingerprint(lm.model)
    with torch.no_grad():
        with zeroed_units(lm.adapter, layer, removed_heads, removed_channels):
            masked_out = layer(hidden, *captured["args"], **captured["kwargs"])
        sliced_out = sliced(hidden, *captured["args"], **captured["kwargs"])
    masked_out = masked_out[0] if isinstance(masked_out, tuple) else masked_out
    sliced_out = sliced_out[0] if isinstance(sliced_out, tuple) else sliced_out
    torch.testing.assert_close(masked_out, sliced_out, atol=1e-5, rtol=1e-5)
    assert weights_fingerprint(lm.model) == before


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.slow
def test_exact_table_equals_the_naive_build(make_tiny, family):
    lm = make_tiny(family, initializer_range=0.2)
    windows = random_windows(3, 24)
    spec = tiny_spec()
    before = weights_fingerprint(lm.model)
    fast = measure_table(lm, spec, windows)
    naive = naive_build_table(lm, spec, windows=windows)
    assert weights_fingerprint(lm.model) == before
    np.testing.assert_allclose(fast.cell_objective, naive.cell_objective, rtol=1e-5, atol=1e-5)
    assert fast.dense_objective == pytest.approx(naive.dense_objective, abs=1e-6)
    assert fast.delta.shape == (4, 4) and [k for _, k in fast.components] == ["attn", "mlp"] * 2
    assert np.all(fast.delta[:, 0] == 0)
    assert np.abs(fast.delta[:, 1:]).max() > 1e-4  # the cells really differ from dense
    np.testing.assert_array_equal(fast.removed, expected_removed(lm, fast))
    assert fast.dense_prunable == sum(g.params_at("attn", 0) + g.params_at("mlp", 0) for g in block_geometries(lm))


@pytest.mark.parametrize("objective", ["nll", "kl"])
@pytest.mark.slow
def test_block_mode_equals_naive_and_kl_is_non_negative(make_tiny, objective):
    lm = make_tiny("llama", initializer_range=0.2)
    windows = random_windows(3, 24, seed=1)
    spec = tiny_spec(mode="block", objective=objective)
    fast = measure_table(lm, spec, windows)
    naive = naive_build_table(lm, spec, windows=windows)
    np.testing.assert_allclose(fast.cell_objective, naive.cell_objective, rtol=1e-5, atol=1e-5)
    assert fast.components == [(0, "block"), (1, "block")]
    np.testing.assert_array_equal(fast.removed, expected_removed(lm, fast))
    if objective == "kl":
        assert fast.dense_objective == 0.0
        assert fast.delta.min() >= -1e-7
        assert fast.delta[:, 1:].min() > 0


@pytest.mark.slow
def test_a_cell_filler_gets_one_request_and_its_values_make_the_table(make_tiny):
    lm, spec, windows = make_tiny("llama"), tiny_spec(), random_windows(3, 24)
    requests: list[CellRequest] = []

    def filler(request: CellRequest) -> CellObjectives:
        requests.append(request)
        values = measure_exact(request)
        return values._replace(stats=values.stats | {"filler": "test"})

    got = measure_table(lm, spec, windows, cells=filler)
    expected = measure_table(lm, spec, windows)
    assert len(requests) == 1 and requests[0].spec == spec and requests[0].windows is windows
    assert got.extras["filler"] == "test"
    np.testing.assert_array_equal(got.cell_objective, expected.cell_objective)


def test_measure_table_runs_the_filler_the_estimator_registers(make_tiny, monkeypatch, tmp_path):
    """An estimator is one declared filler: measure_table calls it with the request and builds
    the table from what it returns; a filler given in its place (Ray's) fills only exact tables."""
    import importlib

    from gap_engine.core.registry import Registry
    from gap_engine.tables import build
    from gap_engine.tables.estimators import Estimator

    (tmp_path / "fake_fillers.py").write_text("def registered_filler(request):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    lm, spec, windows = make_tiny("llama"), tiny_spec(criterion="magnitude", estimator="fisher"), random_windows(3, 24)
    calls: list[CellRequest] = []

    def filler(request: CellRequest) -> CellObjectives:
        calls.append(request)
        shape = (len(request.components), len(request.spec.rate_grid))
        objective = 2.0 + np.tile(np.arange(shape[1], dtype=np.float64), (shape[0], 1))  # delta = the rate index
        measured = np.zeros(shape, dtype=bool)
        measured[:, -1] = True
        return CellObjectives(objective, 2.0, {"filler": "registered"}, measured, None)

    monkeypatch.setattr(importlib.import_module("fake_fillers"), "registered_filler", filler)
    registry = Registry(
        "table estimator", Estimator, [Estimator("fisher", "a test filler", "fake_fillers:registered_filler", gradient_passes=5.0)]
    )
    monkeypatch.setattr(build, "ESTIMATORS", registry)
    table = measure_table(lm, spec, windows)
    assert len(calls) == 1 and calls[0].windows is windows and calls[0].spec == spec
    assert table.extras["filler"] == "registered" and table.dense_objective == 2.0
    np.testing.assert_array_equal(table.delta[0], np.arange(len(spec.rate_grid), dtype=np.float64))
    assert table.measured[:, -1].all() and not table.measured[table.removed[:, 1] > 0, 1].any()
    with pytest.raises(TableError, match="Ray workers measure exact cells; the fisher estimate"):
        measure_table(lm, spec, windows, cells=filler)
    assert len(calls) == 1  # refused before anything is scored or filled


@pytest.mark.slow
def test_cells_with_the_same_cut_are_measured_once(make_tiny):
    lm = make_tiny("llama", initializer_range=0.2)
    # 4 heads in 2 KV groups: rates 0.05 and 0.1 round to the dense attention, 0.5 and 0.55 to one shape.
    spec = tiny_spec(rate_grid=(0.0, 0.05, 0.1, 0.5, 0.55))
    seen = []
    table = measure_table(lm, spec, random_windows(3, 24), Hooks(progress=lambda d, t, e: seen.append((d, t))))
    assert table.extras["distinct_cells"] < len(table.components) * 4
    assert seen[-1][0] == seen[-1][1] == table.extras["distinct_cells"]
    attn = [c for c, (_, kind) in enumerate(table.components) if kind == "attn"]
    assert np.all(table.delta[attn][:, 1:3] == 0) and np.all(table.removed[attn][:, 1:3] == 0)
    np.testing.assert_array_equal(table.delta[attn][:, 3], table.delta[attn][:, 4])


@pytest.mark.slow
def test_window_cells_average_to_the_tables(make_tiny):
    lm = make_tiny("gemma3_text", initializer_range=0.2)
    windows = random_windows(4, 24, seed=2)
    cells = window_cells(lm, tiny_spec(), windows)
    assert cells.nll.shape == cells.kl.shape == (4, 4, 4)
    for objective in ("nll", "kl"):
        table = measure_table(lm, tiny_spec(objective=objective), windows)
        np.testing.assert_allclose(getattr(cells, objective).mean(-1), table.delta, rtol=1e-6, atol=1e-7)
    assert cells.distinct[:, 0].sum() == 0 and cells.distinct.sum() == len(cells.components) * 3


# ---- serialisation ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_table(smol_tokenizer):
    from conftest import tiny_lm

    lm = tiny_lm("qwen3", smol_tokenizer, initializer_range=0.2)
    return lm, measure_table(lm, tiny_spec(), random_windows(3, 24), key="tiny-key", data_fingerprint="abc")


@pytest.mark.slow
def test_table_round_trips_through_json_and_csv(tiny_table):
    _, table = tiny_table
    back = LossTable.from_json(table.to_json())
    assert back.spec == table.spec and back.components == table.components and back.key == "tiny-key"
    for name in ("delta", "smoothed", "cell_objective", "removed", "rate_grid"):
        np.testing.assert_array_equal(getattr(back, name), getattr(table, name))
    assert back.removed.dtype == np.int64
    np.testing.assert_array_equal(back.losses(), table.smoothed)
    np.testing.assert_array_equal(back.losses(smoothed=False), table.delta)
    np.testing.assert_array_equal(back.measured, table.measured)
    np.testing.assert_array_equal(back.cell_tokens, table.cell_tokens)
    assert back.measured.all() and back.window_start == table.window_start == "text"
    assert (back.cell_tokens == 3 * 23).all()  # 3 windows x 23 predicted positions (nll)
    lines = table.to_csv().splitlines()
    assert lines[0] == "layer,component,rate,delta,smoothed,removed,measured,tokens"
    assert len(lines) == 1 + table.delta.size
    assert lines[2].startswith("0,attn,0.25,") and lines[2].endswith(",1,69")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: "{not json",
        lambda d: json.dumps([1, 2]),
        lambda d: json.dumps({k: v for k, v in d.items() if k != "delta"}),
        lambda d: json.dumps(d | {"format_version": 99}),
        lambda d: json.dumps(d | {"delta": d["delta"][:-1]}),
        lambda d: json.dumps(d | {"delta": [[0, "x", 1, 2]] * len(d["delta"])}),
        lambda d: json.dumps(d | {"removed": [[-1] * 4] * len(d["removed"])}),
        lambda d: json.dumps(d | {"components": [[7, "attn"]] * len(d["components"])}),
        lambda d: json.dumps(d | {"spec": d["spec"] | {"rate_grid": [0.5, 0.1]}}),
        lambda d: json.dumps(d | {"spec": d["spec"] | {"colour": "red"}}),
        lambda d: json.dumps(d).replace("0.25", "NaN", 1),
    ],
)
def test_malformed_table_json_is_a_one_line_table_error(tiny_table, mutate):
    _, table = tiny_table
    with pytest.raises(TableError) as info:
        LossTable.from_json(mutate(table.to_dict()))
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_check_model_rejects_another_model(tiny_table, make_tiny):
    lm, table = tiny_table
    table.check_model(lm)
    with pytest.raises(TableError, match="fingerprint"):
        table.check_model(make_tiny("qwen3", seed=5))
    with pytest.raises(TableError, match="layers"):
        table.check_model(make_tiny("qwen3", num_hidden_layers=3))


def test_table_key_depends_on_what_changes_the_numbers(tiny_table):
    lm, _ = tiny_table
    base = spec_of(n_samples=2, seq_len=16)
    key = table_key(lm, base, "data-a")
    assert key.startswith("tiny-qwen3-nll-split-exact-")
    assert table_key(lm, spec_of(n_samples=2, seq_len=16, batch_size=1), "data-a") == key
    assert table_key(lm, base, "data-b") != key
    for changed in (
        spec_of(n_samples=3, seq_len=16),
        spec_of(n_samples=2, seq_len=16, seed=1),
        spec_of(n_samples=2, seq_len=16, rate_grid=(0, 0.5)),
        spec_of(n_samples=2, seq_len=16, objective="kl"),
        spec_of(n_samples=2, seq_len=16, criterion="magnitude"),
        spec_of(n_samples=2, seq_len=16, estimator="fisher"),
        spec_of(n_samples=2, seq_len=16, channel_multiple=4),
        spec_of(n_samples=2, seq_len=16, data="news-sample"),
    ):
        assert table_key(lm, changed, "data-a") != key


@pytest.mark.slow
def test_table_key_names_the_attention_tie_rule_only_where_shapes_tie(make_tiny, monkeypatch):
    from gap_engine.tables import artefact

    untied = make_tiny("llama")  # 2 KV groups of 2: no two shapes of one size
    tied = make_tiny("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=8)  # SmolLM2's 3 of 3
    assert [c.has_attention_ties() for c in block_geometries(untied)] == [False, False]
    assert [c.has_attention_ties() for c in block_geometries(tied)] == [True, True]
    spec = spec_of(n_samples=2, seq_len=16)
    keys = {lm.name + str(i): table_key(lm, spec, "data-a") for i, lm in enumerate((untied, tied))}
    monkeypatch.setattr(artefact, "ATTENTION_TIE_RULE", "another-rule")
    assert table_key(untied, spec, "data-a") == keys[untied.name + "0"]  # its keys stay what they were
    assert table_key(tied, spec, "data-a") != keys[tied.name + "1"]  # a table measured under another rule is not reused


# ---- the real model -------------------------------------------------------------------------------
REAL = dict(n_samples=2, seq_len=32, rate_grid=(0.0, 0.25, 0.5), batch_size=2, mode="block")


@pytest.fixture(scope="module")
def real_tables(smol):
    windows = calibration_windows(smol.tokenizer, WindowSpec("wiki-sample", 2, 32, 0))
    return {name: measure_table(smol, spec_of(estimator=name, **REAL), windows) for name in ("exact", "taylor", "fisher")}


def test_real_model_exact_table(smol, real_tables):
    table = real_tables["exact"]
    assert table.delta.shape == (30, 3) and table.components[-1] == (29, "block")
    assert np.all(table.delta[:, 0] == 0) and np.all(table.cell_objective[:, 0] == table.dense_objective)
    assert 0.5 < table.dense_objective < 8.0
    np.testing.assert_array_equal(table.removed, expected_removed(smol, table))
    assert np.all(table.removed[:, 2] > table.removed[:, 1])
    assert np.median(table.delta[:, 2]) > 0  # pruning half a block hurts in most layers
    smoothed = table.losses()
    assert np.all(np.diff(smoothed, axis=1) >= 0) and smoothed.min() >= 0
    assert model_fingerprint(smol.model, smol.tokenizer) == smol.fingerprint


@pytest.mark.parametrize("estimator", ["taylor", "fisher"])
def test_gradient_estimates_rank_cells_like_the_exact_table(real_tables, estimator):
    exact, approx = real_tables["exact"], real_tables[estimator]
    assert approx.components == exact.components
    np.testing.assert_array_equal(approx.removed, exact.removed)
    assert approx.dense_objective == pytest.approx(exact.dense_objective, rel=1e-4)
    rho = spearmanr(exact.delta[:, 1:].ravel(), approx.delta[:, 1:].ravel())[0]
    assert rho > 0.3, f"{estimator} ranks cells unlike the exact table (Spearman {rho:.2f})"


@pytest.mark.parametrize("objective", ["kl", "nll"])
def test_each_windows_estimate_averages_to_the_tables_cells(make_tiny, objective):
    """The per-window estimates (their spread is a cell's standard error) are the table's cells taken apart: their
    mean over the windows is each cell's estimated increase, and the windows do not all agree."""
    from gap_engine.prune.importance import compute_importance
    from gap_engine.tables.artefact import table_components
    from gap_engine.tables.estimate import estimate_cells, estimated_increase_per_window

    lm, spec, windows = make_tiny("llama"), tiny_spec(criterion="wanda", estimator="fisher", objective=objective), random_windows(3, 24)
    scores = compute_importance(lm, windows, "wanda")
    components = table_components(lm.num_layers, "split")
    objective_cells, dense, _ = estimate_cells(lm, spec, windows, scores, components)
    per_window = estimated_increase_per_window(lm, spec, windows, scores, components)
    assert per_window.shape == (3, len(components), len(GRID4))
    np.testing.assert_allclose(per_window.mean(0), objective_cells - dense, rtol=1e-9, atol=1e-12)
    assert np.all(per_window[:, :, 0] == 0) and np.all(per_window.std(0)[:, 1:] > 0)
