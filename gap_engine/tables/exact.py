"""Exact loss tables: every cell measured on the calibration windows.

A dense pass over the calibration windows stores, for every block, the hidden states
entering it and the positional arguments it received (rotary embeddings, attention masks:
Gemma 3 alternates sliding and full attention, so each block keeps its own). A cell for
block ``i`` then runs only blocks ``i..L-1`` and the LM head on the stored input, with the
removed units masked (``slicing.zeroed_units``: zeroing the removed heads' input columns
of ``o_proj`` and the removed channels' columns of ``down_proj`` gives the same output as
slicing them away; the weights are restored exactly). Rates that round to the same kept
units are measured once, and every cell sees the same windows, so differences between
cells are paired. Measured cells are saved as the build goes (``PartialStore``), so a
cancelled or killed build resumes. The cells are measured through ``ledger.CellLedger``, as
every other way of measuring them does.

The build masks the model's own weights cell by cell, so the same model must not be used
from another thread meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import input_device
from gap_engine.core.progress import NO_HOOKS, EtaClock, Hooks
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches
from gap_engine.model.layerwise import BlockCall
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.slicing import zeroed_units
from gap_engine.prune.compensate import BlockInputs, applied, fit_block
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, removed_table, table_components
from gap_engine.tables.cells import Cut, objective_per_window, objective_positions, unit_cuts
from gap_engine.tables.ledger import CellLedger, CellRequest, CellValues

log = logging.getLogger(__name__)

# Dense next-token log-probabilities for the KL objective are kept in memory up to this
# size; above it they are recomputed from the stored final hidden states for every cell
# (one more LM-head product per cell instead of N*T*V floats held).
MAX_STORED_LOGPROB_BYTES = 2 << 30


# ---- the dense pass ------------------------------------------------------------------------
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


def _layer_output(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def dense_pass(lm: LoadedModel, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...]) -> DenseState:
    model, adapter = lm.model, lm.adapter
    layers = list(adapter.layers(model))
    parts = [batch.to(input_device(model)) for batch in batches(windows, batch_size)]
    state = DenseState(parts, [], [], [], None, [], text_start(lm.tokenizer, windows))
    vocab = cast(nn.Linear, adapter.lm_head(model)).out_features
    store_logprobs = "kl" in objectives and windows.numel() * vocab * 4 <= MAX_STORED_LOGPROB_BYTES
    logprobs: list[torch.Tensor] = []
    if store_logprobs:
        state.dense_logprobs = logprobs
    current: dict[str, Any] = {}  # this batch's captures: inputs, calls (per block) and the final hidden states

    def capture(index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            current["inputs"][index] = hidden
            current["calls"][index] = (tuple(args[1:]), kwargs)

        return hook

    def capture_last(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> None:
        current["final"] = _layer_output(output)

    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(capture_last, with_kwargs=True))
    try:
        with torch.inference_mode():
            for batch in parts:
                current.update(inputs=[None] * len(layers), calls=[None] * len(layers), final=None)
                adapter.decoder(model)(input_ids=batch, use_cache=False)
                state.block_inputs.append(current["inputs"])
                state.block_calls.append(current["calls"])
                state.final_hidden.append(current["final"])
                logits = adapter.logits_from_hidden(model, current["final"]).float()  # (B, T, V)
                if store_logprobs:
                    logprobs.append(F.log_softmax(logits, dim=-1))
                state.dense_nll.append(objective_per_window(logits, batch, "nll", None, state.start))
    finally:
        for handle in handles:
            handle.remove()
    return state


def dense_logprobs(lm: LoadedModel, state: DenseState, b: int) -> torch.Tensor:
    device = input_device(lm.model)  # stored states may wait on the host (streamed builds)
    if state.dense_logprobs is not None:
        return state.dense_logprobs[b].to(device)
    return F.log_softmax(lm.adapter.logits_from_hidden(lm.model, state.final_hidden[b].to(device)).float(), dim=-1)


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


def cell_per_window(
    lm: LoadedModel, state: DenseState, cut: Cut, objectives: tuple[str, ...], compensation: CompensationSettings | None = None
) -> dict[str, torch.Tensor]:
    """Objective of the model with ``cut`` applied (and compensated), per window: {objective: (N,) float64 sums}.

    Runs only blocks cut.layer..L-1 and the LM head, from the stored input of the cut block.
    """
    layers = lm.adapter.layers(lm.model)
    sums: dict[str, list[torch.Tensor]] = {name: [] for name in objectives}
    with cut_applied(lm, layers[cut.layer], state, cut, compensation, input_device(lm.model)), torch.inference_mode():
        for b, batch in enumerate(state.batches):
            hidden = state.block_inputs[b][cut.layer]  # (B, T, d)
            for j in range(cut.layer, len(layers)):
                args, kwargs = state.block_calls[b][j]
                hidden = _layer_output(layers[j](hidden, *args, **kwargs))
            logits = lm.adapter.logits_from_hidden(lm.model, hidden)  # (B, T, V)
            for name in objectives:
                dense = dense_logprobs(lm, state, b) if name == "kl" else None
                sums[name].append(objective_per_window(logits, batch, name, dense, state.start))
    return {name: torch.cat(parts) for name, parts in sums.items()}


def run_cell(lm: LoadedModel, state: DenseState, cut: Cut, objective: str, compensation: CompensationSettings | None = None) -> float:
    """Objective of the model with ``cut`` applied (and compensated), summed over all positions."""
    return float(cell_per_window(lm, state, cut, (objective,), compensation)[objective].sum())


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


def measure_ledger(
    lm: LoadedModel, state: DenseState, ledger: CellLedger, objective: str, positions: int, compensation: CompensationSettings | None = None
) -> None:
    """Measure the cells ``ledger`` still lacks, one at a time (each cut block compensated when
    ``compensation`` is active), each divided by ``positions`` (its objective per counted
    position); the ledger saves and reports them, and what is measured is saved when the loop
    ends or is cancelled (``ledger.hooks``' cancel polled before every cell)."""
    try:
        for k in ledger.missing():
            ledger.hooks.check_cancelled(f"loss table build cancelled after {ledger.done_message()}")
            ledger.record(k, run_cell(lm, state, ledger.jobs[k][2], objective, compensation) / positions)
    finally:
        ledger.flush()


def measure_exact(request: CellRequest) -> CellValues:
    """The resident cell filler (``ledger.CellFiller``): a dense pass, then every distinct cell
    in turn. ``request.hooks`` gets progress over cells, first as the dense pass ends."""
    lm, spec, windows, hooks = request.lm, request.spec, request.windows, request.hooks
    jobs, owner = distinct_cuts(unit_cuts(lm, request.scores, request.components, spec.rate_grid, spec.channel_multiple))
    state = dense_pass(lm, windows, spec.windows.batch_size, (spec.objective,))
    positions = objective_positions(windows, spec.objective, state.start)
    dense_objective = state.objective_sum / positions if spec.objective == "nll" else 0.0
    ledger = CellLedger(lm, jobs, request.partial, hooks)
    measure_ledger(lm, state, ledger, spec.objective, positions, cell_compensation(spec))
    objective, stats = ledger.table(owner, (len(request.components), len(spec.rate_grid)), dense_objective)
    return CellValues(objective, dense_objective, stats)


def cell_compensation(spec: TableSpec) -> CompensationSettings | None:
    """What the cells of ``spec`` are compensated with (None: nothing)."""
    return CompensationSettings(mode=spec.compensation) if spec.compensation != "none" else None


# ---- per-window measurements (noise studies) ------------------------------------------------------
@dataclass
class WindowCells:
    """Exact cell values per calibration window, for both objectives at once.

    Averaging the last axis over any subset of windows gives the table those windows would
    measure, so one build answers how much two disjoint sets of windows disagree.
    """

    components: list[tuple[int, str]]  # (layer, kind) per row
    rate_grid: np.ndarray  # (R,)
    removed: np.ndarray  # (C, R) int64 parameters removed
    distinct: np.ndarray  # (C, R) bool: the cell removes something and is the first with its cut
    nll: np.ndarray  # (C, R, N) per-window mean NLL increase over dense
    kl: np.ndarray  # (C, R, N) per-window mean KL(dense || pruned)
    dense_nll: np.ndarray  # (N,) per-window mean dense NLL


def window_cells(lm: LoadedModel, spec: TableSpec, windows: torch.Tensor, hooks: Hooks = NO_HOOKS) -> WindowCells:
    """Measure every distinct cell of an exact table per window, NLL and KL together.

    Args:
        lm, spec: as for ``measure_table`` (spec.objective and spec.estimator are ignored).
        windows: (N, T) token ids.
        hooks: progress over distinct cells (nothing is polled for a cancel).
    Returns:
        WindowCells; cells sharing a cut share values, as in the table.
    """
    spec.validate()
    components = table_components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.windows.batch_size)
    jobs, owner = distinct_cuts(unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple))
    state = dense_pass(lm, windows, spec.windows.batch_size, ("nll", "kl"))
    n = windows.shape[0]
    nll_positions = objective_positions(windows, "nll", state.start) // n  # per window
    kl_positions = objective_positions(windows, "kl", state.start) // n
    dense_nll = torch.cat(state.dense_nll).cpu().numpy() / nll_positions  # (N,)
    nll = np.zeros((len(components), len(spec.rate_grid), n))
    kl = np.zeros_like(nll)
    distinct = np.zeros((len(components), len(spec.rate_grid)), dtype=bool)
    clock = EtaClock(total_steps=len(jobs))
    for k, (c, r, cut) in enumerate(jobs):
        sums = cell_per_window(lm, state, cut, ("nll", "kl"), cell_compensation(spec))
        distinct[c, r] = True
        for cell, source in owner.items():
            if source == (c, r):
                nll[cell] = sums["nll"].cpu().numpy() / nll_positions - dense_nll
                kl[cell] = sums["kl"].cpu().numpy() / kl_positions
        hooks.report(k + 1, len(jobs), clock.step())
    removed, _ = removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    return WindowCells(components, np.asarray(spec.rate_grid), removed, distinct, nll, kl, dense_nll)
