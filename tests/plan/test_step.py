"""The step a plan prunes by when none is asked for (plan.step): the allocator's own, the DP's
model family step (OBS on Llama), or the table's criterion; and the compensation that follows."""

from __future__ import annotations

import dataclasses
import json

from synthetic_tables import synthetic_table

from gap_engine import api
from gap_engine.model.identity import BUILTIN_MODEL_TYPES, model_type_of
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.step import plan_criterion, table_model_type


def _with(table, model_type=None, criterion=None, model=None):
    extras = dict(table.extras) | ({"model_type": model_type} if model_type else {})
    spec = table.spec if criterion is None else dataclasses.replace(table.spec, criterion=criterion)
    return dataclasses.replace(table, extras=extras, spec=spec, model=model or table.model)


def test_dp_prunes_by_its_family_step_where_the_table_scores_by_the_default_criterion(make_tiny):
    llama, gemma = make_tiny("llama"), make_tiny("gemma3_text")
    on_llama = _with(synthetic_table(llama), "llama")
    assert plan_criterion("dp", on_llama) == "obs"
    assert plan_criterion("evo", on_llama) == "wanda"  # the evidence is the DP's: other allocators keep the table's
    assert plan_criterion("uniform", on_llama) == "wanda"
    assert plan_criterion("flap", on_llama) == "flap" and plan_criterion("slimgpt", on_llama) == "obs"
    assert plan_criterion("dp", _with(synthetic_table(gemma), "gemma3_text")) == "wanda"
    assert plan_criterion("dp", _with(on_llama, criterion="magnitude")) == "magnitude"  # a table's own choice is kept
    assert plan_criterion("dp", _with(synthetic_table(llama), model="nowhere-known")) == "wanda"  # type unknown


def test_a_dp_plan_records_its_step_and_is_counted_for_no_biases(make_tiny):
    lm = make_tiny("llama")
    table = _with(synthetic_table(lm), "llama")
    plan = plan_from_table(lm, table, 0.2, "dp", compensation=api._default_compensation("dp", table))
    assert plan.criterion == "obs" and plan.compensation == "none"
    assert "bias_params" not in plan.params or plan.params["bias_params"] == 0
    gemma = make_tiny("gemma3_text")
    gemma_table = _with(synthetic_table(gemma), "gemma3_text")
    assert api._default_compensation("dp", gemma_table) == "bias+refit"  # Gemma 3's measured default after its step
    gemma_plan = plan_from_table(gemma, gemma_table, 0.2, "dp", compensation=api._default_compensation("dp", gemma_table))
    assert gemma_plan.criterion == "wanda" and gemma_plan.compensation == "bias+refit" and gemma_plan.params["bias_params"] > 0


def test_the_model_type_of_a_table_without_one_is_read_from_its_model(tmp_path, make_tiny):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert model_type_of(str(folder)) == "qwen2"
    assert table_model_type(synthetic_table(make_tiny("llama"), model=str(folder))) == "qwen2"
    (folder / "config.json").write_text("{not json")
    assert model_type_of(str(folder)) is None
    assert model_type_of("smollm2-135m") == BUILTIN_MODEL_TYPES["smollm2-135m"]
    assert model_type_of(str(tmp_path / "missing")) is None


def test_builtin_model_types_are_the_loaded_configs(smol):
    from gap_engine.model.loading import BUILTIN_MODELS

    assert smol.model.config.model_type == BUILTIN_MODEL_TYPES["smollm2-135m"]
    assert set(BUILTIN_MODEL_TYPES) == set(BUILTIN_MODELS)
    for name, model_type in BUILTIN_MODEL_TYPES.items():  # Gemma's without loading it: its listing names the type
        assert model_type in BUILTIN_MODELS[name].description.lower()


def test_compare_ships_a_compensation_asked_for_where_the_step_takes_it(make_tiny):
    from gap_engine.pipeline.compare import shipped_compensation
    from gap_engine.prune.compensations import CompensationSettings

    table = _with(synthetic_table(make_tiny("llama")), "llama")
    bias, refit = CompensationSettings(mode="bias"), CompensationSettings(mode="refit")

    def shipped(spec, asked):
        allocator, _, criterion = spec.partition(":")
        return shipped_compensation(table, allocator, criterion or None, asked).mode

    # Not asked: every row its step's default (OBS's update is its compensation).
    assert [shipped(s, None) for s in ("dp", "slimgpt", "dp:wanda", "flap")] == ["none", "none", "bias", "bias"]
    # Asked for bias: OBS takes it, so every row ships it, as `gap prune --compensate bias` would.
    assert [shipped(s, bias) for s in ("dp", "slimgpt", "dp:obs", "uniform")] == ["bias"] * 4
    # A refit asked for: DP plans by the table's criterion to take it; OBS rows that cannot take it get none.
    assert [shipped(s, refit) for s in ("dp", "slimgpt", "dp:obs")] == ["refit", "none", "none"]
    # A weighting asked for goes to every row that fits anything, OBS's bias included; a row that fits nothing weighs nothing.
    assert shipped_compensation(table, "dp", "wanda", bias, weighting="output-norm").weighting == "output-norm"
    assert shipped_compensation(table, "slimgpt", None, bias, weighting="output-norm").weighting == "output-norm"
    assert not shipped_compensation(table, "slimgpt", None, None, weighting="output-norm").weighted
    # Not asked: the family's (SmolLM2, a Llama: tokens alike).
    assert shipped_compensation(table, "flap", None, None).weighting == "tokens"
