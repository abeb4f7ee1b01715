"""SlimGPT's layer-wise pruning: each block chosen and fixed on the already pruned model's inputs.

The ``obs`` criterion (Ling et al., NeurIPS 2024) does not score the dense model once: block
by block, in order, the calibration windows run through the blocks already pruned, and on
those inputs the block loses its heads (columns of ``o_proj``) and then its MLP channels
(columns of ``down_proj``) by greedy structured OBS (``prune.obs``), the kept columns taking
the OBS update. The MLP sees the inputs of the block's pruned attention. How many units each
block loses is the plan's (SlimGPT's own layer rates: the ``slimgpt`` allocator), counted as
surgery counts them (``surgery.kept_counts``: a recorded attention shape wins over its rate).

Works on resident and streamed models: a block visits the device for its passes
(``layerwise.block_on``) and is updated and sliced on the host.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from gap_engine.core.device import input_device, placement_of
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.core.registry import register
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches
from gap_engine.model.layerwise import BlockCall, block_on, capture_calls, layer_output, to_host, tree_to
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, plan_params
from gap_engine.model.slicing import slice_attention_, slice_mlp_
from gap_engine.prune.obs import OBS_DAMPING, damped_inverse, obs_channels, obs_heads
from gap_engine.prune.surgery import PruneResult, finish_surgery, kept_counts

log = logging.getLogger(__name__)


class _Gram:
    """Accumulates X^T X of a linear layer's input (float64, on the host), text positions only."""

    def __init__(self, width: int, skip: int) -> None:
        self.gram = torch.zeros(width, width, dtype=torch.float64)
        self.skip = skip

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()[:, self.skip :]  # (B, T-skip, n)
        x = x.reshape(-1, x.shape[-1]).double()  # (B*(T-skip), n)
        self.gram += (x.T @ x).cpu()


def _run_block(
    layer: nn.Module, hidden: list[torch.Tensor], calls: list[list[BlockCall]], index: int, device: torch.device
) -> list[torch.Tensor]:
    """The block's output for every batch (host tensors), the block on ``device`` meanwhile."""
    outputs = []
    with block_on(layer, device):
        for b, states in enumerate(hidden):
            args, kwargs = calls[b][index]
            outputs.append(to_host(layer_output(layer(states.to(device), *args, **kwargs))))
    return outputs


def _input_gram(
    linear: nn.Linear,
    layer: nn.Module,
    hidden: list[torch.Tensor],
    calls: list[list[BlockCall]],
    index: int,
    device: torch.device,
    skip: int,
) -> torch.Tensor:
    gram = _Gram(linear.in_features, skip)
    handle = linear.register_forward_pre_hook(gram)
    try:
        _run_block(layer, hidden, calls, index, device)
    finally:
        handle.remove()
    return gram.gram


def _write_columns(linear: nn.Linear, weight: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight.copy_(weight.to(linear.weight.dtype))


@register(
    "criterion",
    "obs",
    "SlimGPT: greedy structured OBS block by block on the pruned model, kept columns updated",
    ("windows", "sequential"),
)
def obs_prune(lm: LoadedModel, plan: RatePlan, windows: torch.Tensor, batch_size: int = 4, hooks: Hooks = NO_HOOKS) -> PruneResult:
    """Prune ``lm`` in place as ``plan`` says, SlimGPT's way: block by block on the pruned stream.

    Args:
        lm: the dense LoadedModel (modified; its fingerprint is refreshed).
        plan: a RatePlan for this model (any criterion; its rates say how many units go).
        windows: (N, T) calibration token ids.
        batch_size: windows per block call.
        hooks: cancel polled before every block; progress told (blocks done, blocks, None).
    Raises:
        PlanError: the plan is for another model. ObsError: a block with no calibration signal
        (the OBS update rewrites kept columns in place, so a failure leaves ``lm`` partly pruned:
        callers prune a copy, as ``pipeline.stages.pruned_as_saved`` does). SharedModelError: ``lm`` is shared.
    """
    lm.refuse_shared("OBS pruning")
    plan = dataclasses.replace(plan).validate()  # normalised on our copy, not the caller's
    plan.check_model(lm)
    plan.params = plan_params(lm, plan)
    result = PruneResult(plan=plan, params_before=lm.param_count())
    device = placement_of(lm).device
    skip = text_start(lm.tokenizer, windows)
    layers = lm.adapter.layers(lm.model)
    with torch.no_grad():
        hidden, calls = [], []
        for batch in batches(windows, batch_size):
            first, block_calls = capture_calls(lm, batch.to(input_device(lm.model)))
            hidden.append(to_host(first))
            calls.append([tree_to(call, device) for call in block_calls])
        for i, layer in enumerate(layers):
            hooks.check_cancelled(f"OBS pruning cancelled at block {i} of {len(layers)}")
            geom = lm.adapter.geometry(layer)
            kept_kv, kept_heads = list(range(geom.n_kv_heads)), list(range(geom.n_heads))
            kept_channels = list(range(geom.intermediate_size))
            o = lm.adapter.attention_projections(layer)[3]
            shape, kept = kept_counts(
                lm.adapter, layer, plan.attention_rates[i], plan.mlp_rates[i], plan.channel_multiple, plan.attention_shape(i)
            )
            if shape.n_heads < geom.n_heads:
                weight = o.weight.detach().double().cpu()  # (d, H*D)
                inverse = damped_inverse(_input_gram(o, layer, hidden, calls, i, device, skip), OBS_DAMPING)
                kept_kv, kept_heads = obs_heads(weight, inverse, geom.n_kv_heads, geom.head_dim, shape.kv_groups, shape.heads_per_group)
                _write_columns(o, weight)
                slice_attention_(lm.adapter, layer, kept_kv, kept_heads)
            down = lm.adapter.mlp_projections(layer)[2]
            if kept < geom.intermediate_size:
                weight = down.weight.detach().double().cpu()  # (d, I)
                inverse = damped_inverse(_input_gram(down, layer, hidden, calls, i, device, skip), OBS_DAMPING)
                kept_channels = obs_channels(weight, inverse, kept)
                _write_columns(down, weight)
                slice_mlp_(lm.adapter, layer, kept_channels)
            hidden = _run_block(layer, hidden, calls, i, device)
            result.kept_kv_heads.append(kept_kv)
            result.kept_heads.append(kept_heads)
            result.kept_channels.append(kept_channels)
            hooks.report(i + 1, len(layers))
    return finish_surgery(lm, result)
