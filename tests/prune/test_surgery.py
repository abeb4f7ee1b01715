"""Surgery, units and export on tiny models of every supported family (fast)."""

from __future__ import annotations

import pytest
import torch

from gap_engine.core.errors import UnsupportedArchitectureError
from gap_engine.model.adapters import adapter_for, supported_model_types
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan, uniform_plan
from gap_engine.model.units import AttentionShape, attention_shape_for_rate, block_geometries, channels_for_rate
from gap_engine.prune.criteria import SCORING_CRITERIA
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import apply_plan, select_attention

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


def _ids(n=2, t=24, seed=0):
    return torch.randint(5, 4000, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(lm, ids):
    return lm.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_rate_zero_changes_nothing(make_tiny, family):
    lm = make_tiny(family)
    ids = _ids()
    before = _logits(lm, ids)
    scores = compute_importance(lm, ids, "wanda")
    result = apply_plan(lm, uniform_plan(lm, 0.0, "wanda"), scores)
    assert result.params_after == result.params_before
    torch.testing.assert_close(_logits(lm, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_heterogeneous_plan_prunes_runs_and_reloads(make_tiny, family, tmp_path):
    lm = make_tiny(family, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    ids = _ids()
    scores = compute_importance(lm, ids, "wanda")
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.75], "wanda")
    result = apply_plan(lm, plan, scores)
    assert result.params_after == plan.params["pruned_total"] < result.params_before
    geoms = [g.geometry for g in block_geometries(lm)]
    assert geoms[0].n_heads < 8 and geoms[1].n_heads == 8
    assert all(g.n_heads % g.n_kv_heads == 0 for g in geoms)
    assert geoms[0].intermediate_size == channels_for_rate(128, 0.25) == 96
    assert geoms[1].intermediate_size == 32
    pruned = _logits(lm, ids)
    assert torch.isfinite(pruned).all()
    generated = lm.model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 12)

    out = tmp_path / "ckpt"
    save_pruned(
        lm, result.plan, result.kept_indices(), out, dtype="float32"
    )  # exact round trip; half precision: tests/export/test_export.py
    reloaded = load_model(str(out))
    assert reloaded.param_count() == result.params_after
    assert reloaded.fingerprint == lm.fingerprint
    torch.testing.assert_close(_logits(reloaded, ids), pruned, rtol=0, atol=0)
    assert [g.geometry for g in block_geometries(reloaded)] == geoms


def test_qwen2_biases_are_sliced_with_their_rows(make_tiny):
    lm = make_tiny("qwen2", num_attention_heads=4, num_key_value_heads=2)
    q = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[0]
    assert q.bias is not None
    scores = compute_importance(lm, _ids(), "magnitude")
    apply_plan(lm, make_plan(lm, [0.5, 0.5], [0.0, 0.0], "magnitude"), scores)
    q, k, v, _ = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])
    assert q.bias.shape[0] == q.out_features and k.bias.shape[0] == k.out_features == v.bias.shape[0]


def test_pruning_removes_the_lowest_scored_units(make_tiny):
    lm = make_tiny("llama", num_attention_heads=4, num_key_value_heads=4, intermediate_size=64)
    scores = compute_importance(lm, None, "magnitude")
    layer_scores = scores.layers[0]
    layer_scores.channel = torch.arange(64, dtype=torch.float64)  # channel j scores j: the first ones go
    layer_scores.head = torch.tensor([4.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    result = apply_plan(lm, make_plan(lm, [0.5, 0.0], [0.5, 0.0], "magnitude"), scores)
    assert result.kept_channels[0] == list(range(32, 64))
    assert result.kept_heads[0] == [0, 2]


def test_gqa_selection_keeps_even_groups():
    scores = torch.tensor([9.0, 1.0, 1.0, 5.0, 5.0, 5.0, 0.0, 8.0, 0.0], dtype=torch.float64)  # 3 groups of 3
    kept_kv, kept_heads = select_attention(scores, 3, AttentionShape(kv_groups=2, heads_per_group=2))
    assert kept_kv == [0, 1]  # group sums 11, 15, 8
    assert kept_heads == [0, 1, 3, 4]


def test_attention_rounding_is_gqa_valid_and_nearest():
    from gap_engine.model.adapters import LayerGeometry
    from gap_engine.model.units import attention_params

    smol_geom = LayerGeometry(n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536)
    all_shapes = [AttentionShape(g, q) for g in (1, 2, 3) for q in (1, 2, 3)]
    dense = attention_params(smol_geom, 576, AttentionShape(3, 3), False, False)
    kept_counts = set()
    for i in range(16):
        rate = i / 16
        shape = attention_shape_for_rate(smol_geom, 576, rate)
        kept_counts.add(shape.n_heads)
        gap = abs(1 - attention_params(smol_geom, 576, shape, False, False) / dense - rate)
        best = min(abs(1 - attention_params(smol_geom, 576, s, False, False) / dense - rate) for s in all_shapes)
        assert gap == pytest.approx(best)
    assert kept_counts <= {9, 6, 4, 3, 2, 1} and 9 in kept_counts and len(kept_counts) >= 5
    gemma_geom = LayerGeometry(n_heads=4, n_kv_heads=1, head_dim=256, intermediate_size=2048)
    assert attention_shape_for_rate(gemma_geom, 640, 0.0).n_heads == 4
    assert attention_shape_for_rate(gemma_geom, 640, 0.9).n_heads == 1
    assert channels_for_rate(1536, 0.2) == 1232  # 0.8 * 1536 = 1228.8 -> nearest multiple of 8
    assert channels_for_rate(1536, 0.999) == 8  # never below one multiple
    assert channels_for_rate(100, 0.0) == 100  # rate 0 keeps a width that is not a multiple


@pytest.mark.parametrize("criterion", SCORING_CRITERIA)
def test_every_criterion_scores_every_unit(make_tiny, criterion):
    lm = make_tiny("llama")
    scores = compute_importance(lm, _ids(), criterion)
    assert len(scores.layers) == 2
    for layer in scores.layers:
        assert layer.head.shape == (4,) and layer.channel.shape == (96,)
        assert torch.isfinite(layer.head).all() and (layer.head >= 0).all()
        assert layer.channel.std() > 0


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*supported model types: .*llama"):
        adapter_for(GPT2Config())
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"} <= set(supported_model_types())
