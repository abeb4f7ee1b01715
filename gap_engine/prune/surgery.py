"""Surgery: physically remove attention heads and MLP channels as a plan says.

Each block gets its own widths: q/k/v rows and o columns of the dropped heads, and
gate/up rows and down columns of the dropped channels, are sliced away, so the pruned model
is smaller in memory and faster, and it runs through the model's ordinary forward (the
attention infers its head count from the projection shapes; ``num_key_value_groups`` is
updated by the adapter). Which units go is decided by importance scores; how many, by the
plan's rates rounded as ``units`` says. Invariants are checked after every block (named
errors, not asserts), the final parameter count must equal the plan's prediction, and a
failure anywhere puts the whole model back as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gap_engine.core.errors import InvariantError, PlanError
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, plan_params
from gap_engine.model.slicing import restored_on_failure, slice_attention_, slice_mlp_, zeroed_units
from gap_engine.model.units import AttentionShape, attention_shape_for_rate, channels_for_rate
from gap_engine.prune.compensations import adds_biases
from gap_engine.prune.importance import ImportanceScores, LayerScores

log = logging.getLogger(__name__)


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


@dataclass
class PruneResult:
    """What surgery did: kept indices per block and the parameter counts before and after."""

    plan: RatePlan
    kept_kv_heads: list[list[int]] = field(default_factory=list)
    kept_heads: list[list[int]] = field(default_factory=list)
    kept_channels: list[list[int]] = field(default_factory=list)
    params_before: int = 0
    params_after: int = 0
    compensation: dict[str, Any] | None = None  # what compensation_pass did (settings, windows, seconds); None: surgery alone

    def kept_indices(self) -> dict[str, Any]:
        return {
            "kept_kv_heads": self.kept_kv_heads,
            "kept_heads": self.kept_heads,
            "kept_channels": self.kept_channels,
        }


def kept_counts(
    adapter: ArchitectureAdapter,
    layer: nn.Module,
    attn_rate: float,
    mlp_rate: float,
    channel_multiple: int,
    shape: AttentionShape | None = None,
) -> tuple[AttentionShape, int]:
    """(attention shape, MLP channels) one block keeps: the shape a plan recorded (``shape``) where
    it has one, else the one ``attn_rate`` rounds to, and ``mlp_rate``'s width.

    The one place a block's rates become unit counts: surgery, masking, compensation and the
    ``obs`` path all ask here, so none of them can cut a shape another did not fit.
    """
    geom = adapter.geometry(layer)
    if shape is None:
        q, _, _, o = adapter.attention_projections(layer)
        shape = attention_shape_for_rate(geom, q.in_features, attn_rate, q.bias is not None, o.bias is not None)
    return shape, channels_for_rate(geom.intermediate_size, mlp_rate, channel_multiple)


def layer_selection(
    adapter: ArchitectureAdapter,
    layer: nn.Module,
    scores: LayerScores,
    attn_rate: float,
    mlp_rate: float,
    channel_multiple: int,
    shape: AttentionShape | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(kept_kv, kept_heads, kept_channels) for one block at the given rates (``shape``: the
    attention shape a plan recorded, in place of the one ``attn_rate`` rounds to)."""
    geom = adapter.geometry(layer)
    shape, channels = kept_counts(adapter, layer, attn_rate, mlp_rate, channel_multiple, shape)
    kept_kv, kept_heads = select_attention(scores.head, geom.n_kv_heads, shape)
    return kept_kv, kept_heads, select_channels(scores.channel, channels)


def removed_units(
    adapter: ArchitectureAdapter,
    layer: nn.Module,
    scores: LayerScores,
    attn_rate: float,
    mlp_rate: float,
    channel_multiple: int,
    shape: AttentionShape | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(heads, channels) of one block that the rates (and a recorded ``shape``) remove, ascending:
    the complement of `layer_selection`."""
    geom = adapter.geometry(layer)
    _, kept_heads, kept_channels = layer_selection(adapter, layer, scores, attn_rate, mlp_rate, channel_multiple, shape)
    heads = tuple(sorted(set(range(geom.n_heads)) - set(kept_heads)))
    channels = tuple(sorted(set(range(geom.intermediate_size)) - set(kept_channels)))
    return heads, channels


@dataclass(frozen=True)
class BlockUnits:
    """What one block keeps and loses, in the dense block's numbering (all ascending)."""

    kept_kv: list[int]
    kept_heads: list[int]
    kept_channels: list[int]
    removed_heads: tuple[int, ...]
    removed_channels: tuple[int, ...]

    @property
    def cuts(self) -> bool:
        return bool(self.removed_heads or self.removed_channels)


def units_by_block(
    lm: LoadedModel,
    attention_rates: Sequence[float],
    mlp_rates: Sequence[float],
    channel_multiple: int,
    scores: ImportanceScores | None,
    attention_shapes: Sequence[Sequence[int]] | None = None,
) -> list[BlockUnits]:
    """Every block's kept and removed units under per-block rates: the one choice surgery cuts,
    ``masked_plan`` zeroes and compensation fits (a recorded shape wins over its rate).

    Args:
        scores: importance scores of the dense model; None keeps every unit (an all-zero plan).
        attention_shapes: per block [KV groups, query heads per group] a plan recorded, or None.
    """
    out = []
    for i, layer in enumerate(lm.adapter.layers(lm.model)):
        geom = lm.adapter.geometry(layer)
        if scores is None:
            kept_kv, kept_heads, kept_channels = (
                list(range(geom.n_kv_heads)),
                list(range(geom.n_heads)),
                list(range(geom.intermediate_size)),
            )
        else:
            shape = AttentionShape(*attention_shapes[i]) if attention_shapes is not None else None
            kept_kv, kept_heads, kept_channels = layer_selection(
                lm.adapter, layer, scores.layers[i], attention_rates[i], mlp_rates[i], channel_multiple, shape
            )
        out.append(
            BlockUnits(
                kept_kv,
                kept_heads,
                kept_channels,
                tuple(sorted(set(range(geom.n_heads)) - set(kept_heads))),
                tuple(sorted(set(range(geom.intermediate_size)) - set(kept_channels))),
            )
        )
    return out


def plan_units(lm: LoadedModel, plan: RatePlan, scores: ImportanceScores | None) -> list[BlockUnits]:
    """`units_by_block` of a plan: its rates, channel multiple and recorded attention shapes."""
    return units_by_block(lm, plan.attention_rates, plan.mlp_rates, plan.channel_multiple, scores, plan.attention_shapes)


@contextlib.contextmanager
def masked_plan(
    lm: LoadedModel,
    attention_rates: Sequence[float],
    mlp_rates: Sequence[float],
    scores: ImportanceScores,
    channel_multiple: int,
    attention_shapes: Sequence[Sequence[int]] | None = None,
) -> Iterator[None]:
    """Temporarily zero every unit a plan removes, on the dense model itself.

    Units are chosen by `units_by_block`, as `apply_plan` chooses them (recorded
    ``attention_shapes`` included), and zeroing a head's ``o_proj`` columns and a channel's
    ``down_proj`` column gives the sliced model's output (see ``slicing.zeroed_units``);
    weights are restored exactly on exit.
    """
    lm.refuse_shared("masking a plan")
    layers = lm.adapter.layers(lm.model)
    units = units_by_block(lm, attention_rates, mlp_rates, channel_multiple, scores, attention_shapes)
    with contextlib.ExitStack() as stack:
        for layer, block in zip(layers, units):
            if block.cuts:
                stack.enter_context(zeroed_units(lm.adapter, layer, block.removed_heads, block.removed_channels))
        yield


def apply_plan(lm: LoadedModel, plan: RatePlan, scores: ImportanceScores | None) -> PruneResult:
    """Prune ``lm`` in place as ``plan`` says and return what was kept.

    All or nothing: every block's units are chosen before any is cut, and a failure while
    cutting (or a parameter count other than the plan's prediction) puts every block back, so
    ``lm`` is then exactly as it was, fingerprint included. ``plan`` itself is not changed.

    Args:
        lm: a LoadedModel, not ``shared`` (its model is modified; its fingerprint is refreshed).
        plan: a RatePlan for this model (checked).
        scores: importance scores from the same dense model; may be None only for
            an all-zero plan.
    Returns:
        PruneResult, whose ``plan`` is a copy of ``plan`` with the parameter counts recounted
        from this model's geometry (a hand-written plan may carry none, or stale ones).
    Raises:
        PlanError: the plan is for another model, or has rates without ``scores``.
        SharedModelError: ``lm`` is shared (prune a ``private()`` copy).
        InvariantError: the cut model breaks a shape or count (a bug); ``lm`` is put back.
    """
    lm.refuse_shared("surgery")
    plan = dataclasses.replace(plan).validate()  # validate() normalises the rates: on our copy, not the caller's
    plan.check_model(lm)
    plan.params = plan_params(lm, plan, adds_biases(plan.compensation))
    if scores is None and (any(plan.attention_rates) or any(plan.mlp_rates)):
        raise PlanError("importance scores are needed for a plan with non-zero rates")
    layers = lm.adapter.layers(lm.model)
    chosen = plan_units(lm, plan, scores)
    result = PruneResult(plan=plan, params_before=lm.param_count())
    with restored_on_failure(lm.adapter, layers):
        for layer, block in zip(layers, chosen):
            if block.removed_heads:
                slice_attention_(lm.adapter, layer, block.kept_kv, block.kept_heads)
            if block.removed_channels:
                slice_mlp_(lm.adapter, layer, block.kept_channels)
            result.kept_kv_heads.append(block.kept_kv)
            result.kept_heads.append(block.kept_heads)
            result.kept_channels.append(block.kept_channels)
        check_count(lm, result)
    return finish_surgery(lm, result)


def check_count(lm: LoadedModel, result: PruneResult) -> None:
    """InvariantError unless the pruned model has the parameter count its plan predicts (a bug)."""
    result.params_after = lm.param_count()
    expected = result.plan.params["pruned_total"]
    if result.params_after != expected:
        raise InvariantError(f"the pruned model has {result.params_after} parameters, the plan predicted {expected}")


def finish_surgery(lm: LoadedModel, result: PruneResult) -> PruneResult:
    """Count the pruned model against the plan's prediction and record where it came from."""
    check_count(lm, result)
    plan = result.plan
    # A dense model records the name it was loaded under (absolute for a folder), not the plan file's
    # own, which an older plan may hold relative to another working folder.
    base = lm.name if lm.pruned_from is None else plan.model
    lm.refresh_fingerprint()
    lm.pruned_from = {"model": base, "fingerprint": plan.model_fingerprint, "plan": plan.to_dict()}
    log.info("pruned %s: %d -> %d parameters", lm.name, result.params_before, result.params_after)
    return result
