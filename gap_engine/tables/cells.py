"""What one table cell removes and how its objective is counted (shared by both estimators).

A cell (component c, rate r) removes the units that surgery would remove at that rate,
chosen by ``surgery.layer_selection`` on importance scores computed once per table, so a
table measures exactly what surgery later cuts. Objectives are summed per window and
divided by the number of predicted positions: T-1 per window for the next-token NLL, T for
the KL to the dense model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..importance import ImportanceScores
from ..surgery import removed_units


@dataclass(frozen=True)
class Cut:
    """Units one cell removes from one block (heads and MLP channels, ascending)."""

    layer: int
    heads: tuple[int, ...]
    channels: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not self.heads and not self.channels


def unit_cuts(lm, scores: ImportanceScores, components, rate_grid, channel_multiple) -> list[list[Cut]]:
    """[component][rate] the units removed, chosen exactly as surgery chooses them."""
    layers = lm.adapter.layers(lm.model)
    out = []
    for layer_index, kind in components:
        row = []
        for rate in rate_grid:
            heads, channels = removed_units(
                lm.adapter,
                layers[layer_index],
                scores.layers[layer_index],
                rate if kind in ("attn", "block") else 0.0,
                rate if kind in ("mlp", "block") else 0.0,
                channel_multiple,
            )
            row.append(Cut(layer_index, heads, channels))
        out.append(row)
    return out


def objective_per_window(
    logits: torch.Tensor, input_ids: torch.Tensor, objective: str, dense_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """Objective summed over each window's positions: (B,) float64.

    nll: next-token cross entropy over the T-1 predicted positions of each window.
    kl: KL(dense || pruned) of the next-token distributions at all T positions.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    if objective == "nll":
        per_token = F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1), reduction="none"
        )  # (B*(T-1),)
        return per_token.view(batch, -1).double().sum(1)
    logq = F.log_softmax(logits, dim=-1)  # (B, T, V)
    per_token = F.kl_div(logq, dense_logprobs, log_target=True, reduction="none").sum(-1)  # (B, T)
    return per_token.double().sum(1)


def objective_sum(logits: torch.Tensor, input_ids: torch.Tensor, objective: str, dense_logprobs) -> float:
    """Objective summed over all positions of a batch (see objective_per_window)."""
    return float(objective_per_window(logits, input_ids, objective, dense_logprobs).sum())


def objective_positions(windows: torch.Tensor, objective: str) -> int:
    """Positions an objective averages over: N*(T-1) for nll, N*T for kl."""
    n, t = windows.shape
    return n * (t - 1) if objective == "nll" else n * t
