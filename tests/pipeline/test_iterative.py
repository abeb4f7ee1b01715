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
from gap_engine.model.rateplan import RatePlan, make_plan, plan_widths
from gap_engine.model.slicing import layer_widths
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
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert summary["compensation"] == "none"  # the default compensation follows a one-shot cut, not rounds
    assert all(r["measured"] > 0 for r in summary["rounds"])
    pruned = load_model(str(out))
    assert pruned.param_count() == summary["params_after"] < summary["params_before"]
    assert pruned.pruned_from["plan"]["allocator"] == "dp-iterative"
    kept = json.loads((out / "kept_indices.json").read_text())
    widths = [pruned.adapter.geometry(layer).intermediate_size for layer in pruned.adapter.layers(pruned.model)]
    assert [len(c) for c in kept["kept_channels"]] == widths
    assert plan_widths(tiny, RatePlan.load(out / "plan.json")) == layer_widths(pruned.adapter, pruned.model)
    assert main(["prune", "--model", str(folder), "--budget", "0.3", "--uniform", "0.2", "--out", str(out)]) == 2
    assert "exactly one of" in capsys.readouterr().err


# ---- a plan of a pruned model's widths gives those widths ----------------------------------------
@pytest.fixture(scope="module")
def smol_shaped(smol_tokenizer):
    """A tiny model with SmolLM2's head geometry: 3 KV groups of 3 query heads."""
    from conftest import tiny_lm

    return tiny_lm("llama", smol_tokenizer, hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=8)


SHAPES = [(g, q) for g in (3, 2, 1) for q in (3, 2, 1)]


@pytest.mark.parametrize("kv_groups,heads_per_group", SHAPES)
def test_every_shape_rounds_can_reach_round_trips_through_its_saved_plan(smol_shaped, kv_groups, heads_per_group):
    """Rounds can leave a block at any GQA shape, also one that ties in size with the shape its
    rate rounds to ((2, 2) with (3, 1), (1, 3) with (2, 1) here): the saved plan records it."""
    from gap_engine.model.slicing import slice_attention_, slice_mlp_
    from gap_engine.model.units import AttentionShape
    from gap_engine.pipeline.iterative import widths_plan
    from gap_engine.prune.surgery import apply_plan, select_attention

    dense = smol_shaped
    pruned = dense.copy()
    scores = compute_importance(dense, None, "magnitude")
    layers = pruned.adapter.layers(pruned.model)
    kept_kv, kept_heads = select_attention(scores.layers[0].head, 3, AttentionShape(kv_groups, heads_per_group))
    slice_attention_(pruned.adapter, layers[0], kept_kv, kept_heads)
    slice_mlp_(pruned.adapter, layers[1], list(range(48)))
    plan = RatePlan.from_text(widths_plan(dense, pruned, "magnitude", 8).to_json(), "plan.json")
    assert plan.attention_shapes == [[kv_groups, heads_per_group], [3, 3]]
    assert plan_widths(dense, plan) == layer_widths(pruned.adapter, pruned.model)
    target = dense.copy()
    apply_plan(target, plan, scores)
    assert layer_widths(target.adapter, target.model) == layer_widths(pruned.adapter, pruned.model)


def test_a_recorded_shape_must_have_its_rates_size(smol_shaped):
    from gap_engine.core.errors import PlanError

    plan = make_plan(smol_shaped, [0.5, 0.0], [0.0, 0.0], "magnitude")  # half the attention: (2, 2) or (3, 1)
    for shape, fits in (([2, 2], True), ([3, 1], True), ([2, 1], False), ([4, 1], False)):
        plan.attention_shapes = [shape, [3, 3]]
        if fits:
            plan.check_model(smol_shaped)
            assert plan_widths(smol_shaped, plan)[0]["num_attention_heads"] == shape[0] * shape[1]
        else:
            with pytest.raises(PlanError, match="attention_shapes"):
                plan.check_model(smol_shaped)
