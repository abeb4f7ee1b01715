"""Compensation after surgery (``prune.compensate``, ``prune.compensation_pass``) on tiny models.

The claims of the module docstrings: a fit never increases a projection's calibration
reconstruction error (the ridge is on the change), a plan that removes nothing changes no
weight, streaming changes no number, and what cannot be solved is one line before any work.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import Placement
from gap_engine.core.errors import CancelledError, CompensationError
from gap_engine.core.progress import Hooks
from gap_engine.data.bos import text_start
from gap_engine.data.windows import calibration_windows
from gap_engine.model.layerwise import capture_calls
from gap_engine.model.loading import place_model
from gap_engine.model.rateplan import make_plan, uniform_plan
from gap_engine.model.slicing import output_bias_layout
from gap_engine.prune.compensate import NO_FIT, BlockFit, BlockInputs, Moments, applied, fit_block, kept_columns, refit_fit
from gap_engine.prune.compensation_pass import check_calibration, prune_compensated, removed_per_block
from gap_engine.prune.compensations import COMPENSATIONS, CompensationSettings
from gap_engine.prune.importance import compute_importance

FAMILIES = ["llama", "gemma3_text"]
WIDE = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
CALIB = WindowSpec(n_samples=4, seq_len=64, batch_size=2)  # 256 tokens of wiki-sample: more than any kept width here


def output_biases(adapter, model) -> bool:
    """Whether any block's o_proj or down_proj carries a bias."""
    return any(any(pair) for pair in output_bias_layout(adapter, model))


def _setup(make_tiny, family, attention=(0.5, 0.25), mlp=(0.5, 0.25)):
    lm = make_tiny(family, **WIDE)
    ids = calibration_windows(lm.tokenizer, CALIB)
    scores = compute_importance(lm, ids, "wanda")
    return lm, ids, scores, make_plan(lm, list(attention), list(mlp), "wanda")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", COMPENSATIONS.names)
@pytest.mark.slow
def test_a_plan_that_removes_nothing_changes_no_weight(make_tiny, family, mode):
    lm = make_tiny(family, **WIDE)
    before = {name: tensor.clone() for name, tensor in lm.model.state_dict().items()}
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, CALIB), "wanda")
    result = prune_compensated(lm, uniform_plan(lm, 0.0, "wanda"), scores, CALIB, CompensationSettings(mode=mode))
    after = lm.model.state_dict()
    assert after.keys() == before.keys() and result.params_after == result.params_before
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_refit_leaves_an_uncut_part_as_it_was(make_tiny, family):
    lm, _, scores, _ = _setup(make_tiny, family)
    plan = make_plan(lm, [0.5, 0.0], [0.0, 0.0], "wanda")  # only block 0's attention loses heads
    downs = [lm.adapter.mlp_projections(layer)[2].weight.clone() for layer in lm.adapter.layers(lm.model)]
    o_before = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[3].weight.clone()
    prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="refit"))
    for layer, down in zip(lm.adapter.layers(lm.model), downs):
        torch.testing.assert_close(lm.adapter.mlp_projections(layer)[2].weight, down, rtol=0, atol=0)
    o_after = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[3].weight
    assert o_after.shape[1] < o_before.shape[1] and not output_biases(lm.adapter, lm.model)


def _projection_errors(lm, ids, layer_index, heads, channels, fit):
    """Per projection, the calibration reconstruction error ``sum ||dense(x) - pruned(x)||^2`` of a
    block run as pruned and compensated by ``fit`` (its inputs: block 0's, the dense stream)."""
    layer = lm.adapter.layers(lm.model)[layer_index]
    o_proj, down_proj = lm.adapter.attention_projections(layer)[3], lm.adapter.mlp_projections(layer)[2]
    dense = {"o": o_proj.weight.clone(), "down": down_proj.weight.clone()}
    errors = {"o": 0.0, "down": 0.0}

    def hook(name, module, args, output):
        x = args[0]
        errors[name] += float(((x @ dense[name].T) - output).pow(2).sum())

    with torch.no_grad(), applied(lm.adapter, layer, heads, channels, fit):
        # registered after the fit's own bias hooks, so they see the compensated outputs
        handles = [o_proj.register_forward_hook(lambda m, a, o: hook("o", m, a, o))]
        handles.append(down_proj.register_forward_hook(lambda m, a, o: hook("down", m, a, o)))
        try:
            for start in range(0, ids.shape[0], 2):
                hidden, calls = capture_calls(lm, ids[start : start + 2])
                args, kwargs = calls[layer_index]
                layer(hidden, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
    return errors


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_no_fit_increases_a_projections_reconstruction_error(make_tiny, family):
    lm, ids, scores, plan = _setup(make_tiny, family)
    heads, channels = removed_per_block(lm, plan, scores)[0]
    hidden, calls = [], []
    for start in range(0, ids.shape[0], 2):
        first, block_calls = capture_calls(lm, ids[start : start + 2])
        hidden.append(first)
        calls.append(block_calls[0])
    inputs = BlockInputs(hidden, calls, torch.device("cpu"), text_start(lm.tokenizer, ids))
    layer = lm.adapter.layers(lm.model)[0]
    uncompensated = _projection_errors(lm, ids, 0, heads, channels, BlockFit())
    for mode in ("bias", "refit", "bias+refit"):
        fit = fit_block(lm.adapter, layer, 0, inputs, heads, channels, CompensationSettings(mode=mode))
        errors = _projection_errors(lm, ids, 0, heads, channels, fit)
        # down_proj's inputs follow the attention's fit: compared on the same inputs, without its own fit
        unfitted = _projection_errors(lm, ids, 0, heads, channels, BlockFit(fit.attn, NO_FIT))
        assert errors["o"] < uncompensated["o"], (mode, errors, uncompensated)
        assert errors["down"] < unfitted["down"], (mode, errors, unfitted)


def test_the_refit_solves_the_damped_least_squares_problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 12, generator=generator) @ torch.randn(12, 12, generator=generator)  # correlated inputs
    weight = torch.randn(5, 12, generator=generator)
    kept = torch.tensor([0, 2, 3, 5, 8, 9, 11])
    moments = Moments.zeros(12, torch.device("cpu"))
    moments.add(x)
    damping = 0.01
    fit = refit_fit(moments, weight, kept, damping, "test")
    x64, w64 = x.double(), weight.double()
    gram = x64[:, kept].T @ x64[:, kept] / 400
    lam = damping * torch.diagonal(gram).mean()
    change = torch.linalg.solve(
        gram + lam * torch.eye(7, dtype=torch.float64), x64[:, kept].T @ (x64 @ w64.T - x64[:, kept] @ w64[:, kept].T) / 400
    )
    torch.testing.assert_close(fit.weight.double(), w64[:, kept] + change.T, rtol=1e-5, atol=1e-6)
    assert fit.bias is None


def test_all_zero_activations_are_a_singular_system():
    moments = Moments.zeros(8, torch.device("cpu"))
    moments.add(torch.zeros(64, 8))
    with pytest.raises(CompensationError, match="all zero"):
        refit_fit(moments, torch.randn(4, 8), torch.tensor([0, 1, 2]), 0.01, "block 0 o_proj")


@pytest.mark.slow
def test_a_dead_attention_is_refused_in_one_line(make_tiny):
    lm, _, scores, plan = _setup(make_tiny, "llama")
    with torch.no_grad():  # every head of block 0 outputs zeros: o_proj's kept inputs are all zero
        lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[2].weight.zero_()
    with pytest.raises(CompensationError, match="block 0 o_proj: .*all zero"):
        prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="refit"))


@pytest.mark.slow
def test_too_little_calibration_text_is_refused_before_any_work(make_tiny):
    lm, _, scores, plan = _setup(make_tiny, "llama")
    fingerprint = lm.fingerprint
    short = WindowSpec(n_samples=1, seq_len=16)
    with pytest.raises(CompensationError, match=r"from 16 calibration tokens; give at least \d+"):
        prune_compensated(lm, plan, scores, short, CompensationSettings(mode="refit"))
    lm.refresh_fingerprint()
    assert lm.fingerprint == fingerprint and lm.param_count() > plan.params["pruned_total"]
    # the bias alone solves no system: the same text is enough
    prune_compensated(lm, plan, scores, short, CompensationSettings(mode="bias"))
    assert output_biases(lm.adapter, lm.model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_streaming_compensates_exactly_as_resident(make_tiny, family):
    resident, _, scores, plan = _setup(make_tiny, family)
    streamed = place_model(resident.copy(), Placement(device=torch.device("cpu"), dtype=torch.float32, stream=True))
    settings = CompensationSettings(mode="bias+refit")
    expected = prune_compensated(resident, plan, scores, CALIB, settings)
    got = prune_compensated(streamed, plan, scores, CALIB, settings)
    assert got.params_after == expected.params_after == plan.params["pruned_total"] + 2 * 2 * 64  # two biases per block
    for name, tensor in resident.model.state_dict().items():
        torch.testing.assert_close(streamed.model.state_dict()[name], tensor, rtol=0, atol=0)
    fitted = 64 if family == "gemma3_text" else 4  # Gemma 3 fits on at least 64 windows when none are asked
    assert got.compensation["mode"] == "bias+refit" and streamed.pruned_from["compensation"]["windows"]["n_samples"] == fitted
    assert got.compensation["bias_params"] == expected.compensation["bias_params"] == 2 * 2 * 64


def test_kept_columns_are_the_complement_of_the_removed_units():
    assert kept_columns(4, 2, (1, 3)).tolist() == [0, 1, 4, 5]
    assert kept_columns(5, 1, (0,)).tolist() == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_cancelled_compensation_leaves_the_model_as_it_was(make_tiny):
    lm, _, scores, plan = _setup(make_tiny, "gemma3_text")
    before = {name: tensor.clone() for name, tensor in lm.model.state_dict().items()}
    fingerprint, params = lm.fingerprint, lm.param_count()
    cancel = threading.Event()
    hooks = Hooks(progress=lambda done, total, eta: cancel.set(), cancel=cancel)  # cancelled once block 0 is refit
    with pytest.raises(CancelledError, match="compensation cancelled after 1 of 2 blocks"):
        prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="bias+refit"), hooks)
    assert lm.fingerprint == fingerprint and lm.param_count() == params and lm.pruned_from is None
    after = lm.model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)


def _mean_input(model, linear, ids, skip: int) -> torch.Tensor:
    """(n,) float64: the mean input of ``linear`` over every counted calibration token of ``ids``."""
    total, count = None, 0

    def hook(module, args):
        nonlocal total, count
        x = args[0][:, skip:].reshape(-1, args[0].shape[-1]).double()  # (tokens, n)
        total = x.sum(0) if total is None else total + x.sum(0)
        count += x.shape[0]

    handle = linear.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], CALIB.batch_size):
                model(input_ids=ids[start : start + CALIB.batch_size])
    finally:
        handle.remove()
    return total / count


def _cut_with_bias(linear, columns: list[int], bias: torch.Tensor) -> None:
    """``linear`` computes as pruned of ``columns`` with ``bias`` added to its output (reference emulation)."""
    with torch.no_grad():
        linear.weight[:, columns] = 0.0
    linear.register_forward_hook(lambda module, args, output: output + bias.to(output.dtype))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_the_bias_is_the_removed_weights_times_the_removed_inputs_mean(make_tiny, family):
    """FLAP's bias computed directly: every block's o_proj gets ``W_o[:, R] @ mean(x_R)`` over the
    removed heads' columns and its down_proj ``W_d[:, R] @ mean(x_R)`` over the removed channels,
    the means over the calibration tokens of what each projection receives on the pruned stream
    (earlier blocks pruned and compensated; the MLP after its own block's attention is)."""
    from gap_engine.prune.surgery import removed_units

    lm = make_tiny(family, initializer_range=0.2, **WIDE)  # activations large enough that a bias is far from zero
    ids = calibration_windows(lm.tokenizer, CALIB)
    scores = compute_importance(lm, ids, "wanda")
    plan = make_plan(lm, [0.5, 0.25], [0.5, 0.25], "wanda")
    reference = lm.copy()
    skip = text_start(lm.tokenizer, ids)
    expected = []
    for i, layer in enumerate(reference.adapter.layers(reference.model)):
        heads, channels = removed_units(
            lm.adapter, layer, scores.layers[i], plan.attention_rates[i], plan.mlp_rates[i], plan.channel_multiple
        )
        assert heads and channels  # every block loses units of both kinds: no bias may be zero by construction
        head_dim = reference.adapter.geometry(layer).head_dim
        head_columns = [h * head_dim + j for h in heads for j in range(head_dim)]
        o_proj, down_proj = reference.adapter.attention_projections(layer)[3], reference.adapter.mlp_projections(layer)[2]
        b_attn = o_proj.weight.detach().double()[:, head_columns] @ _mean_input(reference.model, o_proj, ids, skip)[head_columns]
        _cut_with_bias(o_proj, head_columns, b_attn)
        b_mlp = down_proj.weight.detach().double()[:, list(channels)] @ _mean_input(reference.model, down_proj, ids, skip)[list(channels)]
        _cut_with_bias(down_proj, list(channels), b_mlp)
        expected.append((b_attn, b_mlp))

    # on the windows the means above read (a family's floor of fit windows would read more), every token alike (as the
    # means above count them; Gemma 3's own default weighs them through its output norms)
    prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="bias", samples=CALIB.n_samples, weighting="tokens"))
    for i, (layer, (b_attn, b_mlp)) in enumerate(zip(lm.adapter.layers(lm.model), expected)):
        o_proj, down_proj = lm.adapter.attention_projections(layer)[3], lm.adapter.mlp_projections(layer)[2]
        for name, linear, want in (("o_proj", o_proj, b_attn), ("down_proj", down_proj, b_mlp)):
            assert linear.bias is not None, f"block {i} {name} has no bias"
            assert float(want.abs().max()) > 1e-2  # a real correction, not a zero that any formula would match
            torch.testing.assert_close(linear.bias.double(), want, rtol=1e-5, atol=1e-6, msg=f"block {i} {name}")
    with torch.no_grad():  # and the shipped model computes what the emulation (zeroed columns + those biases) computes
        torch.testing.assert_close(lm.model(input_ids=ids).logits, reference.model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_refusal_names_the_widest_projection_a_refit_needs(make_tiny, family):
    """Too few tokens for a refit: the line names the minimum that fits every projection, not the first too narrow."""
    lm = make_tiny(family, intermediate_size=160)
    widths = [
        (lm.adapter.attention_projections(b)[3].in_features, lm.adapter.mlp_projections(b)[2].in_features)
        for b in lm.adapter.layers(lm.model)
    ]
    widest = max(max(pair) for pair in widths)
    assert widest > min(min(pair) for pair in widths)  # a narrower projection exists, so the first named could be wrong
    with pytest.raises(CompensationError, match=rf"down_proj \({widest} inputs\) from 8 calibration tokens; give at least {widest} "):
        check_calibration(lm, 8, CompensationSettings(mode="bias+refit"))
    check_calibration(lm, widest, CompensationSettings(mode="bias+refit"))


def test_weighted_moments_are_the_weighted_sums_and_unit_weights_change_nothing():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 10, generator=generator) @ torch.randn(10, 10, generator=generator)
    weights = torch.rand(300, generator=generator) * 5
    weight = torch.randn(4, 10, generator=generator)
    kept = torch.tensor([0, 1, 4, 6, 7, 9])
    weighted = Moments.zeros(10, torch.device("cpu"))
    weighted.add(x[:100], weights=weights[:100])
    weighted.add(x[100:], weights=weights[100:])
    x64, w64 = x.double(), weights.double()[:, None]
    # the products are taken in float32 and summed in float64 (``Moments.add``)
    torch.testing.assert_close(weighted.total / weighted.weight_sum, (w64 * x64).sum(0) / w64.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weighted.gram / weighted.weight_sum, (w64 * x64).T @ x64 / w64.sum(), rtol=1e-5, atol=1e-6)
    # the weighted refit is the weighted least-squares solution (ridge on the change, as unweighted)
    fit = refit_fit(weighted, weight, kept, 0.01, "test")
    gram = (w64 * x64[:, kept]).T @ x64[:, kept] / w64.sum()
    lam = 0.01 * torch.diagonal(gram).mean()
    rhs = (w64 * x64[:, kept]).T @ (x64 @ weight.double().T - x64[:, kept] @ weight.double()[:, kept].T) / w64.sum()
    change = torch.linalg.solve(gram + lam * torch.eye(6, dtype=torch.float64), rhs)
    torch.testing.assert_close(fit.weight.double(), weight.double()[:, kept] + change.T, rtol=1e-4, atol=1e-5)  # the fit is float32
    plain, ones = Moments.zeros(10, torch.device("cpu")), Moments.zeros(10, torch.device("cpu"))
    plain.add(x)
    ones.add(x, weights=torch.ones(300))
    assert plain.weight_sum == ones.weight_sum == 300
    torch.testing.assert_close(ones.total, plain.total, rtol=0, atol=0)
    torch.testing.assert_close(ones.gram, plain.gram, rtol=0, atol=0)


def test_the_output_norm_weighting_is_refused_where_no_norm_follows(make_tiny):
    lm, _, scores, plan = _setup(make_tiny, "llama")
    before = {name: tensor.clone() for name, tensor in lm.model.state_dict().items()}
    with pytest.raises(CompensationError, match="output-norm weighting .* none"):
        prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="bias", weighting="output-norm"))
    assert all(torch.equal(lm.model.state_dict()[name], tensor) for name, tensor in before.items())
    with pytest.raises(CompensationError, match="unknown compensation weighting 'norm'"):
        CompensationSettings(mode="bias", weighting="norm").validate()
    assert "weighting" not in CompensationSettings(mode="bias").to_dict()  # records made before it read the same
    assert CompensationSettings(mode="bias", weighting="output-norm").to_dict()["weighting"] == "output-norm"


@pytest.mark.slow
def test_the_output_norm_bias_is_the_mean_weighted_by_the_inverse_output_size(make_tiny):
    """On Gemma 3, whose post-norm rescales o_proj's output token by token, the output-norm bias is the removed
    heads' contribution averaged with each token weighted by ``1 / (mean(y^2) + eps)`` of the dense output ``y``: the
    least-squares bias after the norm, to first order. It differs from the plain mean, and each bias is the lower
    error by its own measure."""
    lm = make_tiny("gemma3_text", initializer_range=0.2, **WIDE)
    ids = calibration_windows(lm.tokenizer, CALIB)
    scores = compute_importance(lm, ids, "wanda")
    plan = make_plan(lm, [0.5, 0.25], [0.5, 0.25], "wanda")
    heads, channels = removed_per_block(lm, plan, scores)[0]
    layer = lm.adapter.layers(lm.model)[0]
    skip = text_start(lm.tokenizer, ids)
    hidden, calls, inputs = [], [], []
    o_proj = lm.adapter.attention_projections(layer)[3]
    handle = o_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0][:, skip:].reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        for start in range(0, ids.shape[0], 2):
            first, block_calls = capture_calls(lm, ids[start : start + 2])
            hidden.append(first)
            calls.append(block_calls[0])
            lm.model(input_ids=ids[start : start + 2])
    handle.remove()
    x = torch.cat(inputs)  # (tokens, n) block 0's o_proj inputs: the pruned stream is the dense one there
    weight = o_proj.weight.detach().double()
    head_dim = lm.adapter.geometry(layer).head_dim
    removed = [h * head_dim + j for h in heads for j in range(head_dim)]
    y = x @ weight.T  # (tokens, d)
    w = 1.0 / (y.square().mean(-1, keepdim=True) + lm.adapter.output_norm(layer, True).eps)  # (tokens, 1)
    contribution = x[:, removed] @ weight[:, removed].T  # (tokens, d) what the cut takes from every token
    expected = (w * contribution).sum(0) / w.sum()
    block = BlockInputs(hidden, calls, torch.device("cpu"), skip)
    fits = {
        weighting: fit_block(lm.adapter, layer, 0, block, heads, channels, CompensationSettings(mode="bias", weighting=weighting)).attn
        for weighting in ("tokens", "output-norm")
    }
    torch.testing.assert_close(fits["output-norm"].bias.double(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fits["tokens"].bias.double(), contribution.mean(0), rtol=1e-4, atol=1e-6)
    assert float((expected - contribution.mean(0)).norm()) > 1e-3 * float(expected.norm())

    def error(bias: torch.Tensor, by: torch.Tensor) -> float:
        return float((by * (contribution - bias).square().sum(-1, keepdim=True)).sum())

    assert error(fits["output-norm"].bias.double(), w) < error(fits["tokens"].bias.double(), w)
    ones = torch.ones_like(w)
    assert error(fits["tokens"].bias.double(), ones) < error(fits["output-norm"].bias.double(), ones)
