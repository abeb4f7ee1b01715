"""Structured Optimal Brain Surgeon: remove input columns of a linear layer, fixing the rest.

SlimGPT (Ling et al., NeurIPS 2024) prunes a layer's heads and MLP channels as blocks of
input columns of ``o_proj`` / ``down_proj``. For a layer ``y = W x`` and calibration inputs
with Gram matrix ``H = sum x x^T``, removing the column block ``b`` while the remaining
columns absorb the loss costs

    E_b = trace(W_b [H^-1]_bb^-1 W_b^T)

in summed squared output error, and the optimal fix of the other columns is
``W -= W_b [H^-1]_bb^-1 [H^-1]_b,:``. After a removal the inverse Hessian of the
remaining columns is the Schur update ``H^-1 -= [H^-1]_:,b [H^-1]_bb^-1 [H^-1]_b,:``, so
the next block's error accounts for the earlier removals. SlimGPT's Batched Greedy Pruning
(grouped Cholesky errors for heads, Dynamic Group Size for channels) approximates this
greedy for speed on 7B layers; our layers are small, so `greedy_remove` runs the exact
greedy, one block per step. The weights it leaves equal the least-squares refit of the kept
columns to the layer's own output on the same inputs (``tests/prune/test_obs.py`` checks it).

Pure functions of tensors (float64): no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gap_engine.core.errors import GapError

OBS_DAMPING = 0.01  # lambda: H + lambda * mean(diag H) * I, SparseGPT's and SlimGPT's dampening


class ObsError(GapError):
    """A system the OBS update cannot solve (no calibration signal at all)."""


def damped_inverse(gram: torch.Tensor, damping: float = OBS_DAMPING) -> torch.Tensor:
    """The inverse of ``gram + damping * mean(diag) * I`` (float64); dead inputs get a unit diagonal.

    Args:
        gram: (n, n) sum of x x^T over calibration tokens.
    Raises:
        ObsError: an all-zero Gram matrix (no input ever reached the layer).
    """
    h = gram.double().clone()  # (n, n)
    diag = torch.diagonal(h)
    dead = diag <= 0
    if bool(dead.all()):
        raise ObsError("every input of the layer is zero on the calibration text: OBS has nothing to solve")
    diag[dead] = 1.0  # an input that never fires: its column can go at no cost
    diag += damping * diag.mean()
    return torch.cholesky_inverse(torch.linalg.cholesky(h))


@dataclass
class Removal:
    """What `greedy_remove` did: the blocks removed, in order, and the error each cost."""

    order: list[int]  # block indices, in the order they went
    errors: list[float]  # E_b of each at the time it went


def block_errors(weight: torch.Tensor, inverse: torch.Tensor, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """E_b for every block (float64, (len(blocks),)); a block whose inverse block is singular costs inf."""
    errors = torch.full((len(blocks),), float("inf"), dtype=torch.float64)
    for j, cols in enumerate(blocks):
        w_b = weight[:, cols]  # (out, b)
        try:
            solved = torch.linalg.solve(inverse[cols][:, cols], w_b.T)  # (b, out)
        except RuntimeError:
            continue
        errors[j] = (w_b.T * solved).sum()
    return errors


def remove_block(weight: torch.Tensor, inverse: torch.Tensor, cols: torch.Tensor) -> None:
    """Remove one column block in place: fix the other columns, Schur-update the inverse, zero the block."""
    inv_bb = inverse[cols][:, cols]  # (b, b)
    rows = inverse[cols, :]  # (b, n)
    weight -= weight[:, cols] @ torch.linalg.solve(inv_bb, rows)  # (out, n)
    inverse -= inverse[:, cols] @ torch.linalg.solve(inv_bb, rows)  # (n, n)
    weight[:, cols] = 0.0
    inverse[cols, :] = 0.0
    inverse[:, cols] = 0.0


def greedy_remove(
    weight: torch.Tensor,
    inverse: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    count: int,
    group_of: Sequence[int] | None = None,
    quota: dict[int, int] | None = None,
) -> Removal:
    """Remove ``count`` column blocks greedily, the cheapest (E_b) first, updating in place.

    Args:
        weight: (out, n) float64 weights; the kept columns are fixed, the removed ones zeroed.
        inverse: (n, n) float64 damped inverse Gram matrix (`damped_inverse`); updated.
        blocks: column indices of each block (equal sizes or not).
        count: blocks to remove.
        group_of, quota: when given, block j belongs to group ``group_of[j]`` and at most
            ``quota[g]`` blocks of group g go (GQA: each kept KV group keeps as many heads).
    Returns:
        The Removal: block order and errors.
    """
    if group_of is None and all(len(cols) == 1 for cols in blocks):
        return _greedy_remove_columns(weight, inverse, torch.cat(list(blocks)), count)
    removed = torch.zeros(len(blocks), dtype=torch.bool)
    left = dict(quota or {})
    out = Removal([], [])
    for _ in range(count):
        errors = block_errors(weight, inverse, blocks)
        errors[removed] = torch.inf
        if group_of is not None:
            for j, g in enumerate(group_of):
                if left.get(g, 0) <= 0:
                    errors[j] = torch.inf
        j = int(torch.argmin(errors))
        if not torch.isfinite(errors[j]):
            raise ObsError(f"only {len(out.order)} of {count} blocks could be removed")
        remove_block(weight, inverse, blocks[j])
        removed[j] = True
        if group_of is not None:
            left[group_of[j]] -= 1
        out.order.append(j)
        out.errors.append(float(errors[j]))
    return out


def _greedy_remove_columns(weight: torch.Tensor, inverse: torch.Tensor, columns: torch.Tensor, count: int) -> Removal:
    """`greedy_remove` for blocks of one column each (an MLP's channels): the same greedy, cheaper.

    Removing column c Schur-updates the inverse by the rank one ``u u^T`` with
    ``u = [H^-1]_:,c / sqrt([H^-1]_cc)``. Rather than rewrite the (n, n) inverse at every step,
    the steps' vectors are kept as the columns of ``U``: the current inverse is
    ``H0^-1 - U U^T``, of which a step needs only column c (``O(n k)`` after k steps) and the
    diagonal (updated by ``u^2``). The weights still take each step's rank-one fix, and the
    inverse is brought up to date with one product at the end, so ``weight`` and ``inverse``
    leave as `remove_block`, step by step, would leave them.
    """
    n = inverse.shape[0]
    index = {int(c): j for j, c in enumerate(columns)}
    start = inverse.clone()
    diag = torch.diagonal(inverse).clone()  # (n,) the current inverse's diagonal
    steps = torch.zeros(n, count, dtype=inverse.dtype)  # U: one column per removal
    alive = torch.full((n,), float("inf"), dtype=inverse.dtype)
    alive[columns] = 0.0  # +inf on columns that are not candidates (or already removed)
    rows = weight.T.contiguous()  # (n, out): a column's norm and update run along memory
    out = Removal([], [])
    for k in range(count):
        norms = torch.linalg.vector_norm(rows, dim=1).square()  # (n,)
        errors = torch.where(diag > 0, norms / diag.clamp_min(1e-300), torch.inf) + alive
        c = int(torch.argmin(errors))
        if not torch.isfinite(errors[c]):
            raise ObsError(f"only {k} of {count} blocks could be removed")
        column = start[:, c] - steps[:, :k] @ steps[c, :k]  # (n,) the current inverse's column c
        pivot = column[c]
        rows.addr_(column, rows[c].clone(), alpha=-1.0 / float(pivot))
        rows[c] = 0.0
        step = column / pivot.sqrt()
        steps[:, k] = step
        diag -= step.square()
        alive[c] = float("inf")
        out.order.append(index[c])
        out.errors.append(float(errors[c]))
    weight.copy_(rows.T)
    inverse -= steps @ steps.T
    gone = torch.tensor([int(columns[j]) for j in out.order], dtype=torch.long)
    inverse[gone, :] = 0.0
    inverse[:, gone] = 0.0
    return out


def obs_heads(
    weight: torch.Tensor, inverse: torch.Tensor, n_kv_heads: int, head_dim: int, kv_groups: int, heads_per_group: int
) -> tuple[list[int], list[int]]:
    """Kept KV groups and query heads (ascending) of a GQA-valid shape, chosen by greedy OBS.

    Whole KV groups go first (a group is the block of all its heads' columns), then, within
    every kept group, the same number of heads each; ``weight`` (out, H*D) and ``inverse``
    are updated in place as each block goes.
    """
    n_heads = weight.shape[1] // head_dim
    group_size = n_heads // n_kv_heads
    heads = [torch.arange(h * head_dim, (h + 1) * head_dim) for h in range(n_heads)]
    groups = [torch.cat(heads[g * group_size : (g + 1) * group_size]) for g in range(n_kv_heads)]
    gone_groups = set(greedy_remove(weight, inverse, groups, n_kv_heads - kv_groups).order)
    kept_kv = [g for g in range(n_kv_heads) if g not in gone_groups]
    candidates = [h for g in kept_kv for h in range(g * group_size, (g + 1) * group_size)]
    per_group = group_size - heads_per_group
    removal = greedy_remove(
        weight,
        inverse,
        [heads[h] for h in candidates],
        per_group * len(kept_kv),
        group_of=[h // group_size for h in candidates],
        quota={g: per_group for g in kept_kv},
    )
    gone_heads = {candidates[j] for j in removal.order}
    return kept_kv, [h for h in candidates if h not in gone_heads]


def obs_channels(weight: torch.Tensor, inverse: torch.Tensor, kept: int) -> list[int]:
    """The ``kept`` MLP channels (ascending) left by greedy single-column OBS; updates in place."""
    width = weight.shape[1]
    removal = greedy_remove(weight, inverse, [torch.tensor([c]) for c in range(width)], width - kept)
    gone = set(removal.order)
    return [c for c in range(width) if c not in gone]


def channel_greedy_bytes(width: int, out: int, removed: int) -> float:
    """The memory `greedy_remove` streams removing ``removed`` of ``width`` single columns of an (out, width)
    float64 weight (what the cost model prices it at): at step k one pass over the weight (its column norms and the
    rank-one update, the rows in cache between them) and column c of the deferred inverse, (width, k)."""
    return 8.0 * removed * (width * out + width * (removed - 1) / 2)
