"""A budget pays for the biases bias compensation adds (``plan.problem.bias_charges``).

Bias compensation gives each o_proj / down_proj whose component loses units a bias of the
hidden width. A plan for such a prune counts them: every option that cuts a component costs
what it removes less that bias, the DP stays exact on those whole-parameter costs, and every
allocator's plan removes its budget net of the biases.
"""

import numpy as np
import pytest
import torch
from reference import brute_force
from synthetic_tables import synthetic_table

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.rateplan import RatePlan, make_plan
from gap_engine.model.units import added_bias_params, block_geometries
from gap_engine.plan.allocators import check_reach, plan_from_table
from gap_engine.plan.evo import EvoSettings
from gap_engine.plan.problem import Constraints, planning_problem
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import COMPENSATIONS, CompensationSettings, adds_biases
from gap_engine.prune.importance import compute_importance

HIDDEN = 64  # make_tiny's hidden width: what one output bias costs


@pytest.fixture
def tiny(make_tiny):
    return make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)


def test_the_bias_compensations_are_the_ones_whose_entries_add_biases():
    assert [m for m in COMPENSATIONS if COMPENSATIONS[m].adds_bias] == ["bias", "bias+refit"]
    assert [CompensationSettings(mode=m).adds_bias for m in COMPENSATIONS] == [adds_biases(m) for m in COMPENSATIONS]
    assert not adds_biases(None)


def test_a_components_first_cut_costs_its_bias(tiny):
    table = synthetic_table(tiny)
    counts = block_geometries(tiny)
    plain, charged = planning_problem(table), planning_problem(table, biases=counts)
    np.testing.assert_array_equal(plain.costs - charged.costs, HIDDEN * (plain.costs > 0))
    assert (plain.costs[:, 1:] > 0).all() and (charged.costs[:, 1:] > 0).all()  # every cut still removes more than its bias
    # coupled: a layer's option pays for each of its two components it cuts
    coupled = Constraints(coupled=True)
    plain, charged = planning_problem(table, coupled), planning_problem(table, coupled, biases=counts)
    cuts = (table.removed[0::2] > 0).astype(int) + (table.removed[1::2] > 0).astype(int)  # (L, R) attention and MLP rows
    np.testing.assert_array_equal(plain.costs - charged.costs, HIDDEN * cuts)


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.5])
def test_the_dp_is_exact_on_the_net_costs(tiny, budget):
    table = synthetic_table(tiny, seed=2)
    plan = plan_from_table(tiny, table, budget, "dp", compensation="bias")
    charged = planning_problem(table, biases=block_geometries(tiny))
    target = budget * table.dense_prunable
    best, _ = brute_force(charged.costs, charged.losses, charged.allowed, target)
    assert plan.predicted_loss == pytest.approx(best, abs=1e-12)
    assert plan.params["removed"] - plan.params["bias_params"] >= target


def _windows(tiny):
    return calibration_windows(tiny.tokenizer, WindowSpec(n_samples=2, seq_len=32, batch_size=2))


@pytest.mark.parametrize("allocator", ["dp", "uniform", "flap", "owl", "evo"])
@pytest.mark.parametrize("mode", ["bias", "bias+refit"])
def test_every_allocator_removes_its_budget_net_of_the_biases(tiny, allocator, mode):
    table = synthetic_table(tiny, seed=1)
    budget = 0.3
    check_reach(tiny, table, budget, allocator, compensation=mode)
    evo = EvoSettings(generations=1, offspring=2)
    plan = plan_from_table(tiny, table, budget, allocator, windows=_windows(tiny), evo=evo, compensation=mode)
    params = plan.params
    counted = added_bias_params(block_geometries(tiny), plan.attention_rates, plan.mlp_rates, plan.channel_multiple)
    assert plan.compensation == mode and params["bias_params"] == counted > 0
    assert params["removed"] - params["bias_params"] >= budget * table.dense_prunable
    assert params["pruned_total_with_biases"] == params["pruned_total"] + counted
    again = RatePlan.from_dict(plan.to_dict())
    assert again.compensation == mode and again.content_hash() == plan.content_hash()


def test_a_compensation_without_biases_is_recorded_and_charges_nothing(tiny):
    table = synthetic_table(tiny, seed=1)
    plain = plan_from_table(tiny, table, 0.3, "dp")
    refit = plan_from_table(tiny, table, 0.3, "dp", compensation="refit")
    assert plain.compensation is None and "compensation" not in plain.to_dict() and "bias_params" not in plain.params
    assert refit.compensation == "refit" and "bias_params" not in refit.params
    assert (refit.attention_rates, refit.mlp_rates) == (plain.attention_rates, plain.mlp_rates)
    assert refit.content_hash() != plain.content_hash()  # the compensation is part of what the plan claims


def test_a_slimgpt_plan_counts_a_bias_on_top_but_no_refit(tiny):
    # its criterion (obs) updates the kept columns itself (a refit): a bias may follow, a second refit may not
    table, windows = synthetic_table(tiny), _windows(tiny)
    biased = plan_from_table(tiny, table, 0.3, "slimgpt", windows=windows, compensation="bias")
    assert biased.criterion == "obs" and biased.compensation == "bias" and biased.params["bias_params"] > 0
    refit = plan_from_table(tiny, table, 0.3, "slimgpt", windows=windows, compensation="refit")
    assert refit.compensation == "none" and "bias_params" not in refit.params


@pytest.mark.slow
def test_the_biases_installed_are_the_ones_the_plan_counted(tiny):
    """A block that loses only its attention gets an o_proj bias and no down_proj bias; the plan's
    count, the compensation's record and the model agree."""
    windows = WindowSpec(n_samples=4, seq_len=64, batch_size=2)
    scores = compute_importance(tiny, calibration_windows(tiny.tokenizer, windows), "wanda")
    plan = make_plan(tiny, [0.5, 0.0], [0.0, 0.25], "wanda", compensation="bias")
    counted = added_bias_params(block_geometries(tiny), plan.attention_rates, plan.mlp_rates, plan.channel_multiple)
    before = tiny.param_count()
    result = prune_compensated(tiny, plan, scores, windows, CompensationSettings(mode="bias"))
    assert counted == 2 * HIDDEN == result.compensation["bias_params"] == result.plan.params["bias_params"]
    assert result.params_after == tiny.param_count() == result.plan.params["pruned_total_with_biases"] < before
    layers = tiny.adapter.layers(tiny.model)
    assert tiny.adapter.attention_projections(layers[0])[3].bias is not None and tiny.adapter.mlp_projections(layers[0])[2].bias is None
    assert tiny.adapter.attention_projections(layers[1])[3].bias is None and tiny.adapter.mlp_projections(layers[1])[2].bias is not None
    assert torch.isfinite(tiny.adapter.mlp_projections(layers[1])[2].bias).all()
