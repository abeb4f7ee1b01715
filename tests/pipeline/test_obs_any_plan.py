"""Any allocator's plan pruned by ``obs`` (SlimGPT's structured OBS selection and update).

The plan's rates, and any attention shape it records, set how many units each block keeps; the
criterion only decides which. Tiny two-layer Llamas (8 query heads in 2 KV groups, MLP 128) with
the real SmolLM2 tokenizer, a fisher table on 4 x 64 calibration tokens.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate import history
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan
from gap_engine.pipeline.runs import prune_and_evaluate
from gap_engine.pipeline.stages import loss_table, obs_windows, plan_for, pruned_as_saved, pruned_by
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

WIDE = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
CALIB = WindowSpec(n_samples=4, seq_len=64, batch_size=2)
SPEC = TableSpec(windows=CALIB, rate_grid=(0.0, 0.25, 0.5, 0.75), estimator="fisher")


def _dp_plan(lm, budget=0.3):
    table = loss_table(lm, SPEC, use_cache=False)
    return plan_for(lm, table, budget, "dp", compensation="none")


def _kept(result):
    return [(len(kv), len(heads), channels) for kv, heads, channels in zip(result.kept_kv_heads, result.kept_heads, result.kept_channels)]


def test_a_dp_plan_pruned_by_obs_keeps_its_counts_and_chooses_other_units(make_tiny):
    dense = make_tiny("qwen3", **WIDE)  # a family whose DP step is the table's criterion (Llama's is OBS)
    plan = _dp_plan(dense)
    assert (plan.allocator, plan.criterion) == ("dp", "wanda")
    by_obs = pruned_by(plan, "obs")
    assert (by_obs.criterion, by_obs.attention_rates, by_obs.mlp_rates) == ("obs", plan.attention_rates, plan.mlp_rates)
    assert plan.criterion == "wanda"  # the plan given is not changed
    assert _dp_plan(make_tiny("llama", **WIDE)).criterion == "obs"  # on Llama the DP's plan is OBS's already

    wanda_model, wanda = pruned_as_saved(dense, plan, CALIB, save_dtype="float32")
    obs_model, obs = pruned_as_saved(dense, by_obs, CALIB, save_dtype="float32")
    # the same unit counts in every block, hence the same widths and parameters
    assert [(kv, heads, len(ch)) for kv, heads, ch in _kept(obs)] == [(kv, heads, len(ch)) for kv, heads, ch in _kept(wanda)]
    assert obs.params_after == wanda.params_after == plan.params["pruned_total"] == obs_model.param_count()
    assert any(len(ch) < WIDE["intermediate_size"] for _, _, ch in _kept(obs))  # the plan prunes channels
    # which channels go is OBS's choice, not wanda's, and the kept columns are updated
    assert [ch for _, _, ch in _kept(obs)] != [ch for _, _, ch in _kept(wanda)]
    assert obs.plan.criterion == "obs" and wanda.plan.criterion == "wanda"
    ids = calibration_windows(dense.tokenizer, CALIB)
    with torch.no_grad():
        assert not torch.allclose(obs_model.model(input_ids=ids).logits, wanda_model.model(input_ids=ids).logits)


def test_obs_prunes_a_plans_recorded_attention_shape(make_tiny):
    # 8 heads in 2 groups: rate 0.6 rounds to (1 group of 3 heads); the plan records the tie's other shape (2 groups of 1)
    dense = make_tiny("llama", **WIDE)
    plan = make_plan(dense, [0.6, 0.0], [0.25, 0.0], "wanda", allocator="dp", attention_shapes=[[2, 1], [2, 4]])
    _, result = pruned_as_saved(dense, pruned_by(plan, "obs"), CALIB, save_dtype="float32")
    assert [len(kv) for kv in result.kept_kv_heads] == [2, 2]
    assert [len(heads) for heads in result.kept_heads] == [2, 8]
    assert [len(ch) for ch in result.kept_channels] == [96, 128]
    assert result.plan.attention_shapes == [[2, 1], [2, 4]] and result.plan.criterion == "obs"


def test_obs_reads_as_many_windows_as_it_is_given(make_tiny):
    dense = make_tiny("llama", **WIDE)
    plan = pruned_by(make_plan(dense, [0.5, 0.0], [0.5, 0.25], "wanda", allocator="dp"), "obs")
    assert obs_windows(CALIB, 8) == WindowSpec(n_samples=8, seq_len=64, batch_size=2)
    # By default 4x the calibration's windows of the same text (64 for the default table's 16), at most 128
    # unless the calibration itself has more.
    assert obs_windows(CALIB, None) == dataclasses.replace(CALIB, n_samples=4 * CALIB.n_samples)
    assert [obs_windows(dataclasses.replace(CALIB, n_samples=n), None).n_samples for n in (16, 64, 200)] == [64, 128, 200]

    def logits(obs_samples):
        pruned, _ = pruned_as_saved(dense, plan, CALIB, save_dtype="float32", obs_samples=obs_samples)
        with torch.no_grad():
            return pruned.model(input_ids=calibration_windows(dense.tokenizer, CALIB)).logits

    default = logits(None)
    torch.testing.assert_close(logits(4 * CALIB.n_samples), default, rtol=0, atol=0)
    assert not torch.allclose(logits(CALIB.n_samples), default)  # fewer windows: other Gram matrices, other units or updates


def test_a_run_of_a_dp_plan_pruned_by_obs_records_it_and_its_checkpoint_reloads_the_same(make_tiny, tmp_path):
    dense = make_tiny("llama", **WIDE)
    table = loss_table(dense, SPEC, use_cache=False)
    settings = EvalSettings(windows=WindowSpec(n_samples=2, seq_len=32), throughput=False, generations=0)
    run = prune_and_evaluate(
        dense,
        settings,
        table=table,
        budget=0.3,
        checkpoint_dir=tmp_path / "ck",
        history_path=tmp_path / "history.db",
        compensation=CompensationSettings(mode="bias"),
        criterion="obs",
        obs_samples=6,
    )
    assert (run.plan["allocator"], run.plan["criterion"]) == ("dp", "obs")
    assert run.compensation["mode"] == "bias" and run.compensation["windows"]["n_samples"] == 6  # the bias rides on OBS's windows
    record = history.runs(tmp_path / "history.db")[-1]
    assert record.plan["criterion"] == "obs" and record.params["obs_windows"]["n_samples"] == 6
    assert record.params["plan_hash"] == run.plan_hash
    folder = tmp_path / "ck"
    assert json.loads((folder / "plan.json").read_text())["criterion"] == "obs"
    assert "| within-layer criterion | obs " in (folder / "README.md").read_text()
    first, second = load_model(str(folder)), load_model(str(folder))
    assert first.pruned_from is not None and first.pruned_from["plan"]["criterion"] == "obs"
    ids = calibration_windows(dense.tokenizer, CALIB)
    with torch.no_grad():
        torch.testing.assert_close(first.model(input_ids=ids).logits, second.model(input_ids=ids).logits, rtol=0, atol=0)
        # what was measured is what was saved: the engine's copy as stored gives the same logits
        shipped, _ = pruned_as_saved(
            dense, pruned_by(_plan_of(run), "obs"), CALIB, compensation=CompensationSettings(mode="bias"), obs_samples=6
        )
        torch.testing.assert_close(first.model(input_ids=ids).logits, shipped.model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


def _plan_of(run):
    from gap_engine.model.rateplan import RatePlan

    return RatePlan.from_dict(dict(run.plan))


def test_the_api_prunes_by_obs_on_the_windows_it_is_given(make_tiny):
    from gap_engine import api

    dense = make_tiny("llama", **WIDE)
    plan = pruned_by(make_plan(dense, [0.5, 0.0], [0.5, 0.25], "wanda", allocator="dp"), "obs")
    ids = calibration_windows(dense.tokenizer, CALIB)

    def logits(pruned):
        with torch.no_grad():
            return pruned.model(input_ids=ids).logits

    by_api = api.prune(dense, plan, calibration=CALIB, obs_samples=CALIB.n_samples, save_dtype="float32")
    by_stage, _ = pruned_as_saved(dense, plan, CALIB, save_dtype="float32", obs_samples=CALIB.n_samples)
    torch.testing.assert_close(logits(by_api.model), logits(by_stage), rtol=0, atol=0)
    assert not torch.allclose(logits(by_api.model), logits(api.prune(dense, plan, calibration=CALIB, save_dtype="float32").model))
