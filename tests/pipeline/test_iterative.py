"""Predicted against measured, and iterative planning (``pipeline.iterative``).

The measured objective of a pruned model is counted exactly as a table cell counts it, so a
plan that prunes one component equals that cell of the exact table; iterative planning
prunes in rounds, each planned on a table of the model as the previous rounds left it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loaded import weights_fingerprint
from gap_engine.model.rateplan import make_plan
from gap_engine.pipeline.iterative import iterative_prune, prunable_params
from gap_engine.pipeline.stages import loss_table, objective_increase, pruned_as_saved
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table

WINDOWS = WindowSpec("wiki-sample", n_samples=3, seq_len=24, batch_size=3)
GRID = (0.0, 0.25, 0.5, 0.75)


@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    from conftest import tiny_lm

    return tiny_lm("qwen3", smol_tokenizer, seed=2, initializer_range=0.2)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("objective", ["nll", "kl"])
def test_measured_objective_of_a_one_component_plan_is_the_exact_cell(tiny, objective):
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    table = measure_table(tiny, TableSpec(windows=WINDOWS, rate_grid=GRID, objective=objective, estimator="exact"), windows)
    scores = compute_importance(tiny, windows, table.spec.criterion, 3)
    for c, r in ((1, 2), (2, 3)):  # layer 0 MLP at 50%, layer 1 attention at 75%
        layer, kind = table.components[c]
        attention, mlp = [0.0, 0.0], [0.0, 0.0]
        (mlp if kind == "mlp" else attention)[layer] = GRID[r]
        plan = make_plan(tiny, attention, mlp, table.spec.criterion, table.spec.channel_multiple)
        pruned, _ = pruned_as_saved(tiny, plan, WINDOWS, scores=scores, save_dtype="float32")  # the cells are float32
        measured = objective_increase(pruned, tiny, windows, objective, 3)
        assert measured == pytest.approx(table.delta[c, r], rel=1e-4, abs=1e-6)
        assert table.basis(table.cells_for(attention, mlp)) == "measured"


def test_one_round_is_the_one_shot_dp_plan(tmp_cache, tiny):
    spec = TableSpec(windows=WINDOWS, rate_grid=GRID, objective="kl", estimator="fisher")
    before = weights_fingerprint(tiny.model)
    result = iterative_prune(tiny, spec, 0.3, rounds=1)
    table = loss_table(tiny, spec)
    plan = plan_from_table(tiny, table, 0.3)
    one_shot, _ = pruned_as_saved(tiny, plan, WINDOWS, save_dtype="float32")
    assert weights_fingerprint(tiny.model) == before  # the dense model is untouched
    assert result.model.param_count() == one_shot.param_count()
    ids = calibration_windows(tiny.tokenizer, WINDOWS)
    with torch.inference_mode():
        torch.testing.assert_close(result.model.model(input_ids=ids).logits, one_shot.model(input_ids=ids).logits)
    assert result.predicted_loss == pytest.approx(plan.predicted_loss)
    assert result.rounds[0].measured == pytest.approx(objective_increase(one_shot, tiny, ids, "kl", 3), rel=1e-5)


def test_rounds_remove_the_budget_planned_on_the_pruned_model(tmp_cache, tiny):
    spec = TableSpec(windows=WINDOWS, rate_grid=GRID, objective="kl", estimator="fisher")
    total = prunable_params(tiny, spec.channel_multiple)[0]
    result = iterative_prune(tiny, spec, 0.4, rounds=2)
    assert len(result.rounds) == 2 and result.rounds[0].table_key != result.rounds[1].table_key
    assert result.removed == sum(r.removed for r in result.rounds)
    assert 0.4 <= result.removed_fraction < 0.6 and result.removed == total - prunable_params(result.model, 8)[0]
    assert result.rounds[0].removed >= 0.2 * total  # the first round takes its share of the budget
    assert all(r.measured is not None and r.measured > 0 for r in result.rounds)
    assert all(0.0 <= rate < 1.0 for rate in result.attention_rates + result.mlp_rates)
    assert result.model.pruned_from["fingerprint"] == tiny.fingerprint
    layers = result.model.adapter.layers(result.model.model)
    widths = [result.model.adapter.geometry(layer).intermediate_size for layer in layers]
    dense_width = tiny.adapter.geometry(tiny.adapter.layers(tiny.model)[0]).intermediate_size
    np.testing.assert_allclose(result.mlp_rates, [1 - w / dense_width for w in widths])


def test_cli_prune_in_rounds_saves_a_checkpoint_that_loads(tmp_cache, tiny, tmp_path, capsys):
    import json

    from gap_engine.cli import main
    from gap_engine.model.loading import load_model

    folder = tmp_path / "tiny-model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    out = tmp_path / "pruned"
    argv = [
        "prune",
        "--model",
        str(folder),
        "--budget",
        "0.3",
        "--rounds",
        "2",
        "--estimator",
        "fisher",
        "--objective",
        "kl",
        "--rates",
        "0,0.25,0.5,0.75",
        "--samples",
        "3",
        "--seq-len",
        "24",
        "--out",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(summary["rounds"]) == 2 and summary["removed_fraction_of_prunable"] >= 0.3
    assert all(r["measured"] > 0 for r in summary["rounds"])
    pruned = load_model(str(out))
    assert pruned.param_count() == summary["params_after"] < summary["params_before"]
    assert pruned.pruned_from["plan"]["allocator"] == "dp-iterative"
    kept = json.loads((out / "kept_indices.json").read_text())
    widths = [pruned.adapter.geometry(layer).intermediate_size for layer in pruned.adapter.layers(pruned.model)]
    assert [len(c) for c in kept["kept_channels"]] == widths
    assert main(["prune", "--model", str(folder), "--budget", "0.3", "--uniform", "0.2", "--out", str(out)]) == 2
    assert "exactly one of" in capsys.readouterr().err
