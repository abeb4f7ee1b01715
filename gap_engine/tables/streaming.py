"""Exact loss tables of a streamed model: blocks on the host, one at a time on the device.

The resident builder (``tables.exact``) runs each cell through blocks ``i..L-1`` in turn;
with the blocks on the host that would move ``L - i`` blocks per cell. Here the loops are
turned around, as SparseGPT turns them for its layer-wise solve: cells are taken in groups
sorted by their layer, and for one group every block from the group's first layer to the
last visits the device once, while all of the group's cells (and all their batches) go
through it. A cell entering its own block has its units masked there
(``slicing.zeroed_units``, on the device copy of the block, and compensated as the table's
spec says: ``cells.cut_applied``), and its objective counted by ``cells.head_objectives``,
exactly as the resident builder does, so both builders do the same arithmetic on the same
inputs and produce the same table (``tests/tables/test_streaming.py``).

What waits on the host: the dense inputs of every block (the resident build keeps them on
the device). The hidden states of the cells in flight stay on the device from the cell's
first block to its LM head, so only blocks and one input per cell cross the bus; they bound
the group size (half the free device memory on CUDA, ``STREAM_GROUP_BYTES`` elsewhere).
Measured cells land in the same partial file as the resident build's, so a streamed build
resumes a resident one and the other way round.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import placement_of
from gap_engine.core.progress import steps
from gap_engine.data.bos import text_start
from gap_engine.model.layerwise import block_on, forward_blocks, layer_output, to_host
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.tables.cells import MAX_STORED_LOGPROB_BYTES, Cut, DenseState, cut_applied, head_objectives, objective_per_window
from gap_engine.tables.ledger import CellLedger, Job

# Memory for the hidden states of the cells measured together (one (N, T, d) tensor each)
# where the free device memory is not known (CPU, MPS); CUDA uses half of what is free.
STREAM_GROUP_BYTES = 4 << 30


def streamed_dense_state(lm: LoadedModel, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...]) -> DenseState:
    """The dense pass of ``tables.exact`` done block by block, its states kept on the host
    (the active stage told blocks done, its cancel polled before every block).

    Returns:
        a DenseState whose block inputs, final states and stored log-probabilities are host
        tensors (pinned on CUDA) and whose token ids and block calls are on the device.
    """
    by_block: list[list[torch.Tensor]] = []
    done = forward_blocks(lm, windows, batch_size, on_input=lambda i, hidden: by_block.append(hidden))
    n_batches = len(done.batches)
    block_inputs = [[by_block[i][b] for i in range(len(by_block))] for b in range(n_batches)]  # [b][i]
    state = DenseState(done.batches, block_inputs, done.calls, done.final_hidden, None, [], text_start(lm.tokenizer, windows))
    vocab = cast(nn.Linear, lm.adapter.lm_head(lm.model)).out_features
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


def streamed_cells(
    lm: LoadedModel,
    state: DenseState,
    cuts: list[Cut],
    objectives: tuple[str, ...],
    compensation: CompensationSettings | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per-window objective sums of several cuts, the blocks streamed once for all of them.

    Args:
        lm: a streamed (or resident) LoadedModel.
        state: its dense state (``streamed_dense_state``).
        cuts: the cells to measure, in any order.
        objectives: names of the objectives to sum.
        The active stage's cancel is polled before every block (nothing is reported: the
        ledger counts cells).
        compensation: what each cut block is compensated with (``cells.cut_applied``).
    Returns:
        per cut, {objective: (N,) float64 sums over each window's positions}, as
        ``cells.cell_per_window`` returns them.
    """
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    in_flight: dict[int, list[torch.Tensor]] = {}  # cut index -> [b] (B, T, d) states on the device
    with torch.inference_mode():
        for j in steps(range(min(cut.layer for cut in cuts), len(layers)), "streamed cells", "blocks", quiet=True):
            for k, cut in enumerate(cuts):
                if cut.layer == j:
                    in_flight[k] = [inputs[j].to(device) for inputs in state.block_inputs]
            with block_on(layers[j], device) as layer:
                for k, hidden in in_flight.items():
                    cut = cuts[k]
                    masked = cut_applied(lm, layer, state, cut, compensation, device) if cut.layer == j else contextlib.nullcontext()
                    with masked:
                        in_flight[k] = [
                            layer_output(layer(states, *state.block_calls[b][j][0], **state.block_calls[b][j][1]))
                            for b, states in enumerate(hidden)
                        ]
        out: list[dict[str, torch.Tensor]] = []
        for k in range(len(cuts)):
            sums: dict[str, list[torch.Tensor]] = {name: [] for name in objectives}
            for b, states in enumerate(in_flight[k]):
                for name, part in head_objectives(lm, state, b, states, objectives).items():
                    sums[name].append(part)
            out.append({name: torch.cat(parts) for name, parts in sums.items()})
    return out


def cell_groups(jobs: list[Job], todo: list[int], per_group: int) -> list[list[int]]:
    """Jobs to measure, sorted by layer (then as listed) and cut into groups of ``per_group``."""
    ordered = sorted(todo, key=lambda k: (jobs[k][2].layer, k))
    return [ordered[i : i + per_group] for i in range(0, len(ordered), per_group)]


def group_size(n_tokens: int, lm: LoadedModel, budget_bytes: int | None = None) -> int:
    """Cells measured together: as many (N, T, d) states (``n_tokens`` = N * T) as fit the
    budget, at least one.

    The budget: ``budget_bytes`` when given, else half the free memory of a CUDA device, else
    ``STREAM_GROUP_BYTES``.
    """
    # lm.model is typed as a Module; get_input_embeddings is the transformers model's own method.
    embed = cast(nn.Embedding, cast(Any, lm.model).get_input_embeddings()).weight
    if budget_bytes is None:
        device = placement_of(lm).device
        budget_bytes = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else STREAM_GROUP_BYTES
    per_cell = n_tokens * embed.shape[1] * embed.element_size()
    return max(1, int(budget_bytes // max(per_cell, 1)))


def measure_ledger_streamed(
    lm: LoadedModel,
    state: DenseState,
    ledger: CellLedger,
    objective: str,
    positions: int,
    per_group: int,
    compensation: CompensationSettings | None = None,
) -> None:
    """The cells ``ledger`` still lacks on a streamed model (``exact.measure_ledger`` calls it),
    in groups of ``per_group`` sorted by layer, the blocks streamed once per group."""
    try:
        for group in cell_groups(ledger.jobs, ledger.missing(), per_group):
            ledger.hooks.check_cancelled(f"loss table build cancelled after {ledger.done_message()}")
            sums = streamed_cells(lm, state, [ledger.jobs[k][2] for k in group], (objective,), compensation)
            for k, values in zip(group, sums):
                ledger.record(k, float(values[objective].sum()) / positions)
    finally:
        ledger.flush()
