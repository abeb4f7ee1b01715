"""Slicing primitives: give one decoder block fewer attention heads or MLP channels.

These are the shape operations shared by surgery (which decides *which* units go), the
checkpoint loader (which narrows a freshly built dense architecture to the recorded widths
before loading the pruned tensors) and the loss-table builder (which zeroes the same
columns instead of slicing them). They know nothing about plans or scores.

Head ``h`` owns rows ``h*D .. (h+1)*D-1`` of q_proj (and k/v for KV heads) and the same
columns of o_proj; MLP channel ``c`` owns row ``c`` of gate/up and column ``c`` of down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gap_engine.core.errors import InvariantError
from gap_engine.model.adapters import ArchitectureAdapter


def slice_linear(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    """A new Linear holding only the given output rows and input columns (bias follows rows)."""
    weight = linear.weight.detach()  # (out, in)
    rows = rows.to(weight.device) if rows is not None else None  # index where the weights are: exact copies in any dtype
    cols = cols.to(weight.device) if cols is not None else None
    if rows is not None:
        weight = weight.index_select(0, rows)
    if cols is not None:
        weight = weight.index_select(1, cols)
    bias = linear.bias.detach() if linear.bias is not None else None
    if bias is not None and rows is not None:
        bias = bias.index_select(0, rows)
    # skip_init: the new layer's weights are overwritten below, so a random init would be work thrown away.
    out: nn.Linear = nn.utils.skip_init(
        nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    out.weight.requires_grad_(linear.weight.requires_grad)
    return out


def unit_rows(units: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole heads: head h owns rows h*width .. (h+1)*width-1."""
    return (units[:, None] * width + torch.arange(width)[None, :]).reshape(-1)  # (len(units) * width,)


def slice_attention_(adapter: ArchitectureAdapter, layer: nn.Module, kept_kv: list[int], kept_heads: list[int]) -> None:
    """Slice one block's attention in place to the given KV groups and query heads."""
    geom = adapter.geometry(layer)
    if not kept_kv or len(kept_heads) % len(kept_kv) != 0:
        raise ValueError("kept query heads must divide evenly over at least one kept KV group")
    q, k, v, o = adapter.attention_projections(layer)
    attn = adapter.attention(layer)
    head_rows = unit_rows(torch.tensor(kept_heads), geom.head_dim)
    kv_rows = unit_rows(torch.tensor(kept_kv), geom.head_dim)
    setattr(attn, adapter.query_name, slice_linear(q, rows=head_rows))
    setattr(attn, adapter.key_name, slice_linear(k, rows=kv_rows))
    setattr(attn, adapter.value_name, slice_linear(v, rows=kv_rows))
    setattr(attn, adapter.output_name, slice_linear(o, cols=head_rows))
    adapter.set_head_counts(layer, len(kept_heads), len(kept_kv))
    after = adapter.geometry(layer)
    if after.n_heads != len(kept_heads) or after.n_kv_heads != len(kept_kv):
        raise InvariantError(
            f"attention slice lost its shape: {after.n_heads}/{after.n_kv_heads} heads, asked {len(kept_heads)}/{len(kept_kv)}"
        )
    if after.n_heads % after.n_kv_heads:
        raise InvariantError(f"GQA groups became uneven: {after.n_heads} query heads over {after.n_kv_heads} KV heads")
    if adapter.attention_projections(layer)[3].in_features != after.n_heads * geom.head_dim:
        raise InvariantError("o_proj's input width does not match the kept query heads")


def slice_mlp_(adapter: ArchitectureAdapter, layer: nn.Module, kept_channels: list[int]) -> None:
    """Slice one block's MLP in place to the given intermediate channels."""
    gate, up, down = adapter.mlp_projections(layer)
    mlp = adapter.mlp(layer)
    idx = torch.tensor(kept_channels)
    setattr(mlp, adapter.gate_name, slice_linear(gate, rows=idx))
    setattr(mlp, adapter.up_name, slice_linear(up, rows=idx))
    setattr(mlp, adapter.down_name, slice_linear(down, cols=idx))
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(kept_channels)
    g, u, d = adapter.mlp_projections(layer)
    if not g.out_features == u.out_features == d.in_features == len(kept_channels):
        raise InvariantError(f"MLP slice lost its shape: {g.out_features}/{u.out_features}/{d.in_features}, asked {len(kept_channels)}")


# What a block's slicing replaces: bookkeeping attributes of the attention and MLP modules.
_ATTENTION_COUNTS = ("num_key_value_groups", "num_heads", "num_key_value_heads")
_MLP_COUNTS = ("intermediate_size",)


@contextlib.contextmanager
def restored_on_failure(adapter: ArchitectureAdapter, layers: Iterable[nn.Module]) -> Iterator[None]:
    """Put every block of ``layers`` back as it was if the ``with`` body raises.

    Slicing sets new projection modules and never writes into the old ones, so keeping the old
    modules and the head/channel counts is enough to undo it exactly: the weights, and so the
    fingerprint, are the ones from before.
    """
    saved: list[tuple[Any, str, Any]] = []  # (owner module, attribute, value before)
    for layer in layers:
        attn, mlp = adapter.attention(layer), adapter.mlp(layer)
        modules = [(attn, name) for name in (adapter.query_name, adapter.key_name, adapter.value_name, adapter.output_name)]
        modules += [(mlp, name) for name in (adapter.gate_name, adapter.up_name, adapter.down_name)]
        counts = [(attn, name) for name in _ATTENTION_COUNTS if hasattr(attn, name)]
        counts += [(mlp, name) for name in _MLP_COUNTS if hasattr(mlp, name)]
        saved.extend((owner, name, getattr(owner, name)) for owner, name in modules + counts)
    try:
        yield
    except BaseException:
        for owner, name, value in saved:
            setattr(owner, name, value)
        raise


def layer_widths(adapter: ArchitectureAdapter, model: nn.Module) -> list[dict[str, Any]]:
    """Per-block widths as they are now, in the form config.json's ``per_layer_config`` records."""
    out = []
    for layer in adapter.layers(model):
        geom = adapter.geometry(layer)
        out.append(
            {
                "num_attention_heads": geom.n_heads,
                "num_key_value_heads": geom.n_kv_heads,
                "intermediate_size": geom.intermediate_size,
            }
        )
    return out


def narrow_to_widths(adapter: ArchitectureAdapter, model: nn.Module, widths: list[dict[str, Any]]) -> None:
    """Give every block of a dense-built model the recorded widths (the values are loaded after).

    Raises:
        ValueError: a width list of another length, or an entry that does not fit the base
            architecture (more heads than it has, uneven GQA groups).
    """
    layers = adapter.layers(model)
    if len(widths) != len(layers):
        raise ValueError(f"the widths list {len(widths)} layers, the model has {len(layers)}")
    for layer, width in zip(layers, widths):
        geom = adapter.geometry(layer)
        heads, kv, channels = width["num_attention_heads"], width["num_key_value_heads"], width["intermediate_size"]
        if not (0 < kv <= geom.n_kv_heads and 0 < heads <= geom.n_heads and heads % kv == 0 and 0 < channels <= geom.intermediate_size):
            raise ValueError(f"widths {width} do not fit the base architecture {geom}")
        if heads < geom.n_heads or kv < geom.n_kv_heads:
            # Any indices give the right shapes; the real tensors are loaded over them next.
            per_group = heads // kv
            kept_heads = [g * geom.group_size + j for g in range(kv) for j in range(per_group)]
            slice_attention_(adapter, layer, list(range(kv)), kept_heads)
        if channels < geom.intermediate_size:
            slice_mlp_(adapter, layer, list(range(channels)))


def replace_linear_(
    owner: nn.Module, name: str, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, add_bias: bool = False
) -> None:
    """Set ``owner.<name>`` to a new linear: the old one's weight (or ``weight``, same shape) and
    its bias plus ``bias`` (d,) when ``add_bias`` (a zero bias where it had none).

    The old module is never written into, so ``restored_on_failure`` undoes this exactly.
    """
    old = getattr(owner, name)
    with torch.no_grad():
        new_weight = old.weight if weight is None else nn.Parameter(weight.to(old.weight.device, old.weight.dtype))
        new_bias = old.bias
        if add_bias:
            base = (
                old.bias.detach()
                if old.bias is not None
                else torch.zeros(old.out_features, dtype=old.weight.dtype, device=old.weight.device)
            )
            new_bias = nn.Parameter(base + (0 if bias is None else bias.to(base.device, base.dtype)))
        new = nn.Linear(old.in_features, old.out_features, bias=new_bias is not None, device="meta")
        new.weight = new_weight
        new.bias = new_bias
        for param in new.parameters():
            param.requires_grad_(old.weight.requires_grad)
    setattr(owner, name, new)


def output_bias_layout(adapter: ArchitectureAdapter, model: nn.Module) -> list[tuple[bool, bool]]:
    """Per block, whether its o_proj and its down_proj carry a bias (bias compensation gives one
    to each projection that lost inputs, and to no other)."""
    layout = []
    for layer in adapter.layers(model):
        o_proj, down_proj = adapter.attention_projections(layer)[3], adapter.mlp_projections(layer)[2]
        layout.append((o_proj.bias is not None, down_proj.bias is not None))
    return layout


def add_output_biases_(adapter: ArchitectureAdapter, model: nn.Module, layout: Sequence[Sequence[bool]] | None = None) -> None:
    """Give block ``i``'s o_proj a bias where ``layout[i][0]`` and its down_proj one where
    ``layout[i][1]`` (every block both when ``layout`` is None; zeros where there is none): the
    shape of a bias-compensated checkpoint, before its tensors are loaded.

    Raises:
        ValueError: a layout of another length than the model's blocks.
    """
    layers = adapter.layers(model)
    if layout is None:
        layout = [(True, True)] * len(layers)
    if len(layout) != len(layers):
        raise ValueError(f"the output-bias layout lists {len(layout)} blocks, the model has {len(layers)}")
    for layer, (attention, mlp) in zip(layers, layout):
        if attention:
            replace_linear_(adapter.attention(layer), adapter.output_name, add_bias=True)
        if mlp:
            replace_linear_(adapter.mlp(layer), adapter.down_name, add_bias=True)


@contextlib.contextmanager
def zeroed_units(adapter: ArchitectureAdapter, layer: nn.Module, heads: tuple[int, ...], channels: tuple[int, ...]) -> Iterator[None]:
    """Temporarily zero the given units' input columns of o_proj and down_proj.

    A head contributes to the block's output only through its columns of ``o_proj``, and an
    MLP channel only through its column of ``down_proj``, so zeroing them gives the output
    of the sliced layer (biases of o_proj/down_proj stay in both). The weights are restored
    exactly on exit, whatever happens inside.
    """
    geom = adapter.geometry(layer)
    _, _, _, o_proj = adapter.attention_projections(layer)
    _, _, down_proj = adapter.mlp_projections(layer)
    saved = []
    with torch.no_grad():
        try:
            for weight, cols in (
                (o_proj.weight, unit_rows(torch.tensor(heads, dtype=torch.long), geom.head_dim) if heads else None),
                (down_proj.weight, torch.tensor(channels, dtype=torch.long) if channels else None),
            ):
                if cols is None:
                    continue
                cols = cols.to(weight.device)
                saved.append((weight, cols, weight[:, cols].clone()))  # (d, removed)
                weight[:, cols] = 0.0
            yield
        finally:
            for weight, cols, values in saved:
                weight[:, cols] = values
