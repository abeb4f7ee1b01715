"""What one table cell removes, how its objective is counted, and how one cell is measured.

A cell (component c, rate r) removes the units that surgery would remove at that rate,
chosen by ``surgery.layer_selection`` on importance scores computed once per table, so a
table measures exactly what surgery later cuts. Objectives are summed per window and
divided by the number of counted positions: the text tokens that have text before them
for the next-token NLL (T-1 per window of T text tokens), every text position for the KL
to the dense model (T); a leading BOS token (``data.bos.text_start``) is never counted.

Measuring a cell (``cell_per_window``) starts from a dense pass (``DenseState``: the hidden
states entering every block and the arguments each block got): the cut block computes as
pruned (``cut_applied``: its removed units masked, compensated as the spec says, and
restored afterwards), blocks ``i..L-1`` and the LM head run on the stored input, and the
objective is summed per window (``head_objectives``). The streamed builder
(``tables.streaming.streamed_cells``) turns the loops around, block by block for several
cells, and uses the same three pieces; Ray workers call one or the other.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import input_device, wide
from gap_engine.data.bos import next_token_nll
from gap_engine.model.layerwise import BlockCall, layer_output
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.slicing import zeroed_units
from gap_engine.prune.compensate import BlockInputs, applied, fit_block
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import ImportanceScores
from gap_engine.prune.surgery import removed_units
from gap_engine.tables.artefact import TableSpec
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


def distinct_cuts(cuts: list[list[Cut]]) -> tuple[list[tuple[int, int, Cut]], dict[tuple[int, int], tuple[int, int] | None]]:
    """The cells that need measuring, and where every cell reads its value.

    Returns:
        jobs: (component, rate index, cut) of the first cell of each distinct non-empty cut
            of a component; owner: cell -> the job cell whose value it takes, or None for a
            cell that removes nothing (the dense model itself).
    """
    jobs: list[tuple[int, int, Cut]] = []
    owner: dict[tuple[int, int], tuple[int, int] | None] = {}
    for c, row in enumerate(cuts):
        first: dict[Cut, int] = {}
        for r, cut in enumerate(row):
            if cut.empty:
                owner[c, r] = None
            elif cut in first:
                owner[c, r] = (c, first[cut])
            else:
                first[cut] = r
                owner[c, r] = (c, r)
                jobs.append((c, r, cut))
    return jobs, owner


# ---- one cell: its block cut (and compensated), the blocks after it, the objective --------------
# Dense next-token log-probabilities for the KL objective are kept in memory up to this
# size; above it they are recomputed from the stored final hidden states for every cell
# (one more LM-head product per cell instead of N*T*V floats held).
MAX_STORED_LOGPROB_BYTES = 2 << 30


@dataclass
class DenseState:
    """What one dense pass leaves behind for the cells (per batch, per block)."""

    batches: list[torch.Tensor]  # [b] (B, T) token ids
    block_inputs: list[list[torch.Tensor]]  # [b][i] (B, T, d) hidden states entering block i
    block_calls: list[list[BlockCall]]  # [b][i] the other positional args and kwargs block i got
    final_hidden: list[torch.Tensor]  # [b] (B, T, d) output of the last block
    dense_logprobs: list[torch.Tensor] | None  # [b] (B, T, V) for the KL objective, when stored
    dense_nll: list[torch.Tensor]  # [b] (B,) float64 dense NLL summed over each window's counted positions
    start: int = 0  # leading non-text positions of every window (1 for a BOS token), never counted

    @property
    def objective_sum(self) -> float:
        """Dense NLL summed over all positions (the dense KL is 0)."""
        return float(sum(float(part.sum()) for part in self.dense_nll))


def dense_logprobs(lm: LoadedModel, state: DenseState, b: int) -> torch.Tensor:
    device = input_device(lm.model)  # stored states may wait on the host (streamed builds)
    if state.dense_logprobs is not None:
        return state.dense_logprobs[b].to(device)
    return F.log_softmax(lm.adapter.logits_from_hidden(lm.model, state.final_hidden[b].to(device)).float(), dim=-1)


def cell_compensation(spec: TableSpec) -> CompensationSettings | None:
    """What the cells of ``spec`` are compensated with (None: nothing)."""
    return CompensationSettings(mode=spec.compensation, weighting="tokens") if spec.compensation != "none" else None


def cut_applied(
    lm: LoadedModel, layer: nn.Module, state: DenseState, cut: Cut, compensation: CompensationSettings | None, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """The cut block (``layer``, on ``device``) computing as pruned, and compensated when
    ``compensation`` is active: fitted on the block's stored dense inputs as
    ``compensation_pass`` fits it on the pruned stream (for one cut block they are the same)."""
    if compensation is None or not compensation.active:
        return zeroed_units(lm.adapter, layer, cut.heads, cut.channels)
    inputs = BlockInputs([x[cut.layer] for x in state.block_inputs], [c[cut.layer] for c in state.block_calls], device, state.start)
    fit = fit_block(lm.adapter, layer, cut.layer, inputs, cut.heads, cut.channels, compensation)
    return applied(lm.adapter, layer, cut.heads, cut.channels, fit)


def head_objectives(
    lm: LoadedModel, state: DenseState, b: int, hidden: torch.Tensor, objectives: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Objectives of batch ``b`` from ``hidden`` (B, T, d), the states leaving the last block:
    {objective: (B,) float64 sums over each window's counted positions}."""
    logits = lm.adapter.logits_from_hidden(lm.model, hidden)  # (B, T, V)
    return {
        name: objective_per_window(logits, state.batches[b], name, dense_logprobs(lm, state, b) if name == "kl" else None, state.start)
        for name in objectives
    }


def cell_per_window(
    lm: LoadedModel, state: DenseState, cut: Cut, objectives: tuple[str, ...], compensation: CompensationSettings | None = None
) -> dict[str, torch.Tensor]:
    """Objective of the model with ``cut`` applied (and compensated), per window: {objective: (N,) float64 sums}.

    Runs only blocks cut.layer..L-1 and the LM head, from the stored input of the cut block;
    the block's weights are restored when it returns.
    """
    layers = lm.adapter.layers(lm.model)
    sums: dict[str, list[torch.Tensor]] = {name: [] for name in objectives}
    with cut_applied(lm, layers[cut.layer], state, cut, compensation, input_device(lm.model)), torch.inference_mode():
        for b in range(len(state.batches)):
            hidden = state.block_inputs[b][cut.layer]  # (B, T, d)
            for j in range(cut.layer, len(layers)):
                args, kwargs = state.block_calls[b][j]
                hidden = layer_output(layers[j](hidden, *args, **kwargs))
            for name, part in head_objectives(lm, state, b, hidden, objectives).items():
                sums[name].append(part)
    return {name: torch.cat(parts) for name, parts in sums.items()}


def run_cell(lm: LoadedModel, state: DenseState, cut: Cut, objective: str, compensation: CompensationSettings | None = None) -> float:
    """Objective of the model with ``cut`` applied (and compensated), summed over all positions."""
    return float(cell_per_window(lm, state, cut, (objective,), compensation)[objective].sum())
