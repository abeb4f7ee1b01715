"""Reference implementations that only tests and benchmarks use.

Each is the slow, obviously correct version of something the engine does fast: the DP
against exhaustive enumeration, the exact loss table against one full forward of a sliced
copy per cell, and the grid-uniform baseline. They live here, not in the package.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gap_engine.core.errors import BudgetError, TableError
from gap_engine.core.knapsack import check_inputs
from gap_engine.core.progress import ProgressFn
from gap_engine.data.bos import text_start, with_bos
from gap_engine.data.windows import batches, calibration_windows, check_window_sizes, cut_windows, load_corpus, tokenize_stream
from gap_engine.model.slicing import slice_attention_, slice_mlp_
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import layer_selection
from gap_engine.tables.artefact import LossTable, TableSpec, table_components, table_key
from gap_engine.tables.build import assemble_table
from gap_engine.tables.cells import objective_positions, objective_sum
from gap_engine.tables.ledger import CellObjectives


def brute_force(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray | None, min_removed: float) -> tuple[float, np.ndarray]:
    """Exhaustive reference for tests: enumerate every choice (small C and R only).

    Args:
        costs, losses, allowed: as in `solve_front`.
        min_removed: parameters that must be removed (at least), exact costs.
    Returns:
        (least summed loss, (C,) intp choice), the lexicographically first on ties;
        (inf, all -1) when no choice removes enough.
    Raises:
        BudgetError: malformed tables, or more than a million choices to enumerate.
    """
    costs_int, losses_arr, mask = check_inputs(costs, losses, allowed)
    n_comp = costs_int.shape[0]
    options = [np.flatnonzero(mask[c]) for c in range(n_comp)]
    n_choices = math.prod(len(o) for o in options)
    if n_choices > 1_000_000:
        raise BudgetError(f"brute force would enumerate {n_choices:,} choices; it is for tiny instances")
    every = np.array(list(itertools.product(*options)), dtype=np.intp).reshape(n_choices, n_comp)  # (N, C)
    removed = costs_int[np.arange(n_comp), every].sum(axis=1)  # (N,)
    total_loss = np.zeros(n_choices)
    for c in range(n_comp):  # summed in component order, like the DP
        total_loss += losses_arr[c, every[:, c]]
    total_loss[removed < min_removed] = np.inf
    best = int(np.argmin(total_loss))  # first minimum: lexicographic order of product()
    if not np.isfinite(total_loss[best]):
        return math.inf, np.full(n_comp, -1, dtype=np.intp)
    return float(total_loss[best]), every[best]


def uniform_choice(costs: np.ndarray, rate_grid: np.ndarray, removed_params: float) -> np.ndarray:
    """Baseline: the same grid rate for every component, the smallest that meets the budget.

    Args:
        costs: (C, R) int >= 0, parameters removed by option r of component c.
        rate_grid: (R,) the rates of the options.
        removed_params: parameters that must be removed (at least).
    Returns:
        (C,) intp, the same option index for every component.
    Raises:
        BudgetError: no single grid rate removes enough.
    """
    costs_arr = np.asarray(costs, dtype=np.int64)
    grid = np.asarray(rate_grid, dtype=np.float64)
    if costs_arr.ndim != 2 or grid.shape != (costs_arr.shape[1],):
        raise BudgetError(f"rate_grid shape {grid.shape} does not match costs shape {costs_arr.shape}")
    if not math.isfinite(removed_params):
        raise BudgetError(f"budget must be a finite number of parameters, got {removed_params!r}")
    totals = costs_arr.sum(axis=0)  # (R,)
    for r in np.argsort(grid, kind="stable"):
        if totals[r] >= removed_params:
            return np.full(costs_arr.shape[0], r, dtype=np.intp)
    top = int(np.argmax(totals))
    raise BudgetError(f"uniform pruning cannot remove {removed_params:,.0f} parameters: at most {int(totals[top]):,} (rate {grid[top]:g})")


def loop_front(costs: np.ndarray, losses: np.ndarray, allowed: np.ndarray | None = None, n_buckets: int = 4096) -> dict[str, np.ndarray]:
    """`solve_front` written as a plain loop: one option at a time, masked copies.

    The same covering DP over the same buckets (see core/knapsack.py's docstring), looped
    over components and then options, each a pass over every budget. Kept to check the
    vectorised planner against (identical values, choices and removals) and to time it.

    Returns:
        dict of ``bucket_size``, ``best_loss`` (B+1,), ``choices`` (B+1, C) and ``removed`` (B+1,).
    """
    costs_int, losses_arr, mask = check_inputs(costs, losses, allowed)
    n_comp, n_opt = costs_int.shape
    max_removable = int(np.where(mask, costs_int, -1).max(axis=1).sum())
    bucket_size = max(1, -(-max_removable // n_buckets))
    n_budget = -(-max_removable // bucket_size)
    width = n_budget + 1
    bucketed = np.minimum((costs_int + bucket_size // 2) // bucket_size, n_budget)
    pointers = np.empty((n_comp, width), dtype=np.int16 if n_opt <= np.iinfo(np.int16).max else np.int32)
    prev = np.full(width, np.inf)
    prev[0] = 0.0
    best, cand, better = np.empty(width), np.empty(width), np.empty(width, dtype=bool)
    for c in range(n_comp):
        row = pointers[c]
        row.fill(-1)
        best.fill(np.inf)
        for r in np.flatnonzero(mask[c]):
            shift = min(int(bucketed[c, r]), width)
            cand[:shift] = prev[0] + losses_arr[c, r]
            np.add(prev[: width - shift], losses_arr[c, r], out=cand[shift:])
            np.less(cand, best, out=better)  # strict: the smaller rate keeps a tie
            np.copyto(best, cand, where=better)
            np.copyto(row, r, where=better)
        prev, best = best, prev
    reachable = np.isfinite(prev)
    choices = np.empty((width, n_comp), dtype=pointers.dtype)
    budget_left = np.arange(width)
    for c in range(n_comp - 1, -1, -1):
        picked = pointers[c, budget_left]
        choices[:, c] = picked
        budget_left = np.maximum(budget_left - bucketed[c, picked], 0)
    choices[~reachable] = -1
    removed = costs_int[np.arange(n_comp), choices].sum(axis=1)
    removed[~reachable] = -1
    return {"bucket_size": np.array(bucket_size), "best_loss": prev, "choices": choices, "removed": removed}


def naive_build_table(lm, spec: TableSpec, progress: ProgressFn | None = None, windows: torch.Tensor | None = None) -> LossTable:
    """Reference build: one full forward of the whole model per cell, on a sliced copy.

    Every cell (rate > 0) deep-copies its block, slices it with surgery's own functions,
    swaps it into the model and runs the model's ordinary forward; no stored states, no
    masking, no sharing between cells with the same cut. Only for benchmarks and tests.
    """
    spec.validate()
    if spec.estimator != "exact":
        raise TableError("the naive build measures exact tables only")
    started = time.perf_counter()
    data_fingerprint = load_corpus(spec.windows.data).fingerprint
    if windows is None:
        windows = calibration_windows(lm.tokenizer, spec.windows)
    components = table_components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.windows.batch_size)
    parts = batches(windows, spec.windows.batch_size)
    start = text_start(lm.tokenizer, windows)
    positions = objective_positions(windows, spec.objective, start)
    layers = lm.adapter.layers(lm.model)

    def objective_of_model(dense_logprobs) -> tuple[float, list]:
        total, kept = 0.0, []
        with torch.inference_mode():
            for b, batch in enumerate(parts):
                logits = lm.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
                if spec.objective == "kl" and dense_logprobs is None:
                    kept.append(F.log_softmax(logits, dim=-1))
                    continue
                total += objective_sum(logits, batch, spec.objective, dense_logprobs[b] if dense_logprobs else None, start)
        return total / positions, kept

    dense, dense_logprobs = objective_of_model(None)
    objective = np.full((len(components), len(spec.rate_grid)), dense, dtype=np.float64)
    total = len(components) * (len(spec.rate_grid) - 1)
    done = 0
    for c, (layer_index, kind) in enumerate(components):
        original = layers[layer_index]
        for r, rate in enumerate(spec.rate_grid):
            if r == 0:
                continue
            pruned = copy.deepcopy(original)
            kept_kv, kept_heads, kept_channels = layer_selection(
                lm.adapter,
                original,
                scores.layers[layer_index],
                rate if kind in ("attn", "block") else 0.0,
                rate if kind in ("mlp", "block") else 0.0,
                spec.channel_multiple,
            )
            geom = lm.adapter.geometry(original)
            if len(kept_heads) < geom.n_heads:
                slice_attention_(lm.adapter, pruned, kept_kv, kept_heads)
            if len(kept_channels) < geom.intermediate_size:
                slice_mlp_(lm.adapter, pruned, kept_channels)
            layers[layer_index] = pruned
            try:
                objective[c, r], _ = objective_of_model(dense_logprobs or None)
            finally:
                layers[layer_index] = original
            done += 1
            if progress:
                elapsed = time.perf_counter() - started
                progress(done, total, elapsed / done * (total - done))
    key = table_key(lm, spec, data_fingerprint)
    seconds = time.perf_counter() - started
    cells = CellObjectives(objective, dense, {"cells_measured": total}, np.full(objective.shape, spec.estimator == "exact"), None)
    return assemble_table(lm, spec, key, data_fingerprint, components, cells, seconds)


def make_windows(tokenizer, texts: Sequence[str], n_samples: int, seq_len: int, seed: int = 0) -> torch.LongTensor:
    """Reference composition of the window stage on a list of documents (the engine cuts windows
    from text sources; tests use this to check its pieces on hand-written texts).

    Tokenize documents into one stream and cut ``n_samples`` windows of ``seq_len`` text tokens.

    Documents are joined by the tokenizer's EOS token (or ``"\\n\\n"`` if it has none)
    into one stream encoded without special tokens. Windows are non-overlapping whenever
    the stream holds ``n_samples * seq_len`` tokens: ``n_samples`` distinct slots of the
    grid ``offset + k * seq_len`` with a random offset. A shorter stream (but at least
    ``seq_len`` tokens) gives overlapping windows and logs a warning. When the model
    expects a beginning-of-sequence token (:func:`bos_token_id`), every window starts with
    it, as the model was trained to read, followed by the same ``seq_len`` text tokens;
    :func:`text_start` tells the counting code to leave that position out.

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: the documents.
        n_samples: number of windows, at least 1.
        seq_len: text tokens per window, at least 2.
        seed: the same (texts, n_samples, seq_len, seed) always gives the same windows.

    Returns:
        Token ids, shape (n_samples, seq_len) or, with a BOS token, (n_samples, 1 + seq_len); int64.

    Raises:
        DataError: bad sizes, no text, or fewer than ``seq_len`` tokens.
    """
    check_window_sizes(n_samples, seq_len)
    return with_bos(tokenizer, cut_windows(tokenize_stream(tokenizer, texts), n_samples, seq_len, seed))
