"""Within-layer importance of prunable units: attention heads and MLP channels.

GAP decides *how much* to prune per layer; which heads and channels go inside a layer is
decided here, by one of four criteria computed on the calibration windows:

- ``magnitude``: L1 norm of the unit's weights (no data needed).
- ``wanda``: |W| times the L2 norm of the input activation it multiplies (Wanda, Sun et al.
  2023), taken on the pruned input dimension of ``o_proj`` / ``down_proj``.
- ``flap``: activation fluctuation (variance over tokens) times the squared column norm
  (FLAP, An et al. 2024).
- ``taylor``: first-order Taylor estimate |sum(W * dL/dW)| over the unit's weights
  (LLM-Pruner, Ma et al. 2023), from one backward pass per batch.

A head's score also counts the query rows of q_proj; a KV group scores as the sum of its
query heads (surgery keeps or drops groups by that sum).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import GapError
from .models import LoadedModel

log = logging.getLogger(__name__)

CRITERIA = ("magnitude", "wanda", "flap", "taylor")
DEFAULT_CRITERION = "wanda"


@dataclass
class LayerScores:
    """Importance of every unit of one block (higher = keep)."""

    head: torch.Tensor  # (n_heads,) float64
    channel: torch.Tensor  # (intermediate_size,) float64


@dataclass
class ImportanceScores:
    criterion: str
    layers: list[LayerScores]


class _InputStats:
    """Running sum and sum of squares of a linear layer's input, per input feature."""

    def __init__(self, width: int):
        self.total = torch.zeros(width, dtype=torch.float64)
        self.total_sq = torch.zeros(width, dtype=torch.float64)
        self.count = 0

    def __call__(self, module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)  # (B*T, width)
        self.total += x.sum(0)
        self.total_sq += (x * x).sum(0)
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
        q_rows = q.weight.detach().abs().double().sum(1)  # (H*D,)
        o_cols = o.weight.detach().abs().double().sum(0)  # (H*D,)
        head = _per_head(q_rows + o_cols, geom.head_dim)
        channel = (
            gate.weight.detach().abs().double().sum(1)
            + up.weight.detach().abs().double().sum(1)
            + down.weight.detach().abs().double().sum(0)
        )
        out.append(LayerScores(head=head, channel=channel))
    return out


def _batches(windows: torch.Tensor, batch_size: int):
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start : start + batch_size]


def _activation_scores(lm, windows, criterion, batch_size, progress) -> list[LayerScores]:
    layers = list(lm.adapter.layers(lm.model))
    o_stats, down_stats, handles = [], [], []
    for layer in layers:
        _, _, _, o = lm.adapter.attention_projections(layer)
        _, _, down = lm.adapter.mlp_projections(layer)
        o_stats.append(_InputStats(o.in_features))
        down_stats.append(_InputStats(down.in_features))
        handles.append(o.register_forward_pre_hook(o_stats[-1]))
        handles.append(down.register_forward_pre_hook(down_stats[-1]))
    n_batches = -(-windows.shape[0] // batch_size)
    try:
        with torch.no_grad():
            for i, batch in enumerate(_batches(windows, batch_size)):
                lm.model(input_ids=batch, use_cache=False)
                if progress:
                    progress(i + 1, n_batches)
    finally:
        for h in handles:
            h.remove()
    out = []
    for layer, o_in, down_in in zip(layers, o_stats, down_stats):
        geom = lm.adapter.geometry(layer)
        _, _, _, o = lm.adapter.attention_projections(layer)
        _, _, down = lm.adapter.mlp_projections(layer)
        if criterion == "wanda":
            o_cols = o.weight.detach().abs().double().sum(0) * o_in.l2()
            d_cols = down.weight.detach().abs().double().sum(0) * down_in.l2()
        else:  # flap: fluctuation of the input times the squared column norm
            o_cols = o_in.variance() * o.weight.detach().double().pow(2).sum(0)
            d_cols = down_in.variance() * down.weight.detach().double().pow(2).sum(0)
        out.append(LayerScores(head=_per_head(o_cols, geom.head_dim), channel=d_cols))
    return out


def _taylor(lm, windows, batch_size, progress) -> list[LayerScores]:
    layers = list(lm.adapter.layers(lm.model))
    weights = []
    for layer in layers:
        q, _, _, o = lm.adapter.attention_projections(layer)
        gate, up, down = lm.adapter.mlp_projections(layer)
        weights.append((q.weight, o.weight, gate.weight, up.weight, down.weight))
    params = [w for group in weights for w in group]
    saliency = [torch.zeros_like(w, dtype=torch.float64) for w in params]  # accumulated W * grad
    for w in params:
        w.requires_grad_(True)
    n_batches = -(-windows.shape[0] // batch_size)
    try:
        for i, batch in enumerate(_batches(windows, batch_size)):
            loss = lm.model(input_ids=batch, labels=batch, use_cache=False).loss
            grads = torch.autograd.grad(loss, params)
            for acc, w, g in zip(saliency, params, grads):
                acc += (w.detach() * g).double()
            if progress:
                progress(i + 1, n_batches)
    finally:
        for w in params:
            w.requires_grad_(False)
    out = []
    for li, layer in enumerate(layers):
        geom = lm.adapter.geometry(layer)
        s_q, s_o, s_gate, s_up, s_down = saliency[5 * li : 5 * li + 5]
        # Vector-wise Taylor: a unit's removal changes the loss by about -sum(W * g) over its weights.
        head_rows = s_q.sum(1).reshape(-1, geom.head_dim).sum(-1)
        head_cols = s_o.sum(0).reshape(-1, geom.head_dim).sum(-1)
        head = (head_rows + head_cols).abs()
        channel = (s_gate.sum(1) + s_up.sum(1) + s_down.sum(0)).abs()
        out.append(LayerScores(head=head, channel=channel))
    return out


def compute_importance(
    lm: LoadedModel,
    windows: torch.Tensor | None,
    criterion: str = DEFAULT_CRITERION,
    batch_size: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> ImportanceScores:
    """Score every head and MLP channel of every block.

    Args:
        lm: the dense model.
        windows: (N, T) calibration token ids; unused by ``magnitude``.
        criterion: one of CRITERIA.
        batch_size: windows per forward pass.
        progress: called with (batches done, batches total).
    Returns:
        ImportanceScores with one LayerScores per block.
    """
    if criterion not in CRITERIA:
        raise GapError(f"unknown criterion '{criterion}'; choose one of {', '.join(CRITERIA)}")
    if criterion == "magnitude":
        layers = _magnitude(lm)
    elif windows is None:
        raise GapError(f"criterion '{criterion}' needs calibration windows")
    elif criterion == "taylor":
        layers = _taylor(lm, windows, batch_size, progress)
    else:
        layers = _activation_scores(lm, windows, criterion, batch_size, progress)
    return ImportanceScores(criterion=criterion, layers=layers)
