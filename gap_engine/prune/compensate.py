"""Compensation maths: refit one block's output projections after some of their inputs are cut.

A head reaches the residual stream only through its columns of ``o_proj``, an MLP channel only
through its column of ``down_proj``. With the inputs ``x`` of such a projection (weight ``W``,
``d x n``) split into kept ``K`` and removed ``R`` features, the pruned projection gives
``W_K x_K``; the dense one gave ``W x_t``, where ``x_t = x`` when the target is the dense
weights on the pruned model's own inputs (``target="pruned"``) and ``x_t`` is the dense model's
own input at that projection otherwise. Over the calibration tokens, with moments
``G = sum x x^T``, ``C = sum x x_t^T``, means ``mu``, ``mu_t`` and ``N`` tokens:

- ``bias`` (FLAP, An et al. 2024) keeps ``W_K`` and adds ``b = W mu_t - W_K mu_K``: for the
  pruned target that is ``W_R mu_R``, FLAP's baseline bias.
- ``refit`` solves ``min ||W x_t - (W_K + D) x_K||^2 + lam N ||D||^2`` for the change ``D``:
  ``(G_KK / N + lam I) D^T = (C_K W^T - G_KK W_K^T) / N``, which for the pruned target is
  ``G_KR W_R^T / N`` (the update SlimGPT and SlimLLM end their layer-wise pruning with).
- ``bias+refit`` does the same on centred moments and sets the bias from the means.

The ridge is on the change, never on the weights: ``D = 0`` is always a candidate, so a fit
never increases the calibration reconstruction error, and a projection with nothing removed
is left exactly as it was. ``lam`` is ``damping`` times the mean diagonal of the system
matrix. Moments accumulate in float64 (float32 on MPS) and the solve is a Cholesky
factorisation in float64 on the moments' device (the host for MPS).

``fit_block`` collects the moments of one block (its attention first, then its MLP on the
inputs the compensated attention gives) and ``applied`` makes a block compute as pruned and
compensated without slicing it; ``prune.compensation_pass`` strings blocks together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gap_engine.core.errors import CompensationError, InvariantError
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.layerwise import BlockCall
from gap_engine.model.slicing import unit_rows, zeroed_units
from gap_engine.prune.compensations import COMPENSATIONS, CompensationSettings


# ---- moments ---------------------------------------------------------------------------------
@dataclass
class Moments:
    """First (and, for a refit, second) moments of one projection's input over the calibration tokens."""

    total: torch.Tensor  # (n,) sum of x (each token times its weight, as every sum here)
    count: int = 0  # tokens added
    weight_sum: float = 0.0  # their weights summed (the token count when every token weighs 1)
    gram: torch.Tensor | None = None  # (n, n) sum of x x^T; None: first moments only (a bias needs no more)
    target_total: torch.Tensor | None = None  # (n,) sum of x_t; None: the target reads x itself
    cross: torch.Tensor | None = None  # (n, n) sum of x x_t^T, with both a target stream and second moments

    @classmethod
    def zeros(cls, width: int, device: torch.device, with_target: bool = False, second: bool = True) -> Moments:
        """Empty moments of a width-``width`` input, accumulated in the widest float of ``device``
        (``second``: also the (n, n) products a refit solves with)."""
        dtype = torch.float32 if device.type == "mps" else torch.float64

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            total=zeros(width),
            gram=zeros(width, width) if second else None,
            target_total=zeros(width) if with_target else None,
            cross=zeros(width, width) if with_target and second else None,
        )

    def add(self, x: torch.Tensor, target: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        """Add tokens: ``x`` (tokens, n) and, with a target stream, its inputs ``target`` (tokens, n); each token
        counted ``weights`` (tokens,) times (None: once)."""
        x32 = x.float()  # the products in float32, summed in float64: each batch's sum stays accurate
        w = None if weights is None else weights.float().to(x32.device)[:, None]  # (tokens, 1)
        wx = x32 if w is None else x32 * w  # (tokens, n)
        self.total += wx.sum(0).to(self.total.dtype)
        self.count += x.shape[0]
        self.weight_sum += float(x.shape[0]) if w is None else float(w.sum())
        if self.gram is not None:
            self.gram += (wx.T @ x32).to(self.gram.dtype)
        if self.target_total is not None:
            if target is None:
                raise ValueError("moments with a target stream need the target's inputs")
            t32 = target.float()
            self.target_total += (t32 if w is None else t32 * w).sum(0).to(self.target_total.dtype)
            if self.cross is not None:
                self.cross += (wx.T @ t32).to(self.cross.dtype)


@dataclass(frozen=True)
class Fit:
    """A projection's compensation: new kept columns and/or a bias (None: unchanged, none)."""

    weight: torch.Tensor | None  # (d, k) the kept columns, in the projection's dtype
    bias: torch.Tensor | None  # (d,) added to the projection's output


NO_FIT = Fit(None, None)


@dataclass(frozen=True)
class BlockFit:
    """One block's compensation."""

    attn: Fit = NO_FIT  # o_proj over the kept heads' columns
    mlp: Fit = NO_FIT  # down_proj over the kept channels


# ---- the solvers (one per registered compensation) --------------------------------------------
@dataclass
class _System:
    """The moments of one fit, in float64 on the solving device, split into kept and removed."""

    weight: torch.Tensor  # (d, n) the dense weight
    kept: torch.Tensor  # (k,) kept input columns
    removed: torch.Tensor  # (r,) removed input columns
    count: int
    mean: torch.Tensor  # (n,) mean input
    mean_target: torch.Tensor  # (n,) mean target-stream input
    targeted: bool  # the target is another stream's input (else the pruned input x itself)
    gram: torch.Tensor | None  # (n, n) G / N (None: first moments only)
    cross: torch.Tensor | None  # (n, n) C / N, with a target stream and second moments

    @classmethod
    def of(cls, moments: Moments, weight: torch.Tensor, kept: torch.Tensor, what: str) -> _System:
        if moments.count < 1:
            raise CompensationError(f"{what}: no calibration tokens to compensate with")
        device = moments.total.device if moments.total.device.type != "mps" else torch.device("cpu")
        n = moments.total.shape[0]
        kept = kept.to(device)
        mask = torch.ones(n, dtype=torch.bool, device=device)
        mask[kept] = False
        count = moments.count
        total_weight = moments.weight_sum
        if not total_weight > 0:
            raise CompensationError(f"{what}: the calibration tokens' weights sum to {total_weight:g}, so there is nothing to fit")

        def scaled(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, torch.float64) / total_weight

        mean = moments.total.to(device, torch.float64) / total_weight
        return cls(
            weight.detach().to(device, torch.float64),
            kept,
            torch.nonzero(mask).flatten(),
            count,
            mean,
            mean if moments.target_total is None else moments.target_total.to(device, torch.float64) / total_weight,
            moments.target_total is not None,
            scaled(moments.gram),
            scaled(moments.cross),
        )

    @property
    def untouched(self) -> bool:
        """Nothing removed and the target is the pruned stream itself: the fit is the identity."""
        return self.removed.numel() == 0 and not self.targeted

    def rhs(self, centred: bool) -> torch.Tensor:
        """(k, d): what the change of the kept weights must explain, ``(C_K W^T - G_KK W_K^T)``."""
        k, r = self.kept, self.removed
        w_k = self.weight[:, k]  # (d, k)
        if self.gram is None or (self.targeted and self.cross is None):
            raise ValueError("a refit needs second moments")
        if self.cross is None:  # x_t = x: only the removed columns' share is left (no cancellation)
            block = self.gram[k][:, r]  # (k, r)
            if centred:
                block = block - torch.outer(self.mean[k], self.mean[r])
            return block @ self.weight[:, r].T
        cross, gram = self.cross[k], self.gram[k][:, k]
        if centred:
            cross = cross - torch.outer(self.mean[k], self.mean_target)
            gram = gram - torch.outer(self.mean[k], self.mean[k])
        return cross @ self.weight.T - gram @ w_k.T

    def solve(self, centred: bool, damping: float, what: str) -> torch.Tensor:
        """(d, k): the kept columns after the refit."""
        k = self.kept
        if self.gram is None:
            raise ValueError("a refit needs second moments")
        system = self.gram[k][:, k]
        if centred:
            system = system - torch.outer(self.mean[k], self.mean[k])
        energy = float(torch.diagonal(system).mean()) if k.numel() else 0.0
        if not energy > 1e-30:
            raise CompensationError(
                f"{what}: the calibration inputs of the kept units are all zero, so the least-squares system is singular"
            )
        system = system + damping * energy * torch.eye(k.numel(), dtype=system.dtype, device=system.device)
        factor, info = torch.linalg.cholesky_ex(system)
        if int(info) != 0:
            raise CompensationError(f"{what}: the least-squares system is singular (its factorisation failed)")
        change = torch.cholesky_solve(self.rhs(centred), factor)  # (k, d)
        return self.weight[:, k] + change.T

    def bias(self, kept_weight: torch.Tensor) -> torch.Tensor:
        """(d,): ``W mu_t - W_K' mu_K``, the mean of what the kept weights still miss."""
        return self.weight @ self.mean_target - kept_weight @ self.mean[self.kept]


def _fit(moments: Moments, weight: torch.Tensor, kept: torch.Tensor, damping: float, what: str, refit: bool, bias: bool) -> Fit:
    """The registered solvers' shared body: ``refit`` the kept columns and/or add a ``bias``."""
    system = _System.of(moments, weight, kept, what)
    if system.untouched:
        return NO_FIT
    kept_weight = system.solve(centred=bias, damping=damping, what=what) if refit else system.weight[:, system.kept]
    return Fit(
        weight=kept_weight.to(weight.device, weight.dtype) if refit else None,
        bias=system.bias(kept_weight).to(weight.device, weight.dtype) if bias else None,
    )


def keep_fit(moments: Moments, weight: torch.Tensor, kept: torch.Tensor, damping: float, what: str) -> Fit:
    """``none``: nothing changes."""
    return NO_FIT


def bias_fit(moments: Moments, weight: torch.Tensor, kept: torch.Tensor, damping: float, what: str) -> Fit:
    """``bias``: the kept columns as they are, plus the bias that restores the mean output.

    Args:
        moments: the projection's input moments (and the target stream's, when it has one).
        weight: (d, n) the dense weight, all columns.
        kept: (k,) the kept input columns, ascending.
        damping: unused (no system is solved).
        what: names the projection in errors ("block 3 o_proj").
    """
    return _fit(moments, weight, kept, damping, what, refit=False, bias=True)


def refit_fit(moments: Moments, weight: torch.Tensor, kept: torch.Tensor, damping: float, what: str) -> Fit:
    """``refit``: the kept columns refit by damped least squares, no bias (arguments as ``bias_fit``).

    Raises:
        CompensationError: the kept inputs are all zero (a singular system).
    """
    return _fit(moments, weight, kept, damping, what, refit=True, bias=False)


def bias_refit_fit(moments: Moments, weight: torch.Tensor, kept: torch.Tensor, damping: float, what: str) -> Fit:
    """``bias+refit``: the refit on centred moments, and the bias from the means (arguments as ``bias_fit``)."""
    return _fit(moments, weight, kept, damping, what, refit=True, bias=True)


Solver = Callable[[Moments, torch.Tensor, torch.Tensor, float, str], Fit]


def solver_for(settings: CompensationSettings) -> Solver:
    """The registered solver of ``settings.mode``."""
    return cast(Solver, COMPENSATIONS.function(settings.mode))


# ---- one block ---------------------------------------------------------------------------------
def kept_columns(n_units: int, width: int, removed: Sequence[int]) -> torch.Tensor:
    """Input columns of the units not in ``removed`` (each unit owns ``width`` columns), ascending."""
    return unit_rows(torch.tensor(sorted(set(range(n_units)) - set(removed)), dtype=torch.long), width)


@contextlib.contextmanager
def applied(adapter: ArchitectureAdapter, layer: nn.Module, heads: Sequence[int], channels: Sequence[int], fit: BlockFit) -> Iterator[None]:
    """The block computes as pruned and compensated for the duration, without being sliced.

    The removed units' columns are zeroed (``slicing.zeroed_units``), the kept columns take the
    fit's weights and the fit's biases are added to the projections' outputs; every weight is
    restored exactly on exit.
    """
    geom = adapter.geometry(layer)
    _, _, _, o_proj = adapter.attention_projections(layer)
    _, _, down_proj = adapter.mlp_projections(layer)
    parts = (
        (o_proj, fit.attn, kept_columns(geom.n_heads, geom.head_dim, heads)),
        (down_proj, fit.mlp, kept_columns(geom.intermediate_size, 1, channels)),
    )
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    handles = []
    with zeroed_units(adapter, layer, tuple(heads), tuple(channels)), torch.no_grad():
        try:
            for linear, part, columns in parts:
                if part.weight is not None:
                    cols = columns.to(linear.weight.device)
                    saved.append((linear.weight, cols, linear.weight[:, cols].clone()))
                    linear.weight[:, cols] = part.weight.to(linear.weight.device, linear.weight.dtype)
                if part.bias is not None:
                    handles.append(linear.register_forward_hook(_adds(part.bias)))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for weight, cols, values in saved:
                weight[:, cols] = values


def _adds(bias: torch.Tensor) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + bias.to(output.device, output.dtype)

    return hook


class _Captured(Exception):
    """Raised by a capture hook once it has a projection's input: the rest of the block is not needed."""


def _capture_inputs(
    layer: nn.Module, linear: nn.Linear, states: Sequence[torch.Tensor], calls: Sequence[BlockCall], device: torch.device, skip: int
) -> Iterator[torch.Tensor]:
    """Per batch, the (tokens, n) inputs of ``linear`` when ``layer`` runs on that batch's states
    (the block stops there); the first ``skip`` positions of every window are left out."""
    found: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0][:, skip:]  # (B, T-skip, n)
        found.append(x.reshape(-1, x.shape[-1]))
        raise _Captured

    handle = linear.register_forward_pre_hook(hook)
    try:
        for b, hidden in enumerate(states):
            args, kwargs = calls[b]
            with contextlib.suppress(_Captured):
                layer(hidden.to(device), *args, **kwargs)
            yield found.pop()
    finally:
        handle.remove()


@dataclass
class BlockInputs:
    """What fitting one block reads: per batch, its input states and how it is called."""

    states: Sequence[torch.Tensor]  # [b] (B, T, d) hidden states entering the block
    calls: Sequence[BlockCall]  # [b] its other arguments
    device: torch.device  # where the block runs
    skip: int = 0  # leading non-text positions of every window, left out of the moments
    targets: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None  # [b] (o_proj, down_proj) inputs of the dense stream


@torch.no_grad()
def fit_block(
    adapter: ArchitectureAdapter,
    layer: nn.Module,
    index: int,
    inputs: BlockInputs,
    heads: Sequence[int],
    channels: Sequence[int],
    settings: CompensationSettings,
) -> BlockFit:
    """The compensation of one block whose ``heads`` and ``channels`` are removed.

    The attention is fitted first, on the block's inputs; the MLP is then fitted on the inputs
    it receives once the attention is pruned and compensated (a block with nothing removed
    from a part leaves that part as it is).

    Args:
        adapter, layer: the block (dense: no unit sliced yet), on ``inputs.device``.
        index: its position, for messages.
        inputs: the states entering it (the pruned stream) and, for the dense target, the
            dense stream's inputs of its two projections.
        heads, channels: the removed units, as ``surgery.plan_units`` gives them.
        settings: the compensation.
    Raises:
        CompensationError: a singular system.
    """
    if not settings.active or (not heads and not channels):
        return BlockFit()
    solve = solver_for(settings)
    geom = adapter.geometry(layer)
    _, _, _, o_proj = adapter.attention_projections(layer)
    _, _, down_proj = adapter.mlp_projections(layer)
    fit = BlockFit()
    for part, linear, n_units, width, removed in (
        (adapter.output_name, o_proj, geom.n_heads, geom.head_dim, heads),
        (adapter.down_name, down_proj, geom.intermediate_size, 1, channels),
    ):
        if not removed:
            continue
        attention = linear is o_proj
        target = None if inputs.targets is None else [t[0 if attention else 1] for t in inputs.targets]
        moments = Moments.zeros(linear.in_features, inputs.device, with_target=target is not None, second=settings.refits)
        weigh = output_norm_weights(adapter, layer, linear, attention, index) if settings.weighted else None
        with applied(adapter, layer, heads, (), fit):  # the MLP sees the compensated attention
            for b, x in enumerate(_capture_inputs(layer, linear, inputs.states, inputs.calls, inputs.device, inputs.skip)):
                aimed = None if target is None else target[b].to(x.device)
                moments.add(x, aimed, None if weigh is None else weigh(x if aimed is None else aimed))
        solved = solve(moments, linear.weight, kept_columns(n_units, width, removed), float(settings.damping), f"block {index} {part}")
        fit = BlockFit(solved, fit.mlp) if attention else BlockFit(fit.attn, solved)
    return fit


def check_weighting(adapter: ArchitectureAdapter, settings: CompensationSettings) -> None:
    """CompensationError (one line) for the output-norm weighting on a family that adds its projections' outputs to
    the residual stream as they are: there the error before the norm is the error, and plain token counts are right."""
    if settings.weighted and not any(adapter.output_norm_names):
        raise CompensationError(
            f"the output-norm weighting fits through the norms after o_proj and down_proj, and {adapter.family} "
            "blocks have none (Gemma 3's post-norms); weigh tokens alike (weighting tokens)"
        )


def output_norm_weights(
    adapter: ArchitectureAdapter, layer: nn.Module, linear: nn.Linear, attention: bool, index: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-token weights for a projection whose output a norm rescales (``weighting="output-norm"``).

    An RMS norm maps a token's output ``y`` to ``g * y / rms(y)``, so an error ``e`` in ``y`` reaches the
    residual as about ``g * e / rms(y)``: a token weighs ``1 / (mean(y^2) + eps)``, ``y`` the dense weights'
    output on the token's target input. The norm's gain ``g`` scales each output row alike for every token,
    and each row of a fit is solved apart, so it drops out. The weights are read from the dense weights
    now, before ``applied`` zeroes any column.
    """
    norm = adapter.output_norm(layer, attention)
    if norm is None:
        raise InvariantError(f"block {index}: no norm follows the output projection ({check_weighting.__name__} lets none through)")
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    dense = linear.weight.detach().float().clone()  # (d, n)

    def weights(inputs: torch.Tensor) -> torch.Tensor:
        y = inputs.float() @ dense.to(inputs.device).T  # (tokens, d)
        return 1.0 / (y.square().mean(-1) + eps)  # (tokens,)

    return weights
