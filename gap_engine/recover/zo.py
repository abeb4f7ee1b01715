"""Zeroth-order recovery maths: MeZO's two-point SPSA step and MaZO's multi-task update mask.

MeZO (Malladi et al., "Fine-Tuning Language Models with Just Forward Passes", NeurIPS 2023)
estimates the gradient from two forward passes: with a random direction ``z ~ N(0, I)``,
``g = (L(θ + εz) - L(θ - εz)) / 2ε`` is the directional derivative along ``z`` and the update
is ``θ <- θ - lr · g · z``. ``z`` is never stored: it is regenerated from a per-step seed each
time it is needed, so training memory stays at inference level.

MaZO (Zhang et al., "MaZO: Masked Zeroth-Order Optimization for Multi-Task Fine-Tuning of
Large Language Models", EMNLP 2025) perturbs and updates only the weights that matter for the
tasks at hand, which lowers the dimension of the random search (a ZO step is slower than a
gradient step roughly in proportion to that dimension) and keeps tasks from fighting over the
same weights. Implemented here from the paper's description:

* per task (one text source), a gradient-free importance of every weight: Wanda's
  ``|W_ij| · ||X_j||`` (Sun et al. 2023; the square root of OBS's saliency with the diagonal
  Hessian ``X Xᵀ``), where ``||X_j||`` is the norm of input feature ``j`` over that task's
  calibration tokens, from forward passes only;
* combined with weight magnitude, ``S_t = rownorm(|W| · ||X||_t) + β · rownorm(|W|)``, each term
  normalised to sum 1 per row so that tasks with louder activations do not dominate;
* summed over tasks, ``S = Σ_t S_t``; every row keeps its top-k entries (``k = fraction · in``).

Entries per row rather than whole rows, as in the paper: every output unit keeps some trainable
inputs, so no neuron is frozen outright. The mask is stored as the kept column indices of each
row, ``(rows, k)`` in int16 (int32 for inputs wider than 32767): ``2 · fraction`` bytes per
weight instead of a boolean's one byte, which is what keeps MaZO near inference memory.

The perturbation is applied to one projection at a time, in a forward pre-hook just before the
projection runs, and undone in its forward hook by copying the saved values back. The forward
pass sees ``θ ± εz`` exactly as in MeZO's in-place version, at most one projection's ``z`` and
saved values are alive at once, and restoring is a copy, so the weights come back bit-identical
(MeZO's ``+εz, -2εz, +εz`` arithmetic drifts by rounding). Both ZO methods train the attention
and MLP projections only (MeZO proper also perturbs embeddings and norms); the comparison between
them then differs in the mask alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gap_engine.core.progress import steps

log = logging.getLogger(__name__)

_INT16_COLUMNS = 32767  # the widest input whose column indices fit int16


@dataclass
class ZOTarget:
    """One projection the zeroth-order step perturbs and updates."""

    name: str  # module path inside the model, e.g. "model.layers.3.self_attn.q_proj"
    linear: nn.Linear
    columns: torch.Tensor | None = None  # (rows, k) kept column indices per row; None: every entry

    @property
    def updated_params(self) -> int:
        weight = self.linear.weight
        return weight.numel() if self.columns is None else self.columns.numel()

    def trainable_values(self) -> torch.Tensor:
        """The values the step changes: (rows, k) for a mask, the whole weight otherwise.

        Unmasked, this is the weight itself (no copy: a snapshot of every projection would
        double MeZO's memory for a moment); read it before the next step changes it.
        """
        weight = self.linear.weight.detach()
        if self.columns is None:
            return weight
        return weight.gather(1, self.columns.long())  # (rows, k)

    def load_values(self, values: torch.Tensor) -> None:
        """Write values saved by :meth:`trainable_values` back into the weight."""
        weight = self.linear.weight
        with torch.no_grad():
            if self.columns is None:
                weight.copy_(values.to(weight.device, weight.dtype))
            else:
                weight.scatter_(1, self.columns.long(), values.to(weight.device, weight.dtype))


# ---- seeds and directions ------------------------------------------------------------------
def step_seed(seed: int, step: int) -> int:
    """The seed of one step: every random choice of the step derives from (seed, step) alone,
    so a resumed run draws exactly what an uninterrupted one would."""
    state = np.random.SeedSequence([int(seed), int(step)]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


# A direction on the CPU is drawn in pieces of this many values, each from a generator of its
# own: torch's CPU normal sampler runs on one core (about 8 ns a value here, so MeZO's three
# draws of every projection cost about as much as a forward pass), and independent pieces let
# every torch thread draw at once. The pieces depend on (step, matrix, piece) only, never on
# the thread count, so a run draws the same z on one core or sixteen. Small enough that the
# MLP matrices of the smallest built-in model split into ~14 pieces, large enough that seeding
# a generator (microseconds) is noise next to drawing the piece (half a millisecond).
DIRECTION_PIECE = 1 << 16
_MASK64 = 2**64 - 1
_piece_pool: ThreadPoolExecutor | None = None
_piece_pool_key: tuple[int, int] = (0, 0)  # (process id, workers) the pool was made for


def _matrix_seed(target_index: int, seed_of_step: int) -> int:
    state = np.random.SeedSequence([seed_of_step, target_index]).generate_state(1, np.uint64)[0]
    return int(state)


def _piece_seed(matrix_seed: int, piece: int) -> int:
    """SplitMix64 of (matrix seed + piece): well-mixed, distinct seeds per piece for a few
    hundred nanoseconds of Python instead of a SeedSequence's ~20 microseconds."""
    x = (matrix_seed + 0x9E3779B97F4A7C15 * (piece + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & (2**63 - 1)


_thread_generators = threading.local()  # one CPU generator per drawing thread, reseeded per piece


def _cpu_generator(seed: int) -> torch.Generator:
    generator = getattr(_thread_generators, "generator", None)
    if generator is None:
        generator = _thread_generators.generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per process, remade when torch's thread count changes or after a fork (a
    forked child inherits the pool object but not its threads: work sent to it never runs)."""
    global _piece_pool, _piece_pool_key
    key = (os.getpid(), workers)
    if _piece_pool is None or _piece_pool_key != key:
        if _piece_pool is not None and _piece_pool_key[0] == key[0]:
            _piece_pool.shutdown(wait=True)
        _piece_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gap-zo-direction")
        _piece_pool_key = key
    return _piece_pool


def _direction_shape(target: ZOTarget) -> tuple[int, ...]:
    return tuple(target.linear.weight.shape) if target.columns is None else tuple(target.columns.shape)


def direction(target_index: int, target: ZOTarget, seed_of_step: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The random direction ``z`` of one projection at one step, regenerated identically on
    every call: (rows, k) for a masked projection, the weight's shape otherwise, in the weight's
    dtype. ``out``: a contiguous buffer of that shape and dtype to draw into (no allocation).

    On the CPU, ``z`` is the concatenation of independently seeded pieces of
    ``DIRECTION_PIECE`` values drawn by torch's threads in parallel; on an accelerator, one draw
    from the device's generator (so the same seed gives another ``z`` there: runs resume on the
    device they started on)."""
    weight = target.linear.weight
    shape = _direction_shape(target)
    if out is None:
        out = torch.empty(shape, device=weight.device, dtype=weight.dtype)
    flat = out.view(-1)
    count = flat.numel()
    matrix_seed = _matrix_seed(target_index, seed_of_step)
    if weight.device.type != "cpu":
        generator = torch.Generator(device=weight.device)
        generator.manual_seed(_piece_seed(matrix_seed, 0))
        torch.randn((count,), generator=generator, device=weight.device, dtype=weight.dtype, out=flat)
        return out
    starts = range(0, count, DIRECTION_PIECE)

    def draw(worker_starts: range) -> None:
        for start in worker_starts:
            generator = _cpu_generator(_piece_seed(matrix_seed, start // DIRECTION_PIECE))
            piece = flat[start : start + DIRECTION_PIECE]
            torch.randn(piece.shape, generator=generator, dtype=weight.dtype, out=piece)

    workers = min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        draw(starts)
    else:  # every n-th piece per worker: one task per worker and matrix, not one per piece
        list(_pool(workers).map(draw, [starts[w::workers] for w in range(workers)]))
    return out


class Workspace:
    """Scratch tensors sized once for the largest target, reused by every perturbation and
    update: a ZO step allocates nothing the size of a weight matrix (MeZO's clone and ``z`` per
    projection and pass were the bulk of its overhead besides drawing ``z``)."""

    def __init__(self, targets: list[ZOTarget]):
        weight = targets[0].linear.weight
        largest = max(math.prod(_direction_shape(t)) for t in targets)
        self.z = torch.empty(largest, dtype=weight.dtype, device=weight.device)
        self.saved = torch.empty(largest, dtype=weight.dtype, device=weight.device)
        widest_mask = max((t.columns.numel() for t in targets if t.columns is not None), default=0)
        self.columns = torch.empty(widest_mask, dtype=torch.long, device=weight.device)

    def views(self, target: ZOTarget) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(z, saved, int64 column indices or None) shaped for ``target``."""
        shape = _direction_shape(target)
        count = math.prod(shape)
        columns = None
        if target.columns is not None:
            columns = self.columns[:count].view(shape)
            columns.copy_(target.columns)  # int16 -> int64 in place: scatter and gather want int64
        return self.z[:count].view(shape), self.saved[:count].view(shape), columns


@contextlib.contextmanager
def perturbed(
    model: nn.Module, targets: list[ZOTarget], seed_of_step: int, scale: float, workspace: Workspace | None = None
) -> Iterator[None]:
    """Inside, each target projection computes with ``W + scale · z`` (its own ``z`` of this step).

    The shift is applied just before the projection runs and undone right after by copying the
    saved values back, so at most one projection's ``z`` is alive and the weights are restored
    bit for bit, also when the forward pass raises. Only the masked entries are read, shifted
    and written back.
    """
    workspace = workspace or Workspace(targets)
    active: list[int] = []  # the target whose shift is in place (at most one)
    handles = []

    def restore() -> None:
        index = active.pop()
        target = targets[index]
        _, saved, columns = workspace.views(target)
        weight = target.linear.weight
        with torch.no_grad():
            if columns is None:
                weight.copy_(saved)
            else:
                weight.scatter_(1, columns, saved)

    def make_pre_hook(index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if active:
                raise RuntimeError(f"{targets[index].name} ran while {targets[active[0]].name} was still perturbed")
            target = targets[index]
            weight = target.linear.weight
            z, saved, columns = workspace.views(target)
            direction(index, target, seed_of_step, out=z)
            with torch.no_grad():
                if columns is None:
                    saved.copy_(weight)
                    active.append(index)
                    weight.add_(z, alpha=scale)
                else:
                    torch.gather(weight, 1, columns, out=saved)  # (rows, k)
                    active.append(index)
                    weight.scatter_(1, columns, z.mul_(scale).add_(saved))

        return pre_hook

    def post_hook(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        restore()

    try:
        for index, target in enumerate(targets):
            handles.append(target.linear.register_forward_pre_hook(make_pre_hook(index)))
            handles.append(target.linear.register_forward_hook(post_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
        while active:
            restore()


def apply_update(targets: list[ZOTarget], seed_of_step: int, coefficient: float, workspace: Workspace | None = None) -> None:
    """``W += coefficient · z`` on the masked entries of every target (z regenerated)."""
    if coefficient == 0.0:
        return
    workspace = workspace or Workspace(targets)
    with torch.no_grad():
        for index, target in enumerate(targets):
            z, _, columns = workspace.views(target)
            direction(index, target, seed_of_step, out=z)
            weight = target.linear.weight
            if columns is None:
                weight.add_(z, alpha=coefficient)
            else:
                weight.scatter_add_(1, columns, z.mul_(coefficient))


@dataclass(frozen=True)
class ZOStepResult:
    loss_plus: float  # loss at θ + εz
    loss_minus: float  # loss at θ - εz
    projected_grad: float  # (loss_plus - loss_minus) / 2ε

    @property
    def loss(self) -> float:
        """The step's loss as MeZO reports it: the mean of the two evaluations."""
        return 0.5 * (self.loss_plus + self.loss_minus)


def zo_step(
    model: nn.Module,
    targets: list[ZOTarget],
    loss_fn: Callable[[], float],
    seed_of_step: int,
    eps: float,
    lr: float,
    workspace: Workspace | None = None,
) -> ZOStepResult:
    """One two-point SPSA step on the same batch: loss at ``θ + εz`` and ``θ - εz``, then
    ``θ <- θ - lr · g · z`` on the masked entries. ``loss_fn`` runs the model's forward pass
    and returns the loss as a float; ``workspace`` is reused across steps when given."""
    workspace = workspace or Workspace(targets)
    with torch.no_grad():
        with perturbed(model, targets, seed_of_step, eps, workspace):
            loss_plus = float(loss_fn())
        with perturbed(model, targets, seed_of_step, -eps, workspace):
            loss_minus = float(loss_fn())
    projected_grad = (loss_plus - loss_minus) / (2.0 * eps)
    apply_update(targets, seed_of_step, -lr * projected_grad, workspace)
    return ZOStepResult(loss_plus, loss_minus, projected_grad)


# ---- MaZO's importance and mask ------------------------------------------------------------
class _InputNorms:
    """Sum over tokens of the squared input of one linear layer, per input feature."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.sum_sq = torch.zeros(width, dtype=torch.float64, device=device)

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()
        self.sum_sq += x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)  # (in,)


@torch.no_grad()
def input_feature_norms(model: nn.Module, linears: list[nn.Linear], windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """``||X_j||`` (L2 over all tokens of ``windows``) of every input feature of every linear.

    Args:
        windows: (N, T) token ids of one task (the active stage's cancel polled before every batch).
    Returns:
        One (in_features,) float64 tensor per linear, in the order given.
    """
    device = linears[0].weight.device
    stats = [_InputNorms(lin.in_features, device) for lin in linears]
    handles = [lin.register_forward_pre_hook(stat) for lin, stat in zip(linears, stats)]
    try:
        for start in steps(range(0, windows.shape[0], batch_size), "weight importance", "batches", quiet=True):
            model(input_ids=windows[start : start + batch_size].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [stat.sum_sq.sqrt() for stat in stats]


def _row_normalised(scores: torch.Tensor) -> torch.Tensor:
    return scores / scores.sum(1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)  # (rows, in)


def mask_columns(weight: torch.Tensor, task_norms: list[torch.Tensor], fraction: float, magnitude_weight: float) -> torch.Tensor:
    """MaZO's update mask of one weight matrix: the top-k columns of every row.

    Args:
        weight: (rows, in) the projection's weight.
        task_norms: per task, (in,) input-feature norms ``||X_j||`` on that task's text.
        fraction: share of each row's entries to keep, in (0, 1].
        magnitude_weight: β, the weight of the magnitude term in each task's score.
    Returns:
        (rows, k) kept column indices, ascending per row, int16 (int32 for wide inputs).
    """
    magnitude = weight.detach().abs().float()  # (rows, in)
    score = magnitude_weight * len(task_norms) * _row_normalised(magnitude)
    for norms in task_norms:
        score += _row_normalised(magnitude * norms.to(magnitude.device, torch.float32)[None, :])
    k = max(1, min(weight.shape[1], round(fraction * weight.shape[1])))
    columns = torch.topk(score, k, dim=1, sorted=False).indices.sort(dim=1).values  # (rows, k)
    return columns.to(torch.int16 if weight.shape[1] <= _INT16_COLUMNS else torch.int32)
