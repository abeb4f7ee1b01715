"""Surgery, units and export on tiny models of every supported family (fast)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import as_loaded

from gap_engine.core.errors import CancelledError, UnsupportedArchitectureError
from gap_engine.core.progress import Hooks
from gap_engine.model.adapters import adapter_for, supported_model_types
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan, uniform_plan
from gap_engine.model.units import AttentionShape, attention_shape_for_rate, block_geometries, channels_for_rate
from gap_engine.prune.criteria import SCORING_CRITERIA
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import apply_plan, select_attention

FAMILIES = supported_model_types()  # every family an adapter serves


def _ids(n=2, t=24, seed=0):
    return torch.randint(5, 4000, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(lm, ids):
    return lm.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_rate_zero_changes_nothing(make_tiny, family):
    lm = make_tiny(family)
    ids = _ids()
    before = _logits(lm, ids)
    scores = compute_importance(lm, ids, "wanda")
    result = apply_plan(lm, uniform_plan(lm, 0.0, "wanda"), scores)
    assert result.params_after == result.params_before
    torch.testing.assert_close(_logits(lm, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_heterogeneous_plan_prunes_runs_and_reloads(make_tiny, family, tmp_path):
    # As a user's folder loads (conftest.as_loaded): the reload's fingerprint includes the tokenizer.
    lm = as_loaded(make_tiny(family, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128), tmp_path / "dense")
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
    reached = set()
    for i in range(2000):
        rate = i / 2000
        shape = attention_shape_for_rate(smol_geom, 576, rate)
        reached.add(shape)
        gap = abs(1 - attention_params(smol_geom, 576, shape, False, False) / dense - rate)
        best = min(abs(1 - attention_params(smol_geom, 576, s, False, False) / dense - rate) for s in all_shapes)
        assert gap == pytest.approx(best)
    # Ties keep more query heads: (2, 2) over (3, 1), (1, 3) over (2, 1); nothing else is left out.
    assert reached == {AttentionShape(g, q) for g, q in ((3, 3), (3, 2), (2, 3), (2, 2), (1, 3), (1, 2), (1, 1))}
    assert {shape.n_heads for shape in reached} == {9, 6, 4, 3, 2, 1}  # what the units docstring says
    assert attention_shape_for_rate(smol_geom, 576, 0.5) == AttentionShape(2, 2)
    assert attention_shape_for_rate(smol_geom, 576, 2 / 3) == AttentionShape(1, 3)
    for shape in reached:  # every reachable shape comes back from the rate it removes
        assert attention_shape_for_rate(smol_geom, 576, 1 - attention_params(smol_geom, 576, shape, False, False) / dense) == shape
    gemma_geom = LayerGeometry(n_heads=4, n_kv_heads=1, head_dim=256, intermediate_size=2048)
    assert {attention_shape_for_rate(gemma_geom, 640, i / 2000).n_heads for i in range(2000)} == {4, 3, 2, 1}
    assert channels_for_rate(1536, 0.2) == 1232  # 0.8 * 1536 = 1228.8 -> nearest multiple of 8
    assert channels_for_rate(1536, 0.999) == 8  # never below one multiple
    assert channels_for_rate(100, 0.0) == 100  # rate 0 keeps a width that is not a multiple


@pytest.mark.parametrize("criterion, what", [("wanda", "activation statistics"), ("taylor", "taylor importance scores")])
def test_scoring_reports_its_batches_to_the_hooks_it_is_given_and_stops_when_cancelled(make_tiny, criterion, what):
    # The criteria take no hooks: compute_importance is their stage boundary.
    lm, told, cancel = make_tiny("llama"), [], threading.Event()
    compute_importance(lm, _ids(n=6), criterion, batch_size=2, hooks=Hooks(progress=lambda done, total, eta: told.append((done, total))))
    assert told == [(1, 3), (2, 3), (3, 3)]
    hooks = Hooks(progress=lambda done, total, eta: cancel.set(), cancel=cancel)  # cancelled once the first batch is in
    with pytest.raises(CancelledError, match=f"{what} cancelled after 1 of 3 batches"):
        compute_importance(lm, _ids(n=6), criterion, batch_size=2, hooks=hooks)


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


# ---- invariants: named errors, and a model left whole -----------------------------------------
# The tests named *invariant* also run under ``python -O`` (the last test below), so they check
# with pytest.raises and `_check`, never a bare assert (which -O strips from a test as well).
def _check(condition: bool, message: str) -> None:
    if not condition:
        pytest.fail(message)


def _state(lm) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in lm.model.state_dict().items()}


def _same_model(lm, state: dict[str, torch.Tensor], fingerprint: str) -> None:
    """``lm`` holds exactly ``state`` (names, shapes, values), its fingerprint is ``fingerprint``
    and its blocks report the widths of that state."""
    from gap_engine.model.loaded import model_fingerprint

    now = lm.model.state_dict()
    _check(list(now) == list(state), "the tensors' names changed")
    for name, tensor in state.items():
        _check(now[name].shape == tensor.shape and torch.equal(now[name], tensor), f"{name} changed")
    _check(lm.fingerprint == fingerprint == model_fingerprint(lm.model, lm.tokenizer), "the fingerprint changed")
    for layer in lm.adapter.layers(lm.model):
        attn = lm.adapter.attention(layer)
        geom = lm.adapter.geometry(layer)
        _check(attn.num_key_value_groups == geom.n_heads // geom.n_kv_heads, "a block's KV grouping no longer fits its heads")
    _check(lm.pruned_from is None, "the model claims to be pruned")


@pytest.mark.slow
def test_invariant_a_failure_in_a_later_block_leaves_the_model_as_it_was(make_tiny, monkeypatch):
    from gap_engine.prune import surgery

    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    ids = _ids()
    scores = compute_importance(lm, ids, "magnitude")
    before, fingerprint, logits = _state(lm), lm.fingerprint, _logits(lm, ids)
    real_slice, calls = surgery.slice_mlp_, []

    def slice_then_fail(adapter, layer, kept):
        calls.append(layer)
        if len(calls) == 2:  # block 0 is cut (attention and MLP), block 1's attention too
            raise RuntimeError("injected failure in block 1's MLP slice")
        real_slice(adapter, layer, kept)

    monkeypatch.setattr(surgery, "slice_mlp_", slice_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        apply_plan(lm, make_plan(lm, [0.5, 0.5], [0.5, 0.5], "magnitude"), scores)
    _check(len(calls) == 2, "the failure was not reached")
    _same_model(lm, before, fingerprint)
    _check(torch.equal(_logits(lm, ids), logits), "the model computes other logits")


def test_invariant_a_count_other_than_the_plans_is_an_error_and_undone(make_tiny, monkeypatch):
    from gap_engine.core.errors import InvariantError
    from gap_engine.model.rateplan import plan_params
    from gap_engine.prune import surgery

    lm = make_tiny("qwen2")
    scores = compute_importance(lm, None, "magnitude")
    before, fingerprint = _state(lm), lm.fingerprint

    def one_too_many(*args):
        counts = plan_params(*args)
        return counts | {"pruned_total": counts["pruned_total"] + 1}

    monkeypatch.setattr(surgery, "plan_params", one_too_many)
    with pytest.raises(InvariantError, match="plan predicted"):
        apply_plan(lm, make_plan(lm, [0.5, 0.0], [0.25, 0.5], "magnitude"), scores)
    _same_model(lm, before, fingerprint)


def test_invariant_a_slice_that_loses_its_shape_is_named(make_tiny, monkeypatch):
    from gap_engine.core.errors import InvariantError
    from gap_engine.model import slicing

    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2)
    scores = compute_importance(lm, None, "magnitude")
    before, fingerprint = _state(lm), lm.fingerprint
    real_rows = slicing.unit_rows
    monkeypatch.setattr(slicing, "unit_rows", lambda units, width: real_rows(units, width)[:-1])  # one row short
    with pytest.raises(InvariantError, match="attention slice lost its shape"):
        apply_plan(lm, make_plan(lm, [0.5, 0.0], [0.0, 0.0], "magnitude"), scores)
    _same_model(lm, before, fingerprint)


def test_apply_plan_leaves_the_callers_plan_alone(make_tiny):
    lm = make_tiny("llama")
    plan = make_plan(lm, [0.5, 0], [0.25, 0], "magnitude")
    plan.params = {}  # as a hand-written plan comes, without counts
    plan.attention_rates[1] = 0  # an int: validation would make it a float
    result = apply_plan(lm, plan, compute_importance(lm, None, "magnitude"))
    assert plan.params == {} and type(plan.attention_rates[1]) is int
    assert result.plan is not plan and result.plan.params["pruned_total"] == result.params_after
    assert result.plan.attention_rates == [0.5, 0.0] and result.plan.mlp_rates == plan.mlp_rates


@pytest.mark.heavy  # a second interpreter under -O importing torch: ~15 s; make test-all
def test_invariant_checks_still_fire_under_python_dash_O():
    """The tests above run again in a child ``python -O``: had the engine asserted its
    invariants, -O would strip the checks and those tests would fail."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "invariant and not dash_O"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 passed" in done.stdout, done.stdout[-3000:]
    assert "python -O" in done.stdout + done.stderr  # pytest's own warning: asserts are stripped in that run
