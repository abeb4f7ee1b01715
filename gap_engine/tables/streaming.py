"""Exact loss tables of a streamed model: blocks on the host, one at a time on the device.

The resident builder (``tables.exact``) runs each cell through blocks ``i..L-1`` in turn;
with the blocks on the host that would move ``L - i`` blocks per cell. Here the loops are
turned around, as SparseGPT turns them for its layer-wise solve: cells are taken in groups
sorted by their layer, and for one group every block from the group's first layer to the
last visits the device once, while all of the group's cells (and all their batches) go
through it. A cell entering its own block has its units masked there
(``slicing.zeroed_units``, on the device copy of the block), exactly as the resident builder
masks them, so both builders do the same arithmetic on the same inputs and produce the
same table (``tests/test_streaming.py``).

What waits on the host: the dense inputs of every block (the resident build keeps them on
the device). The hidden states of the cells in flight stay on the device from the cell's
first block to its LM head, so only blocks and one input per cell cross the bus; they bound
the group size (half the free device memory on CUDA, ``STREAM_GROUP_BYTES`` elsewhere).
Measured cells land in the same partial file as the resident build's, so a streamed build
resumes a resident one and the other way round.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from gap_engine.core.device import placement_of
from gap_engine.core.progress import CancelToken, EtaClock, ProgressFn, check_cancelled
from gap_engine.data.windows import text_start
from gap_engine.model.layerwise import block_on, forward_blocks, layer_output, to_host
from gap_engine.model.slicing import zeroed_units
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.cells import Cut, objective_per_window, objective_positions, unit_cuts
from gap_engine.tables.exact import MAX_STORED_LOGPROB_BYTES, DenseState, PartialStore, dense_logprobs, distinct_cuts
from gap_engine.tables.ledger import CellLedger

# Memory for the hidden states of the cells measured together (one (N, T, d) tensor each)
# where the free device memory is not known (CPU, MPS); CUDA uses half of what is free.
STREAM_GROUP_BYTES = 4 << 30


def streamed_dense_state(lm, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...], cancel: CancelToken | None = None) -> DenseState:
    """The dense pass of ``tables.exact`` done block by block, its states kept on the host.

    Returns:
        a DenseState whose block inputs, final states and stored log-probabilities are host
        tensors (pinned on CUDA) and whose token ids and block calls are on the device.
    """
    by_block: list[list[torch.Tensor]] = []
    done = forward_blocks(lm, windows, batch_size, on_input=lambda i, hidden: by_block.append(hidden), cancel=cancel)
    n_batches = len(done.batches)
    block_inputs = [[by_block[i][b] for i in range(len(by_block))] for b in range(n_batches)]  # [b][i]
    state = DenseState(done.batches, block_inputs, done.calls, done.final_hidden, None, [], text_start(lm.tokenizer, windows))
    vocab = lm.adapter.lm_head(lm.model).out_features
    if "kl" in objectives and windows.numel() * vocab * 4 <= MAX_STORED_LOGPROB_BYTES:
        state.dense_logprobs = []
    device = placement_of(lm).device
    with torch.inference_mode():
        for batch, final in zip(done.batches, done.final_hidden):
            logits = lm.adapter.logits_from_hidden(lm.model, final.to(device)).float()  # (B, T, V)
            if state.dense_logprobs is not None:
                state.dense_logprobs.append(to_host(F.log_softmax(logits, dim=-1)))
            state.dense_nll.append(objective_per_window(logits, batch, "nll", None, state.start))
    return state


def streamed_cells(lm, state: DenseState, cuts: list[Cut], objectives: tuple[str, ...], cancel: CancelToken | None = None) -> list[dict[str, torch.Tensor]]:
    """Per-window objective sums of several cuts, the blocks streamed once for all of them.

    Args:
        lm: a streamed (or resident) LoadedModel.
        state: its dense state (``streamed_dense_state``).
        cuts: the cells to measure, in any order.
        objectives: names of the objectives to sum.
        cancel: polled before every block.
    Returns:
        per cut, {objective: (N,) float64 sums over each window's positions}, as
        ``exact.cell_per_window`` returns them.
    """
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    in_flight: dict[int, list[torch.Tensor]] = {}  # cut index -> [b] (B, T, d) states on the device
    with torch.inference_mode():
        for j in range(min(cut.layer for cut in cuts), len(layers)):
            check_cancelled(cancel, f"streamed cells cancelled at block {j} of {len(layers)}")
            for k, cut in enumerate(cuts):
                if cut.layer == j:
                    in_flight[k] = [inputs[j].to(device) for inputs in state.block_inputs]
            with block_on(layers[j], device) as layer:
                for k, hidden in in_flight.items():
                    cut = cuts[k]
                    masked = zeroed_units(lm.adapter, layer, cut.heads, cut.channels) if cut.layer == j else contextlib.nullcontext()
                    with masked:
                        in_flight[k] = [
                            layer_output(layer(states, *state.block_calls[b][j][0], **state.block_calls[b][j][1]))
                            for b, states in enumerate(hidden)
                        ]
        out = []
        for k in range(len(cuts)):
            sums: dict[str, list[torch.Tensor]] = {name: [] for name in objectives}
            for b, (batch, states) in enumerate(zip(state.batches, in_flight[k])):
                logits = lm.adapter.logits_from_hidden(lm.model, states)  # (B, T, V)
                for name in objectives:
                    dense = dense_logprobs(lm, state, b) if name == "kl" else None
                    sums[name].append(objective_per_window(logits, batch, name, dense, state.start))
            out.append({name: torch.cat(parts) for name, parts in sums.items()})
    return out


def cell_groups(jobs, todo: list[int], per_group: int) -> list[list[int]]:
    """Jobs to measure, sorted by layer (then as listed) and cut into groups of ``per_group``."""
    ordered = sorted(todo, key=lambda k: (jobs[k][2].layer, k))
    return [ordered[i : i + per_group] for i in range(0, len(ordered), per_group)]


def group_size(n_tokens: int, lm, budget_bytes: int | None = None) -> int:
    """Cells measured together: as many (N, T, d) states (``n_tokens`` = N * T) as fit the
    budget, at least one.

    The budget: ``budget_bytes`` when given, else half the free memory of a CUDA device, else
    ``STREAM_GROUP_BYTES``.
    """
    embed = lm.model.get_input_embeddings().weight
    if budget_bytes is None:
        device = placement_of(lm).device
        budget_bytes = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else STREAM_GROUP_BYTES
    per_cell = n_tokens * embed.shape[1] * embed.element_size()
    return max(1, int(budget_bytes // max(per_cell, 1)))


def measure_exact_streamed(
    lm,
    spec: TableSpec,
    windows: torch.Tensor,
    scores,
    components: list[tuple[int, str]],
    progress: ProgressFn | None,
    cancel: CancelToken | None,
    partial: PartialStore | None,
    per_group: int | None = None,
) -> tuple[np.ndarray, float, dict]:
    """``exact.measure_exact`` for a streamed model: (C, R) objectives, dense objective, statistics.

    Args:
        as ``exact.measure_exact``; ``per_group`` cells go through the blocks together
        (default: as many as ``STREAM_GROUP_BYTES`` of host memory holds).
    """
    jobs, owner = distinct_cuts(unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple))
    ledger = CellLedger(lm, jobs, partial, progress)
    state = streamed_dense_state(lm, windows, spec.windows.batch_size, (spec.objective,), cancel)
    positions = objective_positions(windows, spec.objective, state.start)
    dense_objective = state.objective_sum / positions if spec.objective == "nll" else 0.0
    # Sized once: on CUDA the size follows free memory, and the statistics report what was used.
    per_group = per_group or group_size(windows.numel(), lm)
    try:
        for group in cell_groups(jobs, ledger.todo, per_group):
            check_cancelled(cancel, f"loss table build cancelled after {ledger.done_message()}")
            sums = streamed_cells(lm, state, [jobs[k][2] for k in group], (spec.objective,), cancel)
            for k, values in zip(group, sums):
                ledger.record(k, float(values[spec.objective].sum()) / positions)
    finally:
        ledger.flush()
    objective, stats = ledger.table(owner, (len(components), len(spec.rate_grid)), dense_objective)
    return objective, dense_objective, stats | {"streamed_groups_of": per_group}


def measure_cells_streamed(
    lm,
    state: DenseState,
    todo: list[tuple[int, int, Cut]],
    objective: str,
    positions: int,
    measured: dict[tuple[int, int], float],
    total: int,
    partial: PartialStore | None,
    progress: ProgressFn | None,
    cancel: CancelToken | None,
) -> None:
    """``exact.measure_cells`` for a streamed model (a refined table's rounds): the cells
    ``todo`` in groups sorted by layer, the blocks streamed once per group; ``measured`` is
    saved to ``partial`` after every group and when the loop ends or is cancelled."""
    groups = cell_groups(todo, list(range(len(todo))), group_size(sum(batch.numel() for batch in state.batches), lm))
    clock = EtaClock(total_steps=len(groups))
    try:
        for group in groups:
            check_cancelled(cancel, f"loss table build cancelled after {len(measured)} of {total} cells")
            sums = streamed_cells(lm, state, [todo[k][2] for k in group], (objective,), cancel)
            for k, values in zip(group, sums):
                c, r, _ = todo[k]
                measured[c, r] = float(values[objective].sum()) / positions
            eta = clock.step()
            if progress:
                progress(len(measured), total, eta)
            if partial is not None:
                partial.save(measured)
    finally:
        if partial is not None and todo:
            partial.save(measured)
