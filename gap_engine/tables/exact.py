"""Exact loss tables: every cell measured on the calibration windows (the ``exact`` estimator).

A dense pass over the calibration windows stores, for every block, the hidden states
entering it and the positional arguments it received (rotary embeddings, attention masks:
Gemma 3 alternates sliding and full attention, so each block keeps its own). A cell for
block ``i`` then runs only blocks ``i..L-1`` and the LM head on the stored input, with the
removed units masked (``slicing.zeroed_units``: zeroing the removed heads' input columns
of ``o_proj`` and the removed channels' columns of ``down_proj`` gives the same output as
slicing them away; the weights are restored exactly): ``cells.cell_per_window``. Rates that
round to the same kept units are measured once, and every cell sees the same windows, so
differences between cells are paired.

``exact_cells`` is what every way of measuring shares: the cuts, the dense pass and the cells
as two stages, a ``ledger.CellLedger`` (measured cells saved as the build goes, so a cancelled or killed
build resumes), the table; a schedule measures the cells the ledger lacks. In this process
(``measure_exact``) a resident model's cells go one at a time, a streamed model's in groups
that share each block's visit to the device (``tables.streaming``); Ray workers
(``tables.distributed.RayCells``) take layers each.

The build masks the model's own weights cell by cell, so the same model must not be used
from another thread meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import input_device, is_streamed
from gap_engine.core.progress import CELLS, DENSE_PASS, Hooks, active, reporting, steps
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches
from gap_engine.model.layerwise import layer_output
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, removed_table, table_components

# The dense passes' limit on stored log-probabilities is read here by the cost model too.
from gap_engine.tables.cells import MAX_STORED_LOGPROB_BYTES as MAX_STORED_LOGPROB_BYTES
from gap_engine.tables.cells import (
    DenseState,
    cell_compensation,
    cell_per_window,
    distinct_cuts,
    objective_per_window,
    objective_positions,
    run_cell,
    unit_cuts,
)
from gap_engine.tables.ledger import BuildStats, CellLedger, CellObjectives, CellRequest
from gap_engine.tables.streaming import group_size, measure_ledger_streamed, streamed_dense_state

log = logging.getLogger(__name__)

# Measures the cells a ledger still lacks, given the dense state, the ledger and the positions
# the objective is divided by; returns the build statistics it adds (e.g. the Ray workers used).
CellSchedule = Callable[[DenseState, CellLedger, int], BuildStats]


# ---- the dense pass ------------------------------------------------------------------------
def dense_pass(lm: LoadedModel, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...]) -> DenseState:
    """The dense pass of a model resident on its device: every block's inputs and arguments captured
    by forward pre-hooks, its states left on the device."""
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
        current["final"] = layer_output(output)

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


def dense_state(lm: LoadedModel, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...]) -> DenseState:
    """The dense pass as the model is placed: block by block, its states on the host, for a
    streamed model (the active stage's cancel polled before every block); else resident."""
    if is_streamed(lm):
        return streamed_dense_state(lm, windows, batch_size, objectives)
    return dense_pass(lm, windows, batch_size, objectives)


# ---- the cells -----------------------------------------------------------------------------
def measure_ledger(
    lm: LoadedModel,
    state: DenseState,
    ledger: CellLedger,
    objective: str,
    positions: int,
    compensation: CompensationSettings | None = None,
    per_group: int = 1,
) -> None:
    """Measure the cells ``ledger`` still lacks in this process, each divided by ``positions``
    (its objective per counted position) and each cut block compensated when ``compensation``
    is active: one at a time on a resident model, in groups of ``per_group`` sorted by layer on
    a streamed one (``streaming.measure_ledger_streamed``). The ledger saves and reports them,
    and what is measured is saved when the loop ends or is cancelled (``ledger.hooks``' cancel
    polled before every cell or group)."""
    if is_streamed(lm):
        measure_ledger_streamed(lm, state, ledger, objective, positions, per_group, compensation)
        return
    try:
        for k in ledger.missing():
            ledger.hooks.check_cancelled(f"loss table build cancelled after {ledger.done_message()}")
            ledger.record(k, run_cell(lm, state, ledger.jobs[k][2], objective, compensation) / positions)
    finally:
        ledger.flush()


def exact_cells(request: CellRequest, schedule: CellSchedule) -> CellObjectives:
    """Every distinct cell of ``request``'s table, measured by ``schedule`` after the dense pass.

    The active stage enters the dense pass, then the cells stage with the ledger's first report
    (cells already measured, cells, None), and is told after every cell ``schedule`` records;
    cells sharing a cut read its value.
    """
    lm, spec, windows = request.lm, request.spec, request.windows
    jobs, owner = distinct_cuts(unit_cuts(lm, request.scores, request.components, spec.rate_grid, spec.channel_multiple))
    hooks = active()
    hooks.enter(DENSE_PASS)
    with reporting(hooks.replaced(progress=None)):
        state = dense_state(lm, windows, spec.windows.batch_size, (spec.objective,))
    positions = objective_positions(windows, spec.objective, state.start)
    dense_objective = state.objective_sum / positions if spec.objective == "nll" else 0.0
    with reporting(cells_start(hooks)):
        ledger = CellLedger(lm, jobs, request.partial)
        extra = schedule(state, ledger, positions)
    shape = (len(request.components), len(spec.rate_grid))
    objective, stats = ledger.table(owner, shape, dense_objective)
    return CellObjectives(objective, dense_objective, stats | extra, np.ones(shape, dtype=bool), None)


def measure_exact(request: CellRequest, per_group: int | None = None) -> CellObjectives:
    """The ``exact`` estimator's filler (``ledger.CellFiller``), in this process: a resident
    model's cells one at a time, a streamed model's in groups of ``per_group`` (default: as
    many as ``streaming.group_size`` allows) that share each block's visit to the device."""
    lm, spec = request.lm, request.spec
    compensation = cell_compensation(spec)

    def schedule(state: DenseState, ledger: CellLedger, positions: int) -> BuildStats:
        if not is_streamed(lm):
            measure_ledger(lm, state, ledger, spec.objective, positions, compensation)
            return {}
        # Sized once, after the dense pass: on CUDA the size follows free memory, and the statistics report what was used.
        group = per_group or group_size(request.windows.numel(), lm)
        measure_ledger(lm, state, ledger, spec.objective, positions, compensation, group)
        return {"streamed_groups_of": group}

    return exact_cells(request, schedule)


def cells_start(hooks: Hooks) -> Hooks:
    """``hooks`` whose progress announces the cells stage at its first call: the ledger
    reports (cells already measured, cells, None) once, as the dense pass ends."""
    started: list[bool] = []

    def report(done: int, total: int, eta: float | None = None) -> None:
        if not started:
            started.append(True)
            hooks.enter(CELLS)
        hooks.report(done, total, eta)

    return hooks.replaced(progress=report)


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


def window_cells(lm: LoadedModel, spec: TableSpec, windows: torch.Tensor) -> WindowCells:
    """Measure every distinct cell of an exact table per window, NLL and KL together.

    Args:
        lm, spec: as for ``measure_table`` (spec.objective and spec.estimator are ignored).
        windows: (N, T) token ids.
        The active stage is told distinct cells done and its cancel polled before each.
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
    for c, r, cut in steps(jobs, "per-window cells", "cells", timed=True):
        sums = cell_per_window(lm, state, cut, ("nll", "kl"), cell_compensation(spec))
        distinct[c, r] = True
        for cell, source in owner.items():
            if source == (c, r):
                nll[cell] = sums["nll"].cpu().numpy() / nll_positions - dense_nll
                kl[cell] = sums["kl"].cpu().numpy() / kl_positions
    removed, _ = removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    return WindowCells(components, np.asarray(spec.rate_grid), removed, distinct, nll, kl, dense_nll)
