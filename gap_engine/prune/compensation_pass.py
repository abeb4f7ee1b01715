"""Compensation as a pipeline stage: surgery whose kept units take over, block by block.

``prune_compensated`` prunes a model as ``surgery.apply_plan`` does and compensates what it cut
(``prune.compensate``), layer-sequentially as Týr-the-Pruner and SlimGPT propagate: block
``i`` is fitted on the hidden states that the already pruned and compensated blocks
``0..i-1`` give on the calibration windows (the pruned stream), so each block repairs its own
cut on the inputs it will really see. Only one block at a time is on the device
(``layerwise.block_on``): a streamed model compensates exactly as a resident one.

Per block the work is three partial passes over the calibration windows: to the input of
``o_proj`` (the attention's moments), to the input of ``down_proj`` with the attention
compensated (the MLP's moments), and the whole block pruned and compensated (the next block's
inputs); with ``target="dense"`` one more pass runs the dense block on the dense stream.
The kept columns are rewritten in place; the biases are kept apart until surgery has sliced
the blocks, then each ``o_proj`` and ``down_proj`` that lost inputs gets one (and no other:
the checkpoint records which, ``checkpoint.OUTPUT_BIAS``).

All or nothing, as surgery: refit columns and biases go into new modules, so a cancelled or
failed pass puts every block back as it was (``slicing.restored_on_failure``), fingerprint
included.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import input_device, placement_of
from gap_engine.core.errors import CompensationError, InvariantError
from gap_engine.core.progress import COMPENSATE, NO_HOOKS, Hooks, reporting, steps
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches, calibration_windows
from gap_engine.model.layerwise import block_on, capture_calls, layer_output, to_host
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.slicing import replace_linear_, restored_on_failure
from gap_engine.model.units import added_bias_params, block_geometries
from gap_engine.prune.compensate import BlockFit, BlockInputs, applied, check_weighting, fit_block, kept_columns
from gap_engine.prune.compensations import CompensationSettings, with_family_fit
from gap_engine.prune.importance import ImportanceScores
from gap_engine.prune.surgery import PruneResult, apply_plan, plan_units

log = logging.getLogger(__name__)

Removed = list[tuple[tuple[int, ...], tuple[int, ...]]]  # per block: (removed heads, removed channels)


def removed_per_block(lm: LoadedModel, plan: RatePlan, scores: ImportanceScores | None) -> Removed:
    """The heads and channels surgery will remove from every block: ``surgery.plan_units``, the
    one choice of units (a plan's recorded attention shapes included)."""
    return [(block.removed_heads, block.removed_channels) for block in plan_units(lm, plan, scores)]


def check_calibration(lm: LoadedModel, tokens: int, settings: CompensationSettings) -> None:
    """CompensationError unless ``tokens`` calibration tokens can fit every refit: a least-squares
    refit of a projection needs at least as many tokens as the projection has inputs (the
    widest o_proj or down_proj of the model; 1,536 for SmolLM2-135M)."""
    if not settings.refits:
        return
    # The widest projection names the minimum (naming the first too narrow would send a user back twice).
    width, i, name = max(
        (linear.in_features, i, name)
        for i, layer in enumerate(lm.adapter.layers(lm.model))
        for name, linear in (
            (lm.adapter.output_name, lm.adapter.attention_projections(layer)[3]),
            (lm.adapter.down_name, lm.adapter.mlp_projections(layer)[2]),
        )
    )
    if tokens < width:
        raise CompensationError(
            f"the {settings.mode} compensation fits block {i}'s {name} ({width} inputs) from {tokens} calibration tokens; "
            f"give at least {width} (more or longer calibration windows), or choose a compensation that refits nothing (bias)"
        )


def calibration_tokens(windows: WindowSpec, settings: CompensationSettings | None = None) -> int:
    """The tokens a compensation is fitted on: every position of its windows (``fit_windows``: ``settings.samples``
    of ``windows``' text; None: ``windows``)."""
    fitted = fit_windows(windows, None if settings is None else settings.samples)
    return fitted.n_samples * fitted.seq_len


def _dense_targets(
    lm: LoadedModel, layer: nn.Module, states: list[torch.Tensor], calls: Sequence[Any], device: torch.device, skip: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """The dense block on the dense stream: per batch its (o_proj, down_proj) inputs, and its outputs."""
    o_proj, down_proj = lm.adapter.attention_projections(layer)[3], lm.adapter.mlp_projections(layer)[2]
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0][:, skip:]  # (B, T-skip, n)
        seen.append(to_host(x.reshape(-1, x.shape[-1])))

    handles = [o_proj.register_forward_pre_hook(keep), down_proj.register_forward_pre_hook(keep)]
    targets, outputs = [], []
    try:
        for b, hidden in enumerate(states):
            args, kwargs = calls[b]
            outputs.append(to_host(layer_output(layer(hidden.to(device), *args, **kwargs))))
            targets.append((seen[0], seen[1]))
            seen.clear()
    finally:
        for handle in handles:
            handle.remove()
    return targets, outputs


def _commit(lm: LoadedModel, layer: nn.Module, heads: Sequence[int], channels: Sequence[int], fit: BlockFit) -> None:
    """Give a block its refit kept columns for good: new o_proj / down_proj modules (on the host),
    the old ones left untouched for ``restored_on_failure``."""
    geom = lm.adapter.geometry(layer)
    for owner, name, part, cols in (
        (lm.adapter.attention(layer), lm.adapter.output_name, fit.attn, kept_columns(geom.n_heads, geom.head_dim, heads)),
        (lm.adapter.mlp(layer), lm.adapter.down_name, fit.mlp, kept_columns(geom.intermediate_size, 1, channels)),
    ):
        if part.weight is not None:
            weight = getattr(owner, name).weight.detach().clone()  # (d, n)
            weight[:, cols.to(weight.device)] = part.weight.to(weight.device, weight.dtype)
            replace_linear_(owner, name, weight=weight)


@torch.no_grad()
def compensate_blocks(
    lm: LoadedModel, removed: Removed, windows: torch.Tensor, batch_size: int, settings: CompensationSettings
) -> list[BlockFit]:
    """Fit every block in turn on the pruned stream and rewrite its kept columns in place.

    Args:
        lm: the model before surgery (resident or streamed); its units are not sliced here.
        removed: per block, the heads and channels surgery will remove.
        windows: (N, T) calibration token ids.
        batch_size: windows per block call.
        settings: the compensation (validated).
        The active stage is told (blocks done, blocks, eta) after every block and its cancel
        polled before each (``core.progress.steps``).
    Returns:
        Per block its BlockFit: the biases are not installed yet (``install_biases``).
    """
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    # A leading BOS is context, never a prediction, and a plain fit leaves it out; but every later token attends to
    # it, and where a norm follows the projections its output is rescaled like any other: the output-norm fit counts
    # it, at the weight its own (often tiny) output gives it.
    skip = 0 if settings.weighted else text_start(lm.tokenizer, windows)
    calls, states = [], []
    for batch in batches(windows, batch_size):
        first, block_calls = capture_calls(lm, batch.to(input_device(lm.model)))
        calls.append(block_calls)
        states.append(to_host(first))
    dense_states = list(states) if settings.target == "dense" else None
    fits: list[BlockFit] = []
    for i, layer in enumerate(steps(layers, "compensation", "blocks", timed=True)):
        heads, channels = removed[i]
        block_calls = [c[i] for c in calls]
        with block_on(layer, device):
            targets = None
            if dense_states is not None:
                targets, dense_states = _dense_targets(lm, layer, dense_states, block_calls, device, skip)
            inputs = BlockInputs(states, block_calls, device, skip, targets)
            fit = fit_block(lm.adapter, layer, i, inputs, heads, channels, settings)
            with applied(lm.adapter, layer, heads, channels, fit):
                states = [to_host(layer_output(layer(s.to(device), *args, **kwargs))) for s, (args, kwargs) in zip(states, block_calls)]
        _commit(lm, layer, heads, channels, fit)  # on the host: the block is back there
        fits.append(fit)
    return fits


def install_biases(lm: LoadedModel, fits: Sequence[BlockFit]) -> None:
    """Give each o_proj and down_proj its fitted bias; a projection with none fitted (it lost no
    input) stays as it is, so no parameter is added where nothing was cut."""
    for layer, fit in zip(lm.adapter.layers(lm.model), fits):
        if fit.attn.bias is not None:
            replace_linear_(lm.adapter.attention(layer), lm.adapter.output_name, bias=fit.attn.bias, add_bias=True)
        if fit.mlp.bias is not None:
            replace_linear_(lm.adapter.mlp(layer), lm.adapter.down_name, bias=fit.mlp.bias, add_bias=True)


def fit_windows(windows: WindowSpec, samples: int | None) -> WindowSpec:
    """The windows a compensation is fitted on: ``windows``' source, length and seed, ``samples`` of them (None:
    ``windows`` themselves). The units it compensates are still those the plan's criterion chose."""
    if samples is None or samples == windows.n_samples:
        return windows
    return dataclasses.replace(windows, n_samples=samples).validate()


def prune_compensated(
    lm: LoadedModel,
    plan: RatePlan,
    scores: ImportanceScores | None,
    windows: WindowSpec,
    settings: CompensationSettings,
    hooks: Hooks = NO_HOOKS,
) -> PruneResult:
    """Prune ``lm`` in place as ``plan`` says and compensate what was cut.

    Args:
        lm: a LoadedModel (modified; its fingerprint is refreshed).
        plan: a RatePlan for it.
        scores: its importance scores (None only for an all-zero plan).
        windows: the calibration windows (the table's); the blocks are fitted on ``settings.samples`` of the same
            text (``fit_windows``; None: ``fit_window_count``, the model family's floor where these are fewer, else these).
        settings: the compensation; ``none`` is surgery alone.
        hooks: the ``compensate`` stage entered, progress over blocks, cancel between blocks.
    Returns:
        surgery's PruneResult; ``params_after`` counts the biases, ``compensation`` says what was done
        (with ``bias_params``, the parameters the biases added: a bias on each o_proj and
        down_proj that lost inputs, ``units.added_bias_params``).
    Raises:
        CompensationError: too few calibration tokens for a refit (before any work), a singular system.
    """
    settings.validate()
    if not settings.active:
        return apply_plan(lm, plan, scores)
    settings = with_family_fit(settings, lm.model_type, windows.n_samples)
    windows = fit_windows(windows, settings.samples)
    lm.refuse_shared("compensation")
    plan = dataclasses.replace(plan).validate()  # validate() normalises the rates: on our copy, not the caller's
    plan.check_model(lm)
    check_calibration(lm, calibration_tokens(windows), settings)
    check_weighting(lm.adapter, settings)
    removed = removed_per_block(lm, plan, scores)
    counts = block_geometries(lm)
    expected_biases = added_bias_params(counts, plan.attention_rates, plan.mlp_rates, plan.channel_multiple) if settings.adds_bias else 0
    ids = calibration_windows(lm.tokenizer, windows)
    hooks.enter(COMPENSATE)
    started = time.perf_counter()
    identity = (lm.fingerprint, lm.pruned_from)
    try:
        with restored_on_failure(lm.adapter, lm.adapter.layers(lm.model)):
            with reporting(hooks):
                fits = compensate_blocks(lm, removed, ids, windows.batch_size, settings)
            result = apply_plan(lm, plan, scores)
            install_biases(lm, fits)
            bias_params = lm.param_count() - result.params_after
            if bias_params != expected_biases:
                raise InvariantError(f"compensation added {bias_params} bias parameters, the count of its plan is {expected_biases}")
            if bias_params:
                result.params_after += bias_params
                lm.refresh_fingerprint()
    except BaseException:
        lm.fingerprint, lm.pruned_from = identity
        raise
    seconds = time.perf_counter() - started
    # bias_params: what the fitted biases add back (units.added_bias_params), so the net change is "removed - bias_params"
    result.compensation = settings.to_dict() | {"windows": asdict(windows), "seconds": round(seconds, 3), "bias_params": bias_params}
    if lm.pruned_from is not None:
        lm.pruned_from["compensation"] = result.compensation
    log.info("compensated %s (%s) in %.1f s", lm.name, settings.mode, seconds)
    return result
