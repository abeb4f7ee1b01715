"""Surgery: physically remove attention heads and MLP channels as a plan says.

Each block gets its own widths: q/k/v rows and o columns of the dropped heads, and
gate/up rows and down columns of the dropped channels, are sliced away, so the pruned model
is smaller in memory and faster, and it runs through the model's ordinary forward (the
attention infers its head count from the projection shapes; ``num_key_value_groups`` is
updated by the adapter). Which units go is decided by importance scores; how many, by the
plan's rates rounded as ``units`` says. Invariants are asserted after every block, and the
final parameter count must equal the plan's prediction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters import ArchitectureAdapter
from .importance import ImportanceScores, LayerScores
from .plan import RatePlan, predicted_params
from .units import AttentionShape, attention_shape_for_rate, block_geometries, channels_for_rate

log = logging.getLogger(__name__)


def _slice_linear(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    weight = linear.weight.detach()  # (out, in)
    if rows is not None:
        weight = weight.index_select(0, rows)
    if cols is not None:
        weight = weight.index_select(1, cols)
    bias = linear.bias.detach() if linear.bias is not None else None
    if bias is not None and rows is not None:
        bias = bias.index_select(0, rows)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    out.weight.requires_grad_(linear.weight.requires_grad)
    return out


def _unit_rows(units: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole heads: head h owns rows h*width .. (h+1)*width-1."""
    return (units[:, None] * width + torch.arange(width)[None, :]).reshape(-1)  # (len(units) * width,)


def select_attention(head_scores: torch.Tensor, n_kv_heads: int, shape: AttentionShape) -> tuple[list[int], list[int]]:
    """Kept KV groups and kept query heads (both ascending) for a GQA-valid shape.

    Groups are ranked by the summed score of their query heads; within each kept group its
    best ``heads_per_group`` query heads stay.
    """
    group_size = head_scores.numel() // n_kv_heads
    per_group = head_scores.reshape(n_kv_heads, group_size)  # (KV, G)
    group_rank = torch.argsort(per_group.sum(1), descending=True, stable=True)
    kept_kv = sorted(group_rank[: shape.kv_groups].tolist())
    kept_heads = []
    for g in kept_kv:
        best = torch.argsort(per_group[g], descending=True, stable=True)[: shape.heads_per_group]
        kept_heads.extend(sorted((g * group_size + best).tolist()))
    return kept_kv, kept_heads


def select_channels(channel_scores: torch.Tensor, kept: int) -> list[int]:
    """The ``kept`` highest-scoring MLP channels, ascending."""
    return sorted(torch.argsort(channel_scores, descending=True, stable=True)[:kept].tolist())


def prune_attention_(adapter: ArchitectureAdapter, layer: nn.Module, kept_kv: list[int], kept_heads: list[int]) -> None:
    """Slice one block's attention in place to the given KV groups and query heads."""
    geom = adapter.geometry(layer)
    if len(kept_heads) % len(kept_kv) != 0:
        raise ValueError("kept query heads must divide evenly over kept KV groups")
    q, k, v, o = adapter.attention_projections(layer)
    attn = adapter.attention(layer)
    head_rows = _unit_rows(torch.tensor(kept_heads), geom.head_dim)
    kv_rows = _unit_rows(torch.tensor(kept_kv), geom.head_dim)
    setattr(attn, adapter.query_name, _slice_linear(q, rows=head_rows))
    setattr(attn, adapter.key_name, _slice_linear(k, rows=kv_rows))
    setattr(attn, adapter.value_name, _slice_linear(v, rows=kv_rows))
    setattr(attn, adapter.output_name, _slice_linear(o, cols=head_rows))
    adapter.set_head_counts(layer, len(kept_heads), len(kept_kv))
    after = adapter.geometry(layer)
    assert after.n_heads == len(kept_heads) and after.n_kv_heads == len(kept_kv), "attention slice lost its shape"
    assert after.n_heads % after.n_kv_heads == 0, "GQA groups became uneven"
    assert adapter.attention_projections(layer)[3].in_features == after.n_heads * geom.head_dim


def prune_mlp_(adapter: ArchitectureAdapter, layer: nn.Module, kept_channels: list[int]) -> None:
    """Slice one block's MLP in place to the given intermediate channels."""
    gate, up, down = adapter.mlp_projections(layer)
    mlp = adapter.mlp(layer)
    idx = torch.tensor(kept_channels)
    setattr(mlp, adapter.gate_name, _slice_linear(gate, rows=idx))
    setattr(mlp, adapter.up_name, _slice_linear(up, rows=idx))
    setattr(mlp, adapter.down_name, _slice_linear(down, cols=idx))
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(kept_channels)
    g, u, d = adapter.mlp_projections(layer)
    assert g.out_features == u.out_features == d.in_features == len(kept_channels), "MLP slice lost its shape"


@dataclass
class PruneResult:
    """What surgery did: kept indices per block and the parameter counts before and after."""

    plan: RatePlan
    kept_kv_heads: list[list[int]] = field(default_factory=list)
    kept_heads: list[list[int]] = field(default_factory=list)
    kept_channels: list[list[int]] = field(default_factory=list)
    params_before: int = 0
    params_after: int = 0

    def kept_indices(self) -> dict:
        return {
            "kept_kv_heads": self.kept_kv_heads,
            "kept_heads": self.kept_heads,
            "kept_channels": self.kept_channels,
        }


def layer_selection(
    adapter: ArchitectureAdapter, layer: nn.Module, scores: LayerScores, attn_rate: float, mlp_rate: float, channel_multiple: int
):
    """(kept_kv, kept_heads, kept_channels) for one block at the given rates."""
    geom = adapter.geometry(layer)
    q, _, _, o = adapter.attention_projections(layer)
    shape = attention_shape_for_rate(geom, q.in_features, attn_rate, q.bias is not None, o.bias is not None)
    kept_kv, kept_heads = select_attention(scores.head, geom.n_kv_heads, shape)
    kept_channels = select_channels(scores.channel, channels_for_rate(geom.intermediate_size, mlp_rate, channel_multiple))
    return kept_kv, kept_heads, kept_channels


def apply_plan(lm, plan: RatePlan, scores: ImportanceScores | None) -> PruneResult:
    """Prune ``lm.model`` in place as ``plan`` says and return what was kept.

    Args:
        lm: a LoadedModel (its model is modified; its fingerprint is refreshed).
        plan: a RatePlan for this model (checked).
        scores: importance scores from the same dense model; may be None only for
            an all-zero plan.
    Raises:
        PlanError: the plan is for another model.
    """
    from .models import weights_fingerprint

    plan.validate()
    plan.check_model(lm)
    # Recounted from this model's geometry: a hand-written plan may carry no or stale counts.
    plan.params = predicted_params(lm, plan.attention_rates, plan.mlp_rates, plan.channel_multiple)
    result = PruneResult(plan=plan, params_before=lm.param_count())
    layers = lm.adapter.layers(lm.model)
    for i, layer in enumerate(layers):
        a_rate, m_rate = plan.attention_rates[i], plan.mlp_rates[i]
        geom = lm.adapter.geometry(layer)
        if scores is None:
            if a_rate > 0 or m_rate > 0:
                raise ValueError("importance scores are needed for a plan with non-zero rates")
            kept_kv, kept_heads = list(range(geom.n_kv_heads)), list(range(geom.n_heads))
            kept_channels = list(range(geom.intermediate_size))
        else:
            kept_kv, kept_heads, kept_channels = layer_selection(
                lm.adapter, layer, scores.layers[i], a_rate, m_rate, plan.channel_multiple
            )
        if len(kept_heads) < geom.n_heads:
            prune_attention_(lm.adapter, layer, kept_kv, kept_heads)
        if len(kept_channels) < geom.intermediate_size:
            prune_mlp_(lm.adapter, layer, kept_channels)
        result.kept_kv_heads.append(kept_kv)
        result.kept_heads.append(kept_heads)
        result.kept_channels.append(kept_channels)
    result.params_after = lm.param_count()
    expected = plan.params["pruned_total"]
    assert result.params_after == expected, f"pruned model has {result.params_after} parameters, plan predicted {expected}"
    lm.fingerprint = weights_fingerprint(lm.model)
    lm.pruned_from = {"model": plan.model, "fingerprint": plan.model_fingerprint, "plan": plan.to_dict()}
    log.info("pruned %s: %d -> %d parameters", lm.name, result.params_before, result.params_after)
    return result


def current_widths(lm) -> list[dict]:
    """Per-block widths as they are now, in the form config.json's per_layer_config records."""
    return [
        {
            "num_attention_heads": g.geometry.n_heads,
            "num_key_value_heads": g.geometry.n_kv_heads,
            "intermediate_size": g.geometry.intermediate_size,
        }
        for g in block_geometries(lm)
    ]
