"""Loss tables estimated from one forward and backward pass: ``taylor`` and ``fisher``.

A multiplicative mask m (all ones) sits on every head and channel, one mask per window.
With g_n the gradient of window n's mean objective with respect to the masks:

* first order (``taylor``): removing a set S changes the loss by about
  ``-sum_{u in S} G_u``, with ``G = mean_n g_n`` (gradient with the real next tokens);
* second order (``fisher``): adds ``0.5 * sum_{u in S} F_u``, the diagonal of the Fisher
  information as a Hessian estimate. F is the *true* Fisher, computed from labels sampled
  from the dense model's own next-token distribution: per-position score vectors then
  have zero mean given the context, so the cross terms between positions vanish and
  ``F_u = T * mean_n (g'_nu)^2`` (T predicted positions per window; g' the gradient of
  window n's mean sampled-label NLL) is an unbiased estimate of the Fisher of the mean
  per-token objective: the Hessian of the KL objective at the dense model, and the
  Gauss-Newton approximation of the NLL's Hessian. For the ``kl`` objective the
  first-order term is exactly zero (the dense model is KL's minimum), so only ``fisher``
  is defined there. Units are chosen by the same ``layer_selection`` as the exact path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import cpu_float64, input_device, is_streamed, placement_of
from gap_engine.core.progress import GRADIENT_PASS, EtaClock, active, steps
from gap_engine.data.bos import next_token_nll, text_start
from gap_engine.data.windows import batches
from gap_engine.model.adapters import ArchitectureAdapter, LayerGeometry
from gap_engine.model.finite import NonFiniteMeasurement
from gap_engine.model.layerwise import backward_blocks
from gap_engine.model.loaded import LoadedModel
from gap_engine.prune.importance import ImportanceScores
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.cells import Cut, objective_positions, unit_cuts
from gap_engine.tables.ledger import BuildStats, CellObjectives, CellRequest

GateHook = Callable[[nn.Module, tuple[Any, ...]], "tuple[Any, ...] | None"]  # a forward pre-hook on a projection


@dataclass
class _Masks:
    """The unit masks the gates read, per block: (B, H) heads and (B, I) channels; None: no gate."""

    heads: list[torch.Tensor | None]
    channels: list[torch.Tensor | None]


def _install_gates(
    adapter: ArchitectureAdapter, layers: list[nn.Module], geoms: list[LayerGeometry], masks: _Masks
) -> list[torch.utils.hooks.RemovableHandle]:
    """Pre-hooks that multiply every head's o_proj input and every channel's down_proj input
    by its mask, read from ``masks.heads[layer]`` (B, H) and ``masks.channels[layer]`` (B, I)."""

    def head_gate(index: int) -> GateHook:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            mask = masks.heads[index]  # (B, H); None: no gate (a streamed pass's forward sweep)
            if mask is None:
                return None
            gate = mask.repeat_interleave(geoms[index].head_dim, dim=1)[:, None, :]  # (B, 1, H*D)
            return ((args[0] * gate).to(args[0].dtype),) + tuple(args[1:])  # float32 masks, model-dtype activations

        return hook

    def channel_gate(index: int) -> GateHook:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            mask = masks.channels[index]  # (B, I)
            if mask is None:
                return None
            return ((args[0] * mask[:, None, :]).to(args[0].dtype),) + tuple(args[1:])  # (B, T, I)

        return hook

    handles: list[torch.utils.hooks.RemovableHandle] = []
    for i, layer in enumerate(layers):
        handles.append(adapter.attention_projections(layer)[3].register_forward_pre_hook(head_gate(i)))
        handles.append(adapter.mlp_projections(layer)[2].register_forward_pre_hook(channel_gate(i)))
    return handles


class _GradientSums:
    """What the gradient pass accumulates: per block, float64 sums over windows of the mask
    gradients (stream "grad": first order) and of their squares (stream "fisher")."""

    def __init__(self, geoms: list[LayerGeometry], streams: list[str], per_window: bool = False):
        self.streams = streams
        # per block, stream by stream, every batch's (B, H) and (B, I) gradients (squared for "fisher"), kept when asked
        self.windows: list[dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] | None = (
            [{stream: [] for stream in streams} for _ in geoms] if per_window else None
        )
        self.grad_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
        self.grad_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
        self.fisher_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
        self.fisher_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
        self.dense_sum = 0.0

    def add(self, stream: int, layer: int, heads: torch.Tensor, channels: torch.Tensor) -> None:
        """One batch's (B, H) and (B, I) mask gradients of block ``layer``, stream index ``stream``."""
        heads, channels = cpu_float64(heads), cpu_float64(channels)
        if self.streams[stream] == "grad":
            self.grad_heads[layer] += heads.sum(0)
            self.grad_channels[layer] += channels.sum(0)
        else:
            heads, channels = heads**2, channels**2
            self.fisher_heads[layer] += heads.sum(0)
            self.fisher_channels[layer] += channels.sum(0)
        if self.windows is not None:
            self.windows[layer][self.streams[stream]].append((heads, channels))

    def head_losses(
        self, logits: torch.Tensor, batch: torch.Tensor, start: int, objective: str, generator: torch.Generator
    ) -> list[torch.Tensor]:
        """The scalar losses whose mask gradients the streams need, for one batch's logits.

        "grad": each window's mean NLL of its real next tokens, summed over windows (so each
        window's gradient lands in its own mask row); "fisher": the same with labels sampled
        from the dense model's own distribution. Also adds the batch's real NLL to ``dense_sum``.
        """
        n, logits = batch.shape[0], logits.float()  # (B, T, V)
        vocab = logits.shape[-1]
        if not bool(torch.isfinite(logits).all()):  # sampling labels from NaN probabilities would fail inside torch
            raise NonFiniteMeasurement("the dense model's logits on the calibration windows are not all finite")
        real = next_token_nll(logits, batch, start)  # (B, T-1-start)
        self.dense_sum += float(real.detach().double().sum())
        losses: list[torch.Tensor] = []
        for stream in self.streams:
            if stream == "grad":
                losses.append(real.mean(1).sum())
                continue
            used = logits[:, start:] if objective == "kl" else logits[:, start:-1]  # (B, T', V)
            probs = F.softmax(used.detach(), dim=-1).reshape(-1, vocab)  # (B*T', V)
            sampled = torch.multinomial(probs, 1, generator=generator).view(n, -1)  # (B, T')
            nll = F.cross_entropy(used.reshape(-1, vocab), sampled.reshape(-1), reduction="none").view(n, -1)
            losses.append(nll.mean(1).sum())
        return losses


def _mask_gradients(
    lm: LoadedModel, spec: TableSpec, windows: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], float]:
    """Per-unit mean gradients G and diagonal Fisher F of the mean objective wrt unit masks.

    A streamed model gets the same sums from a block-by-block backward pass
    (``layerwise.backward_blocks``); a resident one from one backward pass per batch.

    Returns:
        (G_heads, G_channels, F_heads, F_channels, dense_objective); lists over blocks of
        float64 tensors (n_heads,) and (intermediate_size,). G is zero for the kl objective
        and F is zero for the taylor method.
    """
    sums, start = _gradient_pass(lm, spec, windows), text_start(lm.tokenizer, windows)
    n_windows = windows.shape[0]
    t_fisher = objective_positions(windows, spec.objective, start) // n_windows
    for acc in sums.grad_heads + sums.grad_channels:
        acc /= n_windows
    for acc in sums.fisher_heads + sums.fisher_channels:
        acc *= t_fisher / n_windows
    dense = sums.dense_sum / objective_positions(windows, "nll", start) if spec.objective == "nll" else 0.0
    return sums.grad_heads, sums.grad_channels, sums.fisher_heads, sums.fisher_channels, dense


def _gradient_pass(lm: LoadedModel, spec: TableSpec, windows: torch.Tensor, per_window: bool = False) -> _GradientSums:
    """The mask gradients' sums over ``windows`` (and each window's own, with ``per_window``)."""
    layers = list(lm.adapter.layers(lm.model))
    geoms = [lm.adapter.geometry(layer) for layer in layers]
    streams = (["grad"] if spec.objective == "nll" else []) + (["fisher"] if spec.estimator == "fisher" else [])
    sums = _GradientSums(geoms, streams, per_window)
    device = input_device(lm.model)
    # Labels are sampled on the model's device: another device draws other labels (same distribution).
    generator = torch.Generator(device=device).manual_seed(spec.windows.seed)
    start = text_start(lm.tokenizer, windows)  # a leading BOS position is never counted
    masks = _Masks([None] * len(layers), [None] * len(layers))
    handles = _install_gates(lm.adapter, layers, geoms, masks)
    try:
        if is_streamed(lm):
            _streamed_pass(lm, spec, windows, sums, masks, geoms, start, generator)
        else:
            _resident_pass(lm, spec, windows, sums, masks, geoms, start, generator)
    finally:
        for handle in handles:
            handle.remove()
    return sums


def _resident_pass(
    lm: LoadedModel,
    spec: TableSpec,
    windows: torch.Tensor,
    sums: _GradientSums,
    masks: _Masks,
    geoms: list[LayerGeometry],
    start: int,
    generator: torch.Generator,
) -> None:
    """One forward and backward pass per batch through the whole model on its device."""
    device = input_device(lm.model)
    for batch in steps(batches(windows, spec.windows.batch_size), "loss table estimate", "batches", timed=True):
        n, batch = batch.shape[0], batch.to(device)
        heads = [torch.ones(n, g.n_heads, device=device, requires_grad=True) for g in geoms]
        channels = [torch.ones(n, g.intermediate_size, device=device, requires_grad=True) for g in geoms]
        masks.heads, masks.channels = list(heads), list(channels)
        leaves = heads + channels
        with torch.enable_grad():
            logits = lm.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
            losses = sums.head_losses(logits, batch, start, spec.objective, generator)
            for s, loss in enumerate(losses):
                grads = torch.autograd.grad(loss, leaves, retain_graph=s + 1 < len(losses))
                for layer in range(len(geoms)):
                    sums.add(s, layer, grads[layer], grads[len(geoms) + layer])
        del logits


def _streamed_pass(
    lm: LoadedModel,
    spec: TableSpec,
    windows: torch.Tensor,
    sums: _GradientSums,
    masks: _Masks,
    geoms: list[LayerGeometry],
    start: int,
    generator: torch.Generator,
) -> None:
    """The blocks visit the device one at a time, forward and then backward (``backward_blocks``);
    progress counts blocks of the backward pass."""
    device = placement_of(lm).device
    clock, hooks = EtaClock(total_steps=len(geoms)), active()
    seen: set[int] = set()

    def leaves(i: int, layer: nn.Module, b: int, n: int) -> list[torch.Tensor]:
        heads = torch.ones(n, geoms[i].n_heads, device=device, requires_grad=True)
        channels = torch.ones(n, geoms[i].intermediate_size, device=device, requires_grad=True)
        masks.heads[i], masks.channels[i] = heads, channels
        return [heads, channels]

    def collect(stream: int, i: int, b: int, grads: tuple[torch.Tensor, ...]) -> None:
        sums.add(stream, i, grads[0], grads[1])
        if i not in seen:
            seen.add(i)
            hooks.report(len(seen), len(geoms), clock.step())

    backward_blocks(
        lm,
        windows,
        spec.windows.batch_size,
        lambda b, batch, logits: sums.head_losses(logits, batch, start, spec.objective, generator),
        leaves,
        collect,
    )


def _over_cut(heads: torch.Tensor, channels: torch.Tensor, cut: Cut) -> torch.Tensor:
    """A per-unit quantity (..., H) and (..., I) summed over the heads and channels ``cut`` removes: (...)."""
    return heads[..., list(cut.heads)].sum(-1) + channels[..., list(cut.channels)].sum(-1)


def estimate_cells(
    lm: LoadedModel, spec: TableSpec, windows: torch.Tensor, scores: ImportanceScores, components: list[tuple[int, str]]
) -> tuple[np.ndarray, float, BuildStats]:
    """(C, R) estimated objectives, the dense objective and build statistics (the active stage
    is told calibration batches done, or blocks of a streamed backward pass, and its cancel polled)."""
    grad_h, grad_c, fisher_h, fisher_c, dense = _mask_gradients(lm, spec, windows)
    cuts = unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple)
    objective = np.empty((len(components), len(spec.rate_grid)), dtype=np.float64)
    for c, row in enumerate(cuts):
        for r, cut in enumerate(row):
            first = -float(_over_cut(grad_h[cut.layer], grad_c[cut.layer], cut))
            second = 0.5 * float(_over_cut(fisher_h[cut.layer], fisher_c[cut.layer], cut))
            objective[c, r] = dense + first + (second if spec.estimator == "fisher" else 0.0)
    return objective, dense, {"batches": len(batches(windows, spec.windows.batch_size))}


def estimated_increase_per_window(
    lm: LoadedModel, spec: TableSpec, windows: torch.Tensor, scores: ImportanceScores, components: list[tuple[int, str]]
) -> np.ndarray:
    """(N, C, R) every cell's estimated objective increase on each calibration window alone: their mean over the
    windows is ``estimate_cells``' objective less the dense one (the same labels sampled, so to rounding), and their
    spread says how much a cell's estimate rests on which windows calibrated it (its standard error: the spread over
    the square root of N). One more gradient pass, with every window's gradients kept (N x units floats)."""
    sums = _gradient_pass(lm, spec, windows, per_window=True)
    n_windows = windows.shape[0]
    t_fisher = objective_positions(windows, spec.objective, text_start(lm.tokenizer, windows)) // n_windows
    per_block: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {stream: (torch.cat([h for h, _ in parts]), torch.cat([c for _, c in parts])) for stream, parts in block.items()}
        for block in sums.windows or []
    ]  # per block and stream: (N, H) and (N, I)
    cuts = unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple)
    increase = np.zeros((n_windows, len(components), len(spec.rate_grid)), dtype=np.float64)
    for c, row in enumerate(cuts):
        for r, cut in enumerate(row):
            block = per_block[cut.layer]
            if "grad" in block:  # -sum of the cut's first-order terms, window by window
                increase[:, c, r] -= _over_cut(*block["grad"], cut).numpy()
            if "fisher" in block:  # 0.5 T sum of the squared gradients: each window's own Fisher diagonal
                increase[:, c, r] += 0.5 * t_fisher * _over_cut(*block["fisher"], cut).numpy()
    return increase


def fill_estimated(request: CellRequest) -> CellObjectives:
    """The ``fisher`` and ``taylor`` estimators' filler (``ledger.CellFiller``): the gradient
    pass, every cell estimated."""
    active().enter(GRADIENT_PASS)
    objective, dense, stats = estimate_cells(request.lm, request.spec, request.windows, request.scores, request.components)
    return CellObjectives(objective, dense, stats, np.zeros(objective.shape, dtype=bool), None)
