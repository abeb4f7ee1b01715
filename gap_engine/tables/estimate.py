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

import numpy as np
import torch
import torch.nn.functional as F

from ..data import batches, text_start
from ..device import host64, input_device
from ..progress import CancelToken, EtaClock, ProgressFn, check_cancelled
from .artefact import TableSpec
from .cells import objective_positions, unit_cuts


def _install_gates(adapter, layers, geoms, masks: dict) -> list:
    """Pre-hooks that multiply every head's o_proj input and every channel's down_proj input
    by its mask, read from ``masks["heads"][layer]`` (B, H) and ``masks["channels"][layer]`` (B, I)."""

    def head_gate(index):
        def hook(module, args):
            mask = masks["heads"][index]  # (B, H)
            gate = mask.repeat_interleave(geoms[index].head_dim, dim=1)[:, None, :]  # (B, 1, H*D)
            return ((args[0] * gate).to(args[0].dtype),) + tuple(args[1:])  # float32 masks, model-dtype activations

        return hook

    def channel_gate(index):
        def hook(module, args):
            return ((args[0] * masks["channels"][index][:, None, :]).to(args[0].dtype),) + tuple(args[1:])  # (B, T, I)

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(adapter.attention_projections(layer)[3].register_forward_pre_hook(head_gate(i)))
        handles.append(adapter.mlp_projections(layer)[2].register_forward_pre_hook(channel_gate(i)))
    return handles


def _mask_gradients(
    lm, spec: TableSpec, windows: torch.Tensor, cancel: CancelToken | None, progress: ProgressFn | None
) -> tuple[list, list, list, list, float]:
    """Per-unit mean gradients G and diagonal Fisher F of the mean objective wrt unit masks.

    Returns:
        (G_heads, G_channels, F_heads, F_channels, dense_objective); lists over blocks of
        float64 tensors (n_heads,) and (intermediate_size,). G is zero for the kl objective
        and F is zero for the taylor method.
    """
    model, adapter = lm.model, lm.adapter
    layers = list(adapter.layers(model))
    geoms = [adapter.geometry(layer) for layer in layers]
    grad_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
    grad_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
    fisher_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
    fisher_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
    masks: dict = {}
    want_fisher = spec.estimator == "fisher"
    want_grad = spec.objective == "nll"
    device = input_device(model)
    # Labels are sampled on the model's device: another device draws other labels (same distribution).
    generator = torch.Generator(device=device).manual_seed(spec.windows.seed)
    start = text_start(lm.tokenizer, windows)  # a leading BOS position is never counted
    handles = _install_gates(adapter, layers, geoms, masks)
    parts = batches(windows, spec.windows.batch_size)
    dense_sum, clock = 0.0, EtaClock(total_steps=len(parts))
    try:
        for b, batch in enumerate(parts):
            check_cancelled(cancel, f"loss table estimate cancelled after {b} of {len(parts)} batches")
            n, batch = batch.shape[0], batch.to(device)
            masks["heads"] = [torch.ones(n, g.n_heads, device=device, requires_grad=True) for g in geoms]
            masks["channels"] = [torch.ones(n, g.intermediate_size, device=device, requires_grad=True) for g in geoms]
            leaves = masks["heads"] + masks["channels"]
            with torch.enable_grad():
                logits = model(input_ids=batch, use_cache=False).logits.float()  # (B, T, V)
                vocab = logits.shape[-1]
                real = F.cross_entropy(
                    logits[:, start:-1].reshape(-1, vocab), batch[:, start + 1 :].reshape(-1), reduction="none"
                ).view(n, -1)  # (B, T-1-start)
                dense_sum += float(real.detach().double().sum())
                if want_grad:
                    # Summing per-window means gives each window's own gradient in its mask row.
                    grads = torch.autograd.grad(real.mean(1).sum(), leaves, retain_graph=want_fisher)
                    for acc, g in zip(grad_heads + grad_channels, grads):
                        acc += host64(g).sum(0)
                if want_fisher:
                    used = logits[:, start:] if spec.objective == "kl" else logits[:, start:-1]  # (B, T', V)
                    probs = F.softmax(used.detach(), dim=-1).reshape(-1, vocab)  # (B*T', V)
                    sampled = torch.multinomial(probs, 1, generator=generator).view(n, -1)  # (B, T')
                    nll = F.cross_entropy(used.reshape(-1, vocab), sampled.reshape(-1), reduction="none").view(n, -1)
                    grads = torch.autograd.grad(nll.mean(1).sum(), leaves)
                    for acc, g in zip(fisher_heads + fisher_channels, grads):
                        acc += (host64(g) ** 2).sum(0)
            del logits
            eta = clock.step()
            if progress:
                progress(b + 1, len(parts), eta)
    finally:
        for handle in handles:
            handle.remove()
    n_windows = windows.shape[0]
    t_fisher = objective_positions(windows, spec.objective, start) // n_windows
    for acc in grad_heads + grad_channels:
        acc /= n_windows
    for acc in fisher_heads + fisher_channels:
        acc *= t_fisher / n_windows
    dense = dense_sum / objective_positions(windows, "nll", start) if spec.objective == "nll" else 0.0
    return grad_heads, grad_channels, fisher_heads, fisher_channels, dense


def estimate_cells(
    lm, spec: TableSpec, windows: torch.Tensor, scores, components, progress: ProgressFn | None, cancel: CancelToken | None
) -> tuple[np.ndarray, float, dict]:
    """(C, R) estimated objectives, the dense objective and build statistics."""
    grad_h, grad_c, fisher_h, fisher_c, dense = _mask_gradients(lm, spec, windows, cancel, progress)
    cuts = unit_cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple)
    objective = np.empty((len(components), len(spec.rate_grid)), dtype=np.float64)
    for c, row in enumerate(cuts):
        for r, cut in enumerate(row):
            heads, channels = list(cut.heads), list(cut.channels)
            first = -(float(grad_h[cut.layer][heads].sum()) + float(grad_c[cut.layer][channels].sum()))
            second = 0.5 * (float(fisher_h[cut.layer][heads].sum()) + float(fisher_c[cut.layer][channels].sum()))
            objective[c, r] = dense + first + (second if spec.estimator == "fisher" else 0.0)
    return objective, dense, {"batches": len(batches(windows, spec.windows.batch_size))}
