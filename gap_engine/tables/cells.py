"""What one table cell removes and how its objective is counted (shared by both estimators).

A cell (component c, rate r) removes the units that surgery would remove at that rate,
chosen by ``surgery.layer_selection`` on importance scores computed once per table, so a
table measures exactly what surgery later cuts. Objectives are summed per window and
divided by the number of counted positions: the text tokens that have text before them
for the next-token NLL (T-1 per window of T text tokens), every text position for the KL
to the dense model (T); a leading BOS token (``data.bos.text_start``) is never counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gap_engine.core.device import wide
from gap_engine.data.bos import next_token_nll
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.importance import ImportanceScores
from gap_engine.prune.surgery import removed_units
from gap_engine.tables.objectives import OBJECTIVES


@dataclass(frozen=True)
class Cut:
    """Units one cell removes from one block (heads and MLP channels, ascending)."""

    layer: int
    heads: tuple[int, ...]
    channels: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not self.heads and not self.channels

    @property
    def units_key(self) -> str:
        """16 hex digits of a SHA-256 over the units the cut removes: a saved cell is reused on
        resume only where the build now removes the same units (scores recomputed on resume can
        rank two near-equal units the other way)."""
        text = f"{self.layer}|{','.join(map(str, self.heads))}|{','.join(map(str, self.channels))}"
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def unit_cuts(
    lm: LoadedModel, scores: ImportanceScores, components: Sequence[tuple[int, str]], rate_grid: Sequence[float], channel_multiple: int
) -> list[list[Cut]]:
    """[component][rate] the units removed, chosen exactly as surgery chooses them."""
    layers = lm.adapter.layers(lm.model)
    out: list[list[Cut]] = []
    for layer_index, kind in components:
        row: list[Cut] = []
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
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    objective: str,
    dense_logprobs: torch.Tensor | None,
    start: int = 0,
) -> torch.Tensor:
    """Objective summed over each window's counted positions: (B,) float64 (float32 on MPS).

    nll: next-token cross entropy of the targets at positions start+1..T-1 (T-1-start per
    window). kl: KL(dense || pruned) of the next-token distributions at positions
    start..T-1 (T-start per window); ``dense_logprobs`` is (B, T, V), all positions. ``start`` is the number of leading non-text positions
    (``data.bos.text_start``: 1 for a BOS token), so the BOS position and the prediction made
    from BOS alone are never counted and both window conventions score the same text.
    Logits of a bf16/fp16 model are taken to float32 first, whatever the model's dtype.
    """
    per_window: torch.Tensor = OBJECTIVES.function(objective)(
        logits.float(), input_ids, dense_logprobs, start
    )  # .float(): no copy when they already are
    return per_window


def nll_per_window(logits: torch.Tensor, input_ids: torch.Tensor, dense_logprobs: torch.Tensor | None, start: int) -> torch.Tensor:
    """The ``nll`` objective per window, (B,) (``dense_logprobs`` is not read)."""
    return wide(next_token_nll(logits, input_ids, start)).sum(1)


def kl_per_window(logits: torch.Tensor, input_ids: torch.Tensor, dense_logprobs: torch.Tensor | None, start: int) -> torch.Tensor:
    """The ``kl`` objective per window, (B,): KL(dense || pruned) against (B, T, V) ``dense_logprobs``."""
    if dense_logprobs is None:
        raise ValueError("the kl objective needs the dense model's log-probabilities")
    logq = F.log_softmax(logits[:, start:], dim=-1)  # (B, T-start, V)
    per_token = F.kl_div(logq, dense_logprobs[:, start:], log_target=True, reduction="none").sum(-1)  # (B, T-start)
    return wide(per_token).sum(1)


def objective_sum(
    logits: torch.Tensor, input_ids: torch.Tensor, objective: str, dense_logprobs: torch.Tensor | None, start: int = 0
) -> float:
    """Objective summed over all counted positions of a batch (see objective_per_window)."""
    return float(objective_per_window(logits, input_ids, objective, dense_logprobs, start).sum())


def objective_positions(windows: torch.Tensor, objective: str, start: int = 0) -> int:
    """Positions an objective averages over: N*(T-1-start) for nll, N*(T-start) for kl."""
    n, t = windows.shape
    return n * (t - 1 - start) if objective == "nll" else n * (t - start)
