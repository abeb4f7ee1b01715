"""Run a model block by block over many windows: the execution behind ``--stream``.

A model larger than the accelerator still fits on the host. As SparseGPT and Wanda do, the
blocks stay there and visit the device one at a time: every calibration batch goes through
block ``i`` before block ``i + 1`` is moved over, so each block crosses the bus once per pass
instead of once per batch. Between blocks the hidden states wait on the host (in pinned
memory on CUDA, so the copies back are fast); only the embeddings, final norm and LM head,
which every window needs, stay on the device (``split_placement``).

Each block is called exactly as the model's own forward calls it: the positional arguments
it receives (rotary embeddings, attention masks; Gemma 3 alternates sliding and full
attention, so each block keeps its own) are recorded once per batch by running the decoder
with every block replaced by a pass-through (``capture_calls``). The same recorded calls
drive the exact table's cells, so a streamed run computes the same numbers as a resident
one (``tests/tables/test_streaming.py`` checks tables, scores and perplexity for equality).

Functions here know nothing about tables or plans; they serve importance scores,
evaluation and ``tables.streaming``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gap_engine.core.device import input_device, is_streamed, placement_of, synchronize
from gap_engine.core.errors import InvariantError
from gap_engine.core.progress import active, reporting, steps
from gap_engine.data.windows import batches
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.loaded import LoadedModel

BlockCall = tuple[tuple[Any, ...], dict[str, Any]]  # the positional arguments (after the hidden states) and keywords a block got


def layer_output(out: Any) -> torch.Tensor:
    """The hidden states of a block's output (a tensor, or the first item of a tuple)."""
    hidden: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return hidden


# ---- where the weights are ------------------------------------------------------------------
def split_placement(model: nn.Module, adapter: ArchitectureAdapter, device: torch.device) -> None:
    """Everything but the blocks to ``device``; the blocks stay where they are (the host)."""
    decoder, layers = adapter.decoder(model), adapter.layers(model)
    name = next(child_name for child_name, child in decoder.named_children() if child is layers)
    setattr(decoder, name, nn.ModuleList())
    try:
        model.to(device)
    finally:
        setattr(decoder, name, layers)


@contextlib.contextmanager
def block_on(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """The block's parameters and buffers on ``device`` for the duration; the host tensors are
    put back on exit (nothing is copied back: a block's weights are only ever read, or masked
    and restored, while it is away)."""
    if next(layer.parameters()).device == device:
        yield layer
        return
    moved: dict[int, torch.Tensor] = {}  # a tensor shared by two modules moves once
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []  # (registry, name, host tensor)
    for module in layer.modules():
        registries: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for registry in registries:
            for name, tensor in registry.items():
                if tensor is None:
                    continue
                if id(tensor) not in moved:
                    copy = tensor.data.to(device, non_blocking=True)
                    moved[id(tensor)] = nn.Parameter(copy, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copy
                saved.append((registry, name, tensor))
    try:
        for registry, name, tensor in saved:
            registry[name] = moved[id(tensor)]
        yield layer
    finally:
        synchronize(device)
        for registry, name, tensor in saved:
            registry[name] = tensor


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (pinned when it comes from CUDA); host tensors as they are."""
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type == "cuda":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return out.copy_(tensor, non_blocking=True)
    return tensor.cpu()


def tree_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(tree_to(v, device) for v in value)
    if isinstance(value, list):
        return [tree_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: tree_to(v, device) for k, v in value.items()}
    return value


# ---- recording how the model calls its blocks -------------------------------------------------
def capture_calls(lm: LoadedModel, batch: torch.Tensor) -> tuple[torch.Tensor, list[BlockCall]]:
    """The embeddings entering block 0 and the call of every block, for one batch of token ids.

    The decoder runs with each block replaced by a pass-through that records its arguments,
    so no block weight is touched (or needs to be on the device).

    Args:
        lm: a LoadedModel (resident or streamed).
        batch: (B, T) token ids on the model's input device.
    Returns:
        ((B, T, d) hidden states entering block 0, [block] (args, kwargs)).
    """
    layers = lm.adapter.layers(lm.model)
    calls: list[BlockCall | None] = [None] * len(layers)
    first: dict[str, Any] = {}

    def pass_through(index: int) -> Callable[..., torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            kwargs = dict(kwargs)
            hidden: torch.Tensor = args[0] if args else kwargs.pop("hidden_states")
            calls[index] = (tuple(args[1:]), kwargs)
            first.setdefault("hidden", hidden)
            return hidden

        return forward

    for i, layer in enumerate(layers):
        layer.forward = pass_through(i)
    try:
        lm.adapter.decoder(lm.model)(input_ids=batch, use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
    recorded = [call for call in calls if call is not None]
    if len(recorded) != len(layers):
        raise InvariantError("the decoder did not call every block")
    return first["hidden"], recorded


@dataclass
class LayerwisePass:
    """What one block-by-block pass leaves: per batch, the token ids, block calls and final states."""

    batches: list[torch.Tensor]  # [b] (B, T) token ids on the input device
    calls: list[list[BlockCall]]  # [b][i] how block i is called for batch b
    final_hidden: list[torch.Tensor]  # [b] (B, T, d) output of the last block, on the host


def forward_blocks(
    lm: LoadedModel,
    windows: torch.Tensor,
    batch_size: int,
    on_input: Callable[[int, list[torch.Tensor]], None] | None = None,
    for_backward: bool = False,
) -> LayerwisePass:
    """Every window through every block, one block at a time on the device.

    Forward hooks on a block's modules fire as usual (importance statistics use that).

    Args:
        lm: a LoadedModel; its blocks may live on the host (streamed) or on the device.
        windows: (N, T) token ids.
        batch_size: windows per block call.
        on_input: told (block index, [b] (B, T, d) host hidden states entering that block).
        The active stage's cancel is polled before every block and (blocks done, blocks, None)
        reported after each (``core.progress.steps``).
        for_backward: keep states and calls usable by autograd (``backward_blocks``).
    """
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    result = LayerwisePass([], [], [])
    hidden = []
    # Inference tensors cannot be saved for a backward pass: a pass that feeds one records
    # its states and block calls under no_grad instead.
    with torch.no_grad() if for_backward else torch.inference_mode():
        for batch in batches(windows, batch_size):
            batch = batch.to(input_device(lm.model))
            first, calls = capture_calls(lm, batch)
            result.batches.append(batch)
            result.calls.append(calls)
            hidden.append(to_host(first))
        for i, layer in enumerate(steps(layers, "block-by-block pass", "blocks")):
            if on_input is not None:
                on_input(i, hidden)
            with block_on(layer, device):
                outputs = []
                for b, states in enumerate(hidden):
                    args, kwargs = result.calls[b][i]
                    outputs.append(to_host(layer_output(layer(states.to(device), *args, **kwargs))))
            hidden = outputs
    synchronize(device)
    result.final_hidden = hidden
    return result


def logits_batches(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, logits) per batch, both on the device: the model's own forward when it is
    resident, a block-by-block pass followed by the LM head when it streams.

    Yields:
        ((B, T) token ids, (B, T, V) logits in the model's dtype).
    """
    if not is_streamed(lm):
        for batch in batches(windows, batch_size):
            batch = batch.to(input_device(lm.model))
            yield batch, lm.model(input_ids=batch, use_cache=False).logits
        return
    done = forward_blocks(lm, windows, batch_size)
    device = placement_of(lm).device
    with torch.inference_mode():
        for batch, final in zip(done.batches, done.final_hidden):
            yield batch, lm.adapter.logits_from_hidden(lm.model, final.to(device))


# ---- gradients, one block at a time ---------------------------------------------------------
HeadLosses = Callable[[int, torch.Tensor, torch.Tensor], list[torch.Tensor]]
BlockLeaves = Callable[[int, nn.Module, int, int], list[torch.Tensor]]
LeafGrads = Callable[[int, int, int, tuple[torch.Tensor, ...]], None]


def backward_blocks(
    lm: LoadedModel,
    windows: torch.Tensor,
    batch_size: int,
    head_losses: HeadLosses,
    block_leaves: BlockLeaves,
    on_leaf_grads: LeafGrads,
) -> None:
    """Gradients of per-batch losses with respect to tensors inside the blocks, with the
    blocks visiting the device one at a time (a streamed model's backward pass).

    A forward pass block by block keeps every block's input on the host. At the top, each
    loss is differentiated with respect to the last block's output. Then, from the last
    block down, each block is run again on its stored input and differentiated with the
    gradient arriving at its output: the leaves inside it get their gradients and the
    gradient at its input travels down. This is backpropagation with one block recomputed
    at a time, so its gradients are those of a resident backward pass (the same chain rule
    over the same arithmetic; ``tests/tables/test_streaming.py`` checks them).

    Args:
        lm: a LoadedModel, streamed or resident.
        windows: (N, T) token ids.
        batch_size: windows per block call.
        head_losses: (batch index, (B, T) token ids, (B, T, V) logits) -> one scalar loss per
            gradient stream; called once per batch, in batch order.
        block_leaves: (block index, the block on the device, batch index, windows in the
            batch) -> the leaf tensors whose gradients are wanted for that block and batch
            (the caller's hooks or the block's own weights make the block read them).
        on_leaf_grads: told (stream, block index, batch index, gradients of the leaves).
        The active stage's cancel is polled before every block; nothing is reported (its
        caller counts what it measures in ``on_leaf_grads``).
    """
    device = placement_of(lm).device
    layers = lm.adapter.layers(lm.model)
    inputs: list[list[torch.Tensor]] = []
    with reporting(active().replaced(progress=None)):
        done = forward_blocks(lm, windows, batch_size, on_input=lambda i, hidden: inputs.append(hidden), for_backward=True)
    arriving: list[list[torch.Tensor]] = []  # [stream][b] gradient at the current block's output, host
    for b, (batch, final) in enumerate(zip(done.batches, done.final_hidden)):
        final = final.to(device).detach().requires_grad_(True)
        with torch.enable_grad():
            losses = head_losses(b, batch, lm.adapter.logits_from_hidden(lm.model, final))
            for s, loss in enumerate(losses):
                if len(arriving) <= s:
                    arriving.append([])
                arriving[s].append(to_host(torch.autograd.grad(loss, final, retain_graph=s + 1 < len(losses))[0]))
    for i in steps(range(len(layers) - 1, -1, -1), "block-by-block backward pass", "blocks", quiet=True):
        with block_on(layers[i], device) as layer:
            for b, states in enumerate(inputs[i]):
                args, kwargs = done.calls[b][i]
                with torch.enable_grad():
                    hidden = states.to(device).detach().requires_grad_(i > 0)
                    leaves = block_leaves(i, layer, b, states.shape[0])
                    out = layer_output(layer(hidden, *args, **kwargs))
                    wrt = ([hidden] if i > 0 else []) + leaves
                    for s, stream in enumerate(arriving):
                        grads = torch.autograd.grad(out, wrt, grad_outputs=stream[b].to(device), retain_graph=s + 1 < len(arriving))
                        on_leaf_grads(s, i, b, grads[1:] if i > 0 else grads)
                        if i > 0:
                            stream[b] = to_host(grads[0])
    synchronize(device)
