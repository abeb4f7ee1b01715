"""Within-layer importance of prunable units: attention heads and MLP channels.

GAP decides *how much* to prune per layer; which heads and channels go inside a layer is
decided here, by one of four criteria computed on the calibration windows:

- ``magnitude``: L1 norm of the unit's weights (no data needed).
- ``wanda``: |W| times the L2 norm of the input activation it multiplies (Wanda, Sun et al.
  2023), taken on the pruned input dimension of ``o_proj`` / ``down_proj``.
- ``flap``: FLAP's fluctuation metric (An et al., AAAI 2024): the input feature's variance
  over tokens times its column's squared norm; a head scores the sum of its columns' metric
  *squared*, as FLAP squares the attention metric before it ranks heads.
- ``taylor``: first-order Taylor estimate |sum(W * dL/dW)| over the unit's weights
  (LLM-Pruner, Ma et al. 2023), from one backward pass per batch.

A head's score also counts the query rows of q_proj; a KV group scores as the sum of its
query heads (surgery keeps or drops groups by that sum). `flap_standardised` gives FLAP's
structure search its scores: the metric standardised within each layer, comparable across layers.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gap_engine.core.config import DEFAULT_CRITERION
from gap_engine.core.device import cpu_float64, input_device, is_streamed, wide
from gap_engine.core.errors import GapError
from gap_engine.core.progress import NO_HOOKS, Hooks, reporting, steps
from gap_engine.data.bos import next_token_nll, text_start
from gap_engine.data.windows import batches
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.layerwise import backward_blocks, forward_blocks
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA, is_sequential, reads_windows

log = logging.getLogger(__name__)


@dataclass
class LayerScores:
    """Importance of every unit of one block (higher = keep)."""

    head: torch.Tensor  # (n_heads,) float64
    channel: torch.Tensor  # (intermediate_size,) float64


@dataclass
class ImportanceScores:
    criterion: str
    layers: list[LayerScores]


class InputStats:
    """Running sum and sum of squares of a linear layer's input, per input feature (float64, on the host).

    The first ``skip`` positions of every window are left out: a BOS token's activations
    are huge outliers (an attention sink) that say nothing about the text.
    """

    def __init__(self, width: int, skip: int = 0) -> None:
        self.total = torch.zeros(width, dtype=torch.float64)
        self.total_sq = torch.zeros(width, dtype=torch.float64)
        self.count = 0
        self.skip = skip

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()[:, self.skip :]  # (B, T-skip, width)
        x = wide(x.reshape(-1, x.shape[-1]))  # (B*(T-skip), width), on its device
        self.total += x.sum(0).cpu()
        self.total_sq += (x * x).sum(0).cpu()
        self.count += x.shape[0]

    def l2(self) -> torch.Tensor:
        return self.total_sq.sqrt()

    def variance(self) -> torch.Tensor:
        mean = self.total / max(self.count, 1)
        return (self.total_sq / max(self.count, 1) - mean * mean).clamp_min(0.0)


def _per_head(column_scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    return column_scores.reshape(-1, head_dim).sum(-1)  # (n_heads,)


def _magnitude(lm: LoadedModel) -> list[LayerScores]:
    out = []
    for layer in lm.adapter.layers(lm.model):
        geom = lm.adapter.geometry(layer)
        q, _, _, o = lm.adapter.attention_projections(layer)
        gate, up, down = lm.adapter.mlp_projections(layer)
        q_rows = cpu_float64(wide(q.weight.detach().abs()).sum(1))  # (H*D,)
        o_cols = cpu_float64(wide(o.weight.detach().abs()).sum(0))  # (H*D,)
        head = _per_head(q_rows + o_cols, geom.head_dim)
        channel = cpu_float64(
            wide(gate.weight.detach().abs()).sum(1) + wide(up.weight.detach().abs()).sum(1) + wide(down.weight.detach().abs()).sum(0)
        )
        out.append(LayerScores(head=head, channel=channel))
    return out


def input_statistics(
    lm: LoadedModel,
    windows: torch.Tensor,
    linears: dict[Hashable, nn.Linear],
    batch_size: int = 4,
) -> dict[Hashable, InputStats]:
    """Per-feature statistics of the inputs of the given linear layers over the windows.

    Args:
        lm: the model (run forward only; hooks are removed afterwards).
        windows: (N, T) token ids.
        linears: key -> a linear layer of ``lm.model``.
        batch_size: windows per forward pass (the active stage is told batches done, blocks
            when streamed, and its cancel polled before each: ``core.progress.steps``).
    Returns:
        key -> InputStats of that layer's input.
    """
    lm.refuse_shared("activation statistics")  # the linears are its own: hooks on them would see other threads' inputs
    skip = text_start(lm.tokenizer, windows)
    stats = {key: InputStats(linear.in_features, skip) for key, linear in linears.items()}
    handles = [linear.register_forward_pre_hook(stats[key]) for key, linear in linears.items()]
    parts = batches(windows, batch_size)
    try:
        with torch.no_grad():
            if is_streamed(lm):  # the hooks fire as each block visits the device
                forward_blocks(lm, windows, batch_size)
            else:
                for batch in steps(parts, "activation statistics", "batches"):
                    lm.model(input_ids=batch.to(input_device(lm.model)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


def _output_inputs(lm: LoadedModel) -> dict[Hashable, nn.Linear]:
    """(layer, "o" | "down") -> the projection whose input columns are the block's units."""
    linears: dict[Hashable, nn.Linear] = {}
    for i, layer in enumerate(lm.adapter.layers(lm.model)):
        linears[i, "o"] = lm.adapter.attention_projections(layer)[3]
        linears[i, "down"] = lm.adapter.mlp_projections(layer)[2]
    return linears


def _fluctuation(stats: InputStats, linear: nn.Linear) -> torch.Tensor:
    """FLAP's per-column metric: the input's variance times the column's squared norm, (in,) float64."""
    return stats.variance() * cpu_float64(wide(linear.weight.detach()).pow(2).sum(0))


def _activation_scores(lm: LoadedModel, windows: torch.Tensor, criterion: str, batch_size: int) -> list[LayerScores]:
    linears = _output_inputs(lm)
    stats = input_statistics(lm, windows, linears, batch_size)
    out: list[LayerScores] = []
    for i, layer in enumerate(lm.adapter.layers(lm.model)):
        head_dim = lm.adapter.geometry(layer).head_dim
        o, down = linears[i, "o"], linears[i, "down"]
        if criterion == "wanda":
            o_cols = cpu_float64(wide(o.weight.detach().abs()).sum(0)) * stats[i, "o"].l2()
            head = _per_head(o_cols, head_dim)
            channel = cpu_float64(wide(down.weight.detach().abs()).sum(0)) * stats[i, "down"].l2()
        else:  # flap: FLAP squares the attention metric before it ranks heads
            head = _per_head(_fluctuation(stats[i, "o"], o).pow(2), head_dim)
            channel = _fluctuation(stats[i, "down"], down)
        out.append(LayerScores(head=head, channel=channel))
    return out


def _standardise(values: torch.Tensor) -> torch.Tensor:
    """(values - mean) / std within one layer (std with Bessel's correction, as FLAP's torch.std)."""
    std = values.std()
    return (values - values.mean()) / (std if std > 0 else 1.0)


def flap_standardised(lm: LoadedModel, windows: torch.Tensor, batch_size: int = 4) -> list[LayerScores]:
    """FLAP's standardised unit scores, comparable across layers (its adaptive structure search).

    Per layer, the attention metric (squared, per o_proj input column) is standardised over
    all the layer's columns and a head scores the mean of its columns; the MLP metric is
    standardised over the layer's channels. A globally lower score is pruned first.

    Args:
        lm: the dense model (run forward once).
        windows: (N, T) calibration token ids.
    Returns:
        One LayerScores per block: head (n_heads,) and channel (intermediate_size,) z-scores, float64.
    """
    linears = _output_inputs(lm)
    stats = input_statistics(lm, windows, linears, batch_size)
    out: list[LayerScores] = []
    for i, layer in enumerate(lm.adapter.layers(lm.model)):
        head_dim = lm.adapter.geometry(layer).head_dim
        columns = _standardise(_fluctuation(stats[i, "o"], linears[i, "o"]).pow(2))  # (H*D,)
        channel = _standardise(_fluctuation(stats[i, "down"], linears[i, "down"]))  # (I,)
        out.append(LayerScores(head=columns.reshape(-1, head_dim).mean(-1), channel=channel))
    return out


def magnitude_scores(lm: LoadedModel, windows: torch.Tensor | None, batch_size: int) -> list[LayerScores]:
    """``magnitude``: weight magnitudes alone (``windows`` are not read)."""
    return _magnitude(lm)


def wanda_scores(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> list[LayerScores]:
    """``wanda``: weight magnitude times the input's L2 norm, per head and channel."""
    return _activation_scores(lm, windows, "wanda", batch_size)


def flap_scores(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> list[LayerScores]:
    """``flap``: the input's fluctuation times the squared column norm (heads: the sum of its square)."""
    return _activation_scores(lm, windows, "flap", batch_size)


def taylor_scores(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> list[LayerScores]:
    """``taylor``: vector-wise first-order saliency from the calibration loss's gradient."""
    return _taylor(lm, windows, batch_size)


def _taylor_weights(layer: nn.Module, adapter: ArchitectureAdapter) -> list[torch.Tensor]:
    """The weights whose W * grad score a block's units: q, o, gate, up, down."""
    q, _, _, o = adapter.attention_projections(layer)
    gate, up, down = adapter.mlp_projections(layer)
    return [q.weight, o.weight, gate.weight, up.weight, down.weight]


def _taylor(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> list[LayerScores]:
    layers = list(lm.adapter.layers(lm.model))
    weights = [_taylor_weights(layer, lm.adapter) for layer in layers]
    params = [w for group in weights for w in group]
    # accumulated W * grad per block, widened (on the weights' device when resident)
    saliency = [[wide(torch.zeros_like(w)) for w in group] for group in weights]
    for w in params:
        w.requires_grad_(True)
    start = text_start(lm.tokenizer, windows)
    try:
        if is_streamed(lm):
            _taylor_streamed(lm, windows, batch_size, start, saliency)
        else:
            accumulators = [acc for group in saliency for acc in group]  # in the order of params
            for batch in steps(batches(windows, batch_size), "taylor importance scores", "batches"):
                batch = batch.to(input_device(lm.model))
                loss = _taylor_loss(lm.model(input_ids=batch, use_cache=False).logits, batch, start)
                grads = torch.autograd.grad(loss, params)
                for acc, w, g in zip(accumulators, params, grads):
                    acc += wide(w.detach() * g)
    finally:
        for w in params:
            w.requires_grad_(False)
    out: list[LayerScores] = []
    for li, layer in enumerate(layers):
        geom = lm.adapter.geometry(layer)
        s_q, s_o, s_gate, s_up, s_down = saliency[li]
        # Vector-wise Taylor: a unit's removal changes the loss by about -sum(W * g) over its weights.
        head_rows = s_q.sum(1).reshape(-1, geom.head_dim).sum(-1)
        head_cols = s_o.sum(0).reshape(-1, geom.head_dim).sum(-1)
        head = cpu_float64((head_rows + head_cols).abs())
        channel = cpu_float64((s_gate.sum(1) + s_up.sum(1) + s_down.sum(0)).abs())
        out.append(LayerScores(head=head, channel=channel))
    return out


def _taylor_loss(logits: torch.Tensor, batch: torch.Tensor, start: int) -> torch.Tensor:
    """The batch's mean NLL over its counted next tokens (what the model's own ``labels=``
    loss computes when BOS and the prediction from BOS alone are masked)."""
    return next_token_nll(logits.float(), batch, start).mean()


def _taylor_streamed(lm: LoadedModel, windows: torch.Tensor, batch_size: int, start: int, saliency: list[list[torch.Tensor]]) -> None:
    """W * grad accumulated block by block (``layerwise.backward_blocks``), on the host."""
    on_device: dict[int, list[torch.Tensor]] = {}

    def leaves(i: int, layer: nn.Module, b: int, n: int) -> list[torch.Tensor]:
        on_device[i] = _taylor_weights(layer, lm.adapter)  # the block's device copies (requires_grad kept)
        return on_device[i]

    def collect(stream: int, i: int, b: int, grads: Sequence[torch.Tensor]) -> None:
        for acc, w, g in zip(saliency[i], on_device[i], grads):
            acc += wide(w.detach() * g).to(acc.device)

    backward_blocks(lm, windows, batch_size, lambda b, batch, logits: [_taylor_loss(logits, batch, start)], leaves, collect)


def compute_importance(
    lm: LoadedModel,
    windows: torch.Tensor | None,
    criterion: str = DEFAULT_CRITERION,
    batch_size: int = 4,
    hooks: Hooks = NO_HOOKS,
) -> ImportanceScores:
    """Score every head and MLP channel of every block.

    Args:
        lm: the dense model (a ``shared`` one is copied before it is run).
        windows: (N, T) calibration token ids; unused by ``magnitude``.
        criterion: one of SCORING_CRITERIA (``prune.criteria``; a sequential one raises GapError).
        batch_size: windows per forward pass.
        hooks: the stage the scores are part of: progress told (batches done, batches total,
            None); cancel polled before every batch (CancelledError when set).
    Returns:
        ImportanceScores with one LayerScores per block.
    """
    CRITERIA.check(criterion)
    if is_sequential(criterion):
        raise GapError(f"criterion '{criterion}' chooses units while pruning, block by block; it has no scores of the dense model")
    if windows is None and reads_windows(criterion):
        raise GapError(f"criterion '{criterion}' needs calibration windows")
    if reads_windows(criterion):
        lm = lm.private()  # the criteria hook the model or take its gradients: never one that other threads run
    with reporting(hooks):
        return ImportanceScores(criterion=criterion, layers=SCORING_CRITERIA.function(criterion)(lm, windows, batch_size))
