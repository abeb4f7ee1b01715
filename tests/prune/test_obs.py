"""SlimGPT's structured OBS (prune.obs) and its block-by-block pruning (prune.sequential), on
random matrices and tiny models (fast)."""

from __future__ import annotations

import itertools

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import CompensationError, GapError, TableError
from gap_engine.model.rateplan import make_plan
from gap_engine.pipeline.stages import prune_with_plan
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.obs import ObsError, block_errors, damped_inverse, greedy_remove, obs_heads
from gap_engine.prune.sequential import obs_prune
from gap_engine.tables.artefact import TableSpec


def _layer(out=6, n=12, tokens=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=gen, dtype=torch.float64) @ torch.randn(n, n, generator=gen, dtype=torch.float64)
    return torch.randn(out, n, generator=gen, dtype=torch.float64), x  # (out, n), (tokens, n)


def _refit(weight, x, kept, damping=0.01):
    """Least squares: the kept columns' weights that best reproduce ``weight @ x`` (same damping as OBS)."""
    h = x.T @ x
    h = h + damping * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    k = torch.tensor(kept)
    return torch.linalg.solve(h[k][:, k], (weight @ h[:, k]).T).T  # (out, kept)


def _damped_error(weight, new, x, damping=0.01):
    h = x.T @ x
    h = h + damping * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    d = weight - new
    return float(torch.trace(d @ h @ d.T))


def test_greedy_obs_leaves_the_least_squares_refit_of_the_kept_columns():
    weight, x = _layer()
    new = weight.clone()
    blocks = [torch.tensor([2 * b, 2 * b + 1]) for b in range(6)]
    removal = greedy_remove(new, damped_inverse(x.T @ x), blocks, 3)
    kept = sorted(c for b in range(6) if b not in removal.order for c in blocks[b].tolist())
    torch.testing.assert_close(new[:, kept], _refit(weight, x, kept), rtol=1e-8, atol=1e-10)
    gone = [c for c in range(12) if c not in kept]
    assert torch.count_nonzero(new[:, gone]) == 0


def test_block_error_is_the_output_error_of_removing_it_and_refitting():
    weight, x = _layer(seed=1)
    inverse = damped_inverse(x.T @ x)
    blocks = [torch.tensor([3 * b, 3 * b + 1, 3 * b + 2]) for b in range(4)]
    errors = block_errors(weight, inverse, blocks)
    for b, cols in enumerate(blocks):
        kept = [c for c in range(12) if c not in cols.tolist()]
        new = torch.zeros_like(weight)
        new[:, kept] = _refit(weight, x, kept)
        assert errors[b].item() == pytest.approx(_damped_error(weight, new, x), rel=1e-8)
    # greedy's first choice is the cheapest block
    removal = greedy_remove(weight.clone(), inverse.clone(), blocks, 1)
    assert removal.order == [int(torch.argmin(errors))]


def test_greedy_pair_is_never_worse_than_the_first_pair_it_could_have_taken():
    """Two single columns removed greedily cost no more than removing the first one with any
    other column whose pair the greedy did not take (the second step is optimal given the first)."""
    weight, x = _layer(n=8, seed=2)
    removal = greedy_remove(weight.clone(), damped_inverse(x.T @ x), [torch.tensor([c]) for c in range(8)], 2)
    first = removal.order[0]

    def cost(pair):
        kept = [c for c in range(8) if c not in pair]
        new = torch.zeros_like(weight)
        new[:, kept] = _refit(weight, x, kept)
        return _damped_error(weight, new, x)

    chosen = cost(removal.order)
    assert all(chosen <= cost((first, other)) + 1e-9 for other in range(8) if other != first)
    assert chosen == pytest.approx(sum(removal.errors), rel=1e-8)  # the errors add up along the path


def test_column_greedy_equals_the_step_by_step_update():
    """One-column blocks take `greedy_remove`'s deferred-inverse path; the same removals made
    block by block (`remove_block` at every step, forced by a group quota) choose the same
    columns at the same errors and leave the same weights and inverse."""
    weight, x = _layer(out=7, n=40, tokens=400, seed=4)
    inverse = damped_inverse(x.T @ x)
    columns = [torch.tensor([c]) for c in range(40)]
    fast_w, fast_inv = weight.clone(), inverse.clone()
    fast = greedy_remove(fast_w, fast_inv, columns, 25)
    slow_w, slow_inv = weight.clone(), inverse.clone()
    slow = greedy_remove(slow_w, slow_inv, columns, 25, group_of=[0] * 40, quota={0: 25})
    assert fast.order == slow.order
    assert fast.errors == pytest.approx(slow.errors, rel=1e-9)
    torch.testing.assert_close(fast_w, slow_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fast_inv, slow_inv, rtol=1e-9, atol=1e-12)


def test_obs_heads_keep_a_gqa_valid_shape():
    weight, x = _layer(out=5, n=8 * 4, tokens=300, seed=3)  # 8 heads of 4 columns, 2 KV groups
    kept_kv, kept_heads = obs_heads(weight, damped_inverse(x.T @ x), n_kv_heads=2, head_dim=4, kv_groups=1, heads_per_group=2)
    assert len(kept_kv) == 1 and len(kept_heads) == 2
    assert all(h // 4 == kept_kv[0] for h in kept_heads)
    kept_kv, kept_heads = obs_heads(weight, damped_inverse(x.T @ x), n_kv_heads=2, head_dim=4, kv_groups=2, heads_per_group=3)
    assert kept_kv == [0, 1] and [sum(h // 4 == g for h in kept_heads) for g in (0, 1)] == [3, 3]


def test_all_zero_inputs_refuse():
    with pytest.raises(ObsError, match="every input of the layer is zero"):
        damped_inverse(torch.zeros(4, 4, dtype=torch.float64))


def _ids(n=4, t=24, seed=0):
    return torch.randint(5, 4000, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_obs_prune_counts_as_planned_and_rate_zero_changes_nothing(make_tiny, family):
    lm = make_tiny(family, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    ids = _ids()
    with torch.no_grad():
        before = lm.model(input_ids=ids).logits
    result = obs_prune(lm, make_plan(lm, [0.0, 0.0], [0.0, 0.0], "obs"), ids, 2)
    assert result.params_after == result.params_before
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, before, rtol=0, atol=0)
    result = obs_prune(lm, make_plan(lm, [0.5, 0.3], [0.25, 0.75], "obs"), ids, 2)
    assert result.params_after == result.plan.params["pruned_total"] < result.params_before
    assert [len(c) for c in result.kept_channels] == [96, 32]
    with torch.no_grad():
        assert torch.isfinite(lm.model(input_ids=ids).logits).all()


@pytest.mark.slow
def test_obs_update_lowers_the_pruned_blocks_calibration_error(make_tiny):
    """The same units removed with and without SlimGPT's update: with it, the last block's
    output on the calibration windows is closer to the dense model's (one block pruned)."""
    dense = make_tiny("llama", num_hidden_layers=1, intermediate_size=128)
    ids = _ids(8, 32)
    plan = make_plan(dense, [0.0], [0.5], "obs")
    with torch.no_grad():
        target = dense.model.model(input_ids=ids).last_hidden_state
    updated = dense.copy()
    kept = obs_prune(updated, plan, ids, 4).kept_channels[0]
    plain = dense.copy()
    mlp = plain.adapter.mlp(plain.adapter.layers(plain.model)[0])
    with torch.no_grad():
        drop = [c for c in range(128) if c not in kept]
        mlp.down_proj.weight[:, drop] = 0.0
        error_plain = (plain.model.model(input_ids=ids).last_hidden_state - target).pow(2).sum()
        error_obs = (updated.model.model(input_ids=ids).last_hidden_state - target).pow(2).sum()
    assert error_obs < error_plain


def test_obs_has_no_scores_and_no_table(make_tiny, tmp_path):
    lm = make_tiny("llama")
    with pytest.raises(GapError, match="chooses units while pruning"):
        compute_importance(lm, _ids(), "obs")
    with pytest.raises(TableError, match="chooses units while pruning"):
        TableSpec(criterion="obs").validate()


@pytest.mark.slow
def test_prune_with_plan_runs_obs_on_the_calibration_windows(make_tiny, tmp_path):
    text = tmp_path / "calib.txt"
    words = ["pruning", "heads", "channels", "layer", "budget", "model", "loss", "text"]
    text.write_text("\n\n".join(" ".join(p) + "." for p in itertools.islice(itertools.permutations(words, 8), 60)))
    lm = make_tiny("llama", intermediate_size=128)
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.5], "obs")
    result = prune_with_plan(lm, plan, WindowSpec(data=str(text), n_samples=2, seq_len=32, batch_size=2))
    assert result.params_after == plan.params["pruned_total"]


def _down_inputs_and_outputs(lm, ids):
    """(inputs, outputs) of block 0's down_proj over every token of ``ids``."""
    seen = []
    down = lm.adapter.mlp_projections(lm.adapter.layers(lm.model)[0])[2]
    handle = down.register_forward_hook(lambda m, a, out: seen.append((a[0].reshape(-1, a[0].shape[-1]), out.reshape(-1, out.shape[-1]))))
    with torch.no_grad():
        lm.model(input_ids=ids)
    handle.remove()
    return seen[0]


@pytest.mark.slow
def test_bias_after_obs_removes_the_mean_of_what_the_update_leaves(make_tiny):
    """One block, MLP channels only: down_proj sees the dense inputs, so with the bias its output's
    mean over the calibration tokens is the dense output's, and its squared error is lower by the
    squared mean residual per token."""
    dense = make_tiny("llama", num_hidden_layers=1, intermediate_size=128, initializer_range=0.2)
    ids = _ids(8, 32)
    plan = make_plan(dense, [0.0], [0.5], "obs")
    x, dense_out = _down_inputs_and_outputs(dense, ids)
    outputs = {}
    for mode in ("none", "bias"):
        pruned = dense.copy()
        result = obs_prune(pruned, plan, ids, 4, compensation=CompensationSettings(mode=mode))
        kept = result.kept_channels[0]
        x_kept, out = _down_inputs_and_outputs(pruned, ids)
        torch.testing.assert_close(x_kept, x[:, kept])  # the same inputs: nothing before down_proj changed
        outputs[mode] = out
    residual = {mode: dense_out - out for mode, out in outputs.items()}
    mean_none = residual["none"].mean(0).abs().max()
    assert mean_none > 0.01 * residual["none"].abs().mean()  # OBS has no intercept: its residual has a mean
    assert residual["bias"].mean(0).abs().max() < 1e-4 * mean_none
    tokens = residual["none"].shape[0]
    drop = tokens * residual["none"].mean(0).pow(2).sum()
    assert residual["bias"].pow(2).sum() == pytest.approx(float(residual["none"].pow(2).sum() - drop), rel=1e-4)


@pytest.mark.slow
def test_bias_after_obs_through_the_output_norm_is_the_residual_mean_each_token_weighted(make_tiny):
    """Gemma 3, one block, MLP channels only: down_proj sees the dense inputs, OBS chooses and updates the same
    columns whatever the bias's weighting, and the output-norm bias is the mean of what the update leaves with each
    token weighted by ``1 / (mean(y^2) + eps)`` of the dense output ``y`` (the norm after down_proj rescales the
    error by it), where the plain bias is the plain mean."""
    dense = make_tiny("gemma3_text", num_hidden_layers=1, intermediate_size=128, initializer_range=0.2)
    ids = _ids(8, 32)
    plan = make_plan(dense, [0.0], [0.5], "obs")
    _, dense_out = _down_inputs_and_outputs(dense, ids)
    dense_out = dense_out.double()
    eps = dense.adapter.output_norm(dense.adapter.layers(dense.model)[0], False).eps
    weights = 1.0 / (dense_out.square().mean(-1, keepdim=True) + eps)  # (tokens, 1)
    bias, residual = {}, {}
    for weighting in ("tokens", "output-norm"):
        pruned = dense.copy()
        result = obs_prune(pruned, plan, ids, 4, compensation=CompensationSettings(mode="bias", weighting=weighting))
        assert result.compensation.get("weighting", "tokens") == weighting
        down = pruned.adapter.mlp_projections(pruned.adapter.layers(pruned.model)[0])[2]
        bias[weighting] = down.bias.detach().double()
        _, out = _down_inputs_and_outputs(pruned, ids)
        residual[weighting] = dense_out - (out.double() - bias[weighting])  # what the OBS update leaves, bias aside
    torch.testing.assert_close(residual["output-norm"], residual["tokens"], rtol=1e-4, atol=1e-5)  # the same units and update
    torch.testing.assert_close(bias["tokens"], residual["tokens"].mean(0), rtol=1e-4, atol=1e-6)
    expected = (weights * residual["tokens"]).sum(0) / weights.sum()
    torch.testing.assert_close(bias["output-norm"], expected, rtol=1e-4, atol=1e-6)
    assert float((expected - bias["tokens"]).norm()) > 1e-3 * float(expected.norm())


def test_obs_refuses_the_output_norm_bias_where_no_norm_follows(make_tiny):
    lm = make_tiny("llama")
    before = {name: tensor.clone() for name, tensor in lm.model.state_dict().items()}
    with pytest.raises(CompensationError, match="output-norm weighting .* none"):
        obs_prune(lm, make_plan(lm, [0.5, 0.0], [0.25, 0.5], "obs"), _ids(), 2, CompensationSettings(mode="bias", weighting="output-norm"))
    assert all(torch.equal(lm.model.state_dict()[name], tensor) for name, tensor in before.items())
    with pytest.raises(CompensationError, match="none fits nothing"):
        CompensationSettings(mode="none", weighting="output-norm").validate()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_bias_after_obs_is_counted_recorded_and_saved(make_tiny, tmp_path, family):
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.loading import load_model

    lm = make_tiny(family, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    ids = _ids()
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.0], "obs")  # block 1 loses nothing: it gets no bias
    result = obs_prune(lm, plan, ids, 2, compensation=CompensationSettings(mode="bias"))
    hidden = lm.model.config.hidden_size
    assert result.compensation["mode"] == "bias" and result.compensation["bias_params"] == 2 * hidden
    assert result.params_after == plan.params["pruned_total"] + 2 * hidden == lm.param_count()
    assert lm.pruned_from["compensation"]["bias_params"] == 2 * hidden
    layer0, layer1 = lm.adapter.layers(lm.model)
    assert lm.adapter.mlp_projections(layer1)[2].bias is None and lm.adapter.attention_projections(layer1)[3].bias is None
    assert torch.count_nonzero(lm.adapter.mlp_projections(layer0)[2].bias) > 0
    assert torch.count_nonzero(lm.adapter.attention_projections(layer0)[3].bias) > 0
    with torch.no_grad():
        logits = lm.model(input_ids=ids).logits
    save_pruned(lm, result.plan, result.kept_indices(), tmp_path / "ckpt", dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(tmp_path / "ckpt")).model(input_ids=ids).logits, logits)


@pytest.mark.parametrize("mode", ["refit", "bias+refit"])
def test_obs_takes_no_refit(make_tiny, mode):
    lm = make_tiny("llama")
    with pytest.raises(CompensationError, match="none or bias"):
        obs_prune(lm, make_plan(lm, [0.5, 0.0], [0.25, 0.5], "obs"), _ids(), 2, compensation=CompensationSettings(mode=mode))
