"""SlimGPT's layer-wise pruning: each block chosen and fixed on the already pruned model's inputs.

The ``obs`` criterion (Ling et al., NeurIPS 2024) does not score the dense model once: block
by block, in order, the calibration windows run through the blocks already pruned, and on
those inputs the block loses its heads (columns of ``o_proj``) and then its MLP channels
(columns of ``down_proj``) by greedy structured OBS (``prune.obs``), the kept columns taking
the OBS update. The MLP sees the inputs of the block's pruned attention. How many units each
block loses is the plan's (SlimGPT's own layer rates: the ``slimgpt`` allocator), counted as
surgery counts them (``surgery.kept_counts``: a recorded attention shape wins over its rate).

With ``bias`` compensation on top (FLAP's bias after SlimGPT's update), each output projection
also gets the mean of what the update leaves uncorrected: ``b = (W - W') mu``, with ``W`` the
dense weight, ``W'`` the updated one (removed columns zero) and ``mu`` the mean input over the
same calibration tokens as its Gram matrix. OBS minimises the summed squared error with no
intercept, so its residual has a mean that a bias removes. The bias acts on the block's own
passes at once (the MLP is chosen on the inputs of the compensated attention, the next block on
the compensated stream), and is installed in every block's ``o_proj`` and ``down_proj`` after
the count check, as ``compensation_pass`` does. A refit on top would solve the problem OBS's
update already solved, so ``bias`` is the only compensation this criterion takes. With the output-norm
weighting (``CompensationSettings.weighting``, Gemma 3's post-norms) ``mu`` is the mean over every
position, BOS included, each token weighted as ``prune.compensate.output_norm_weights`` weighs it, so
the bias is the one ``bias`` fits through the norms; the units and the update are chosen as before.

Works on resident and streamed models: a block visits the device for its passes
(``layerwise.block_on``) and is updated and sliced on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from gap_engine.core.device import input_device, placement_of
from gap_engine.core.errors import CompensationError, InvariantError
from gap_engine.core.progress import steps
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.layerwise import BlockCall, block_on, capture_calls, layer_output, to_host, tree_to
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, plan_params
from gap_engine.model.slicing import slice_attention_, slice_mlp_
from gap_engine.model.units import AttentionShape, added_bias_params, block_geometries
from gap_engine.prune.compensate import BlockFit, Fit, check_weighting, output_norm_weights
from gap_engine.prune.compensation_pass import install_biases
from gap_engine.prune.compensations import COMPENSATIONS, NO_COMPENSATION, CompensationSettings, adds_biases, with_family_weighting
from gap_engine.prune.obs import OBS_DAMPING, damped_inverse, obs_channels, obs_heads
from gap_engine.prune.surgery import PruneResult, finish_surgery, kept_counts

log = logging.getLogger(__name__)

Chosen = TypeVar("Chosen")  # what an OBS choice returns: kept heads, or kept channels
# What may follow the OBS update, itself a refit of the kept columns: every compensation that refits none.
OBS_COMPENSATIONS = COMPENSATIONS.subset(lambda compensation: not compensation.refits)


class _Gram:
    """Accumulates X^T X and the sum of X of a linear layer's input (float64, on the host), text positions only;
    with ``weigh`` (per-token weights of the output-norm bias) the weighted sum of X over every position instead."""

    def __init__(self, width: int, skip: int, weigh: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.gram = torch.zeros(width, width, dtype=torch.float64)
        self.total = torch.zeros(width, dtype=torch.float64)
        self.count = 0.0
        self.skip = skip
        self.weigh = weigh

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()[:, self.skip :]  # (B, T-skip, n)
        x = x.reshape(-1, x.shape[-1]).double()  # (B*(T-skip), n)
        self.gram += (x.T @ x).cpu()
        if self.weigh is None:
            self.total += x.sum(0).cpu()
            self.count += x.shape[0]
            return
        every = args[0].detach().reshape(-1, x.shape[-1])  # BOS counts in a fit through the norms (compensation_pass)
        weights = self.weigh(every).double()
        self.total += (weights[:, None] * every.double()).sum(0).cpu()
        self.count += float(weights.sum())

    @property
    def mean(self) -> torch.Tensor:
        """(n,) the mean input (weighted, with ``weigh``)."""
        return self.total / self.count if self.count > 0 else self.total


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
    weigh: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> _Gram:
    gram = _Gram(linear.in_features, skip, weigh)
    handle = linear.register_forward_pre_hook(gram)
    try:
        _run_block(layer, hidden, calls, index, device)
    finally:
        handle.remove()
    return gram


class _AddedBias:
    """A forward hook adding a fixed bias to a linear's output: the bias acts on the block's later
    passes before it is installed as a parameter (after the count check)."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output + self.bias.to(output.device, output.dtype)


def _write_columns(linear: nn.Linear, weight: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight.copy_(weight.to(linear.weight.dtype))


def check_follows_obs(compensation: CompensationSettings) -> None:
    """CompensationError unless ``compensation`` may follow the OBS update (``OBS_COMPENSATIONS``):
    the update is itself a least-squares refit of the kept columns, so a second refit is refused."""
    compensation.validate()
    if compensation.mode not in OBS_COMPENSATIONS:
        raise CompensationError(
            f"criterion 'obs' updates the kept columns itself (a refit); it takes --compensate {' or '.join(OBS_COMPENSATIONS)}, not {compensation.mode}"
        )


def obs_prune(
    lm: LoadedModel,
    plan: RatePlan,
    windows: torch.Tensor,
    batch_size: int = 4,
    compensation: CompensationSettings = NO_COMPENSATION,
) -> PruneResult:
    """Prune ``lm`` in place as ``plan`` says, SlimGPT's way: block by block on the pruned stream.

    Args:
        lm: the dense LoadedModel (modified; its fingerprint is refreshed).
        plan: a RatePlan for this model (any criterion; its rates say how many units go).
        windows: (N, T) calibration token ids.
        batch_size: windows per block call.
        compensation: ``none`` (the OBS update alone) or ``bias`` on top of it.
        The active stage is told (blocks done, blocks, None) after every block and its cancel
        polled before each (``core.progress.steps``).
    Returns:
        surgery's PruneResult; with ``bias``, ``params_after`` counts the biases and
        ``compensation`` records them (``bias_params``), as ``compensation_pass`` does.
    Raises:
        PlanError: the plan is for another model. ObsError: a block with no calibration signal
        (the OBS update rewrites kept columns in place, so a failure leaves ``lm`` partly pruned:
        callers prune a copy, as ``pipeline.stages.pruned_as_saved`` does). SharedModelError: ``lm`` is shared.
        CompensationError: a compensation other than none or bias.
    """
    lm.refuse_shared("OBS pruning")
    check_follows_obs(compensation)
    compensation = with_family_weighting(compensation, lm.model_type)
    check_weighting(lm.adapter, compensation)
    plan = dataclasses.replace(plan).validate()  # normalised on our copy, not the caller's
    plan.check_model(lm)
    plan.params = plan_params(lm, plan, adds_biases(plan.compensation))
    result = PruneResult(plan=plan, params_before=lm.param_count())
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    counts = block_geometries(lm)  # the dense blocks: what the biases are counted against
    expected_biases = added_bias_params(counts, plan.attention_rates, plan.mlp_rates, plan.channel_multiple)
    biases: list[BlockFit] = []
    started = time.perf_counter()
    with torch.no_grad():
        hidden, calls = [], []
        for batch in batches(windows, batch_size):
            first, block_calls = capture_calls(lm, batch.to(input_device(lm.model)))
            hidden.append(to_host(first))
            calls.append([tree_to(call, device) for call in block_calls])
        norms = lm.adapter if compensation.adds_bias and compensation.weighted else None
        stream = _Stream(hidden, calls, device, text_start(lm.tokenizer, windows), compensation.adds_bias, norms)
        try:
            for i, layer in enumerate(steps(layers, "OBS pruning", "blocks")):
                # counted as surgery counts them: a recorded attention shape wins over its rate
                shape, kept = kept_counts(
                    lm.adapter, layer, plan.attention_rates[i], plan.mlp_rates[i], plan.channel_multiple, plan.attention_shape(i)
                )
                kept_kv, kept_heads, attn_bias = _prune_heads(lm, layer, i, shape, stream)
                kept_channels, mlp_bias = _prune_channels(lm, layer, i, kept, stream)
                biases.append(BlockFit(attn=Fit(None, attn_bias), mlp=Fit(None, mlp_bias)))
                stream.hidden = _run_block(layer, stream.hidden, calls, i, device)
                result.kept_kv_heads.append(kept_kv)
                result.kept_heads.append(kept_heads)
                result.kept_channels.append(kept_channels)
        finally:
            for handle in stream.added:
                handle.remove()
    result = finish_surgery(lm, result)
    if compensation.adds_bias:
        _install(lm, result, biases, compensation, time.perf_counter() - started, expected_biases)
    return result


@dataclass
class _Stream:
    """The calibration windows on their way through the blocks pruned so far."""

    hidden: list[torch.Tensor]  # per batch, the next block's input (host)
    calls: list[list[BlockCall]]  # per batch, every block's other arguments
    device: torch.device  # where a block runs
    skip: int  # leading positions no statistic counts (a BOS token)
    with_bias: bool  # bias compensation on top of the OBS update
    norms: ArchitectureAdapter | None = None  # the family whose output norms weigh each token of the bias (output-norm)
    added: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)  # the biases acting before they are installed


def _obs_update(
    linear: nn.Linear, layer: nn.Module, index: int, stream: _Stream, choose: Callable[[torch.Tensor, torch.Tensor], Chosen]
) -> tuple[Chosen, torch.Tensor | None]:
    """Choose units of ``linear``'s input by OBS (``choose(weight, inverse)``, which updates
    ``weight`` in place), write the updated columns, and return (the choice, its bias or None)."""
    weight = linear.weight.detach().double().cpu()  # (d, n)
    dense_weight = weight.clone()
    weigh = None
    if stream.norms is not None:
        attention = linear is stream.norms.attention_projections(layer)[3]
        weigh = output_norm_weights(stream.norms, layer, linear, attention, index)
    gram = _input_gram(linear, layer, stream.hidden, stream.calls, index, stream.device, stream.skip, weigh)
    chosen = choose(weight, damped_inverse(gram.gram, OBS_DAMPING))
    _write_columns(linear, weight)
    # The removed columns are zero in the update: (W - W') mu is the dense output's mean minus the pruned one's.
    return chosen, (dense_weight - weight) @ gram.mean if stream.with_bias else None


def _prune_heads(
    lm: LoadedModel, layer: nn.Module, index: int, shape: AttentionShape, stream: _Stream
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """(kept KV groups, kept heads, o_proj's bias or None) of one block, its attention cut by OBS to ``shape``."""
    geom = lm.adapter.geometry(layer)
    o = lm.adapter.attention_projections(layer)[3]
    if shape.n_heads >= geom.n_heads:
        return list(range(geom.n_kv_heads)), list(range(geom.n_heads)), None
    (kept_kv, kept_heads), bias = _obs_update(
        o,
        layer,
        index,
        stream,
        lambda w, inv: obs_heads(w, inv, geom.n_kv_heads, geom.head_dim, shape.kv_groups, shape.heads_per_group),
    )
    slice_attention_(lm.adapter, layer, kept_kv, kept_heads)
    if bias is not None:
        stream.added.append(lm.adapter.attention_projections(layer)[3].register_forward_hook(_AddedBias(bias)))
    return kept_kv, kept_heads, bias


def _prune_channels(lm: LoadedModel, layer: nn.Module, index: int, kept: int, stream: _Stream) -> tuple[list[int], torch.Tensor | None]:
    """(kept channels, down_proj's bias or None) of one block, its MLP cut by OBS to ``kept`` channels on the inputs
    of its pruned attention."""
    width = lm.adapter.geometry(layer).intermediate_size
    if kept >= width:
        return list(range(width)), None
    kept_channels, bias = _obs_update(lm.adapter.mlp_projections(layer)[2], layer, index, stream, lambda w, inv: obs_channels(w, inv, kept))
    slice_mlp_(lm.adapter, layer, kept_channels)
    if bias is not None:
        stream.added.append(lm.adapter.mlp_projections(layer)[2].register_forward_hook(_AddedBias(bias)))
    return kept_channels, bias


def _install(
    lm: LoadedModel, result: PruneResult, biases: list[BlockFit], compensation: CompensationSettings, seconds: float, expected: int
) -> None:
    """Give each projection that lost inputs its bias for good, after the count check, and record
    them as ``compensation_pass`` does; InvariantError unless they add the ``expected`` parameters
    (``units.added_bias_params``, what the plan was charged)."""
    install_biases(lm, biases)
    bias_params = lm.param_count() - result.params_after
    if bias_params != expected:
        raise InvariantError(f"OBS's biases added {bias_params:,} parameters, the plan counts {expected:,}")
    result.params_after += bias_params
    lm.refresh_fingerprint()
    result.compensation = compensation.to_dict() | {"seconds": round(seconds, 3), "bias_params": bias_params}
    if lm.pruned_from is not None:
        lm.pruned_from["compensation"] = result.compensation
