"""What a pruning rate means in whole units, and how many parameters it removes.

A rate is the fraction of one component's parameters to remove (attention: q/k/v/o of a
block; MLP: gate/up/down). It is rounded to a shape that stays a valid, hardware-friendly
layer:

- Attention is GQA-aware: a block keeps ``g`` of its KV groups and the same number ``q`` of
  query heads in every kept group, so the kept query heads still divide evenly over the kept
  KV heads. Every (g, q) is a candidate; the one whose removed fraction is nearest the rate
  wins. Parameters go as g * (q + 1), so two shapes can tie: of those, the one with more
  query heads wins ((2, 2) over (3, 1), (1, 3) over (2, 1) with 3 KV groups of 3): the shape
  that loses less where it was measured (``docs/tables-plans-checkpoints.md``). With 3 KV groups of 3 heads the rates reach exactly 9, 6, 4, 3, 2 or 1 kept heads; with 1
  KV head of 4 (Gemma 3 270M), 4, 3, 2 or 1. A shape reached another way (iterative planning
  prunes a pruned model) may be the tie's other shape: a plan then records it
  (``RatePlan.attention_shapes``).
- MLP channels are kept in multiples of ``channel_multiple`` (default 8), at least one
  multiple; rate 0 keeps the full width even when it is not a multiple.

- Bias compensation adds a bias of the hidden width to each o_proj / down_proj whose
  component loses units, and to no other (`added_bias_params`): a component's first cut costs
  its bias, later cuts nothing more.

These functions need only the geometry, so tables, the planner and plan validation can
count parameters without touching weights. All pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from gap_engine.core.config import DEFAULT_CHANNEL_MULTIPLE
from gap_engine.model.adapters import LayerGeometry
from gap_engine.model.loaded import LoadedModel


@dataclass(frozen=True)
class AttentionShape:
    kv_groups: int  # KV heads kept
    heads_per_group: int  # query heads kept in each kept group

    @property
    def n_heads(self) -> int:
        return self.kv_groups * self.heads_per_group


def attention_params(geom: LayerGeometry, hidden: int, shape: AttentionShape, qkv_bias: bool, o_bias: bool) -> int:
    width_q = shape.n_heads * geom.head_dim
    width_kv = shape.kv_groups * geom.head_dim
    params = hidden * width_q * 2 + hidden * width_kv * 2  # q and o, k and v
    if qkv_bias:
        params += width_q + 2 * width_kv
    if o_bias:
        params += hidden
    return params


def mlp_params(hidden: int, channels: int, bias: bool) -> int:
    return 3 * hidden * channels + ((2 * channels + hidden) if bias else 0)


@lru_cache(maxsize=4096)
def _attention_shapes(geom: LayerGeometry) -> tuple[AttentionShape, ...]:
    """Every GQA shape, most query heads first (then most KV groups): the order ties are settled in."""
    shapes = [AttentionShape(g, q) for g in range(geom.n_kv_heads, 0, -1) for q in range(geom.group_size, 0, -1)]
    return tuple(sorted(shapes, key=lambda s: (-s.n_heads, -s.kv_groups)))


def attention_shape_for_rate(geom: LayerGeometry, hidden: int, rate: float, qkv_bias: bool = False, o_bias: bool = False) -> AttentionShape:
    full = AttentionShape(geom.n_kv_heads, geom.group_size)
    if rate <= 0:
        return full
    dense = attention_params(geom, hidden, full, qkv_bias, o_bias)
    best, best_gap = full, None
    for shape in _attention_shapes(geom):
        removed = 1.0 - attention_params(geom, hidden, shape, qkv_bias, o_bias) / dense
        gap = abs(removed - rate)
        # Strictly better only: the enumeration goes from most query heads to fewest, so ties keep more heads.
        if best_gap is None or gap < best_gap - 1e-12:
            best, best_gap = shape, gap
    return best


def channels_for_rate(intermediate: int, rate: float, multiple: int = DEFAULT_CHANNEL_MULTIPLE) -> int:
    if rate <= 0:
        return intermediate
    multiple = max(1, min(multiple, intermediate))
    kept = round((1.0 - rate) * intermediate / multiple) * multiple
    return int(min(max(kept, multiple), intermediate))


@dataclass(frozen=True)
class ComponentGeometry:
    """Everything needed to count one block's prunable parameters at any rate."""

    geometry: LayerGeometry
    hidden: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    down_bias: bool = False  # down_proj has a bias (a bias-compensated model's may, where gate/up have none)

    def attention_shape_at(self, rate: float) -> AttentionShape:
        return attention_shape_for_rate(self.geometry, self.hidden, rate, self.qkv_bias, self.o_bias)

    def attention_params_of(self, shape: AttentionShape) -> int:
        return attention_params(self.geometry, self.hidden, shape, self.qkv_bias, self.o_bias)

    def attention_params_at(self, rate: float) -> int:
        return self.attention_params_of(self.attention_shape_at(rate))

    def has_attention_ties(self) -> bool:
        """Whether two GQA shapes of this block have one parameter count (the tie rule picks one)."""
        sizes = [self.attention_params_of(shape) for shape in _attention_shapes(self.geometry)]
        return len(set(sizes)) < len(sizes)

    def mlp_params_at(self, rate: float, multiple: int = DEFAULT_CHANNEL_MULTIPLE) -> int:
        return mlp_params(self.hidden, channels_for_rate(self.geometry.intermediate_size, rate, multiple), self.mlp_bias)

    def params_at(self, component: str, rate: float, multiple: int = DEFAULT_CHANNEL_MULTIPLE) -> int:
        return self.attention_params_at(rate) if component == "attn" else self.mlp_params_at(rate, multiple)

    def removed_at(self, component: str, rate: float, multiple: int = DEFAULT_CHANNEL_MULTIPLE) -> int:
        return self.params_at(component, 0.0, multiple) - self.params_at(component, rate, multiple)

    def output_bias_params(self, component: str) -> int:
        """Parameters a bias on the component's output projection adds (o_proj for attention,
        down_proj for the MLP): its output width, none where it has a bias already."""
        has_bias = self.o_bias if component == "attn" else (self.down_bias or self.mlp_bias)
        return 0 if has_bias else self.hidden

    def bias_params_at(self, component: str, rate: float, multiple: int = DEFAULT_CHANNEL_MULTIPLE) -> int:
        """What bias compensation adds to the component at ``rate``: its output projection's bias
        where the rate removes units, nothing where it removes none (no input lost, no bias)."""
        return self.output_bias_params(component) if self.removed_at(component, rate, multiple) > 0 else 0


def block_geometries(lm: LoadedModel) -> list[ComponentGeometry]:
    """Per-block counting geometry of a loaded model (reads shapes, not the config)."""
    out = []
    for layer in lm.adapter.layers(lm.model):
        q, _, _, o = lm.adapter.attention_projections(layer)
        gate, _, down = lm.adapter.mlp_projections(layer)
        out.append(
            ComponentGeometry(
                geometry=lm.adapter.geometry(layer),
                hidden=q.in_features,
                qkv_bias=q.bias is not None,
                o_bias=o.bias is not None,
                mlp_bias=gate.bias is not None,
                down_bias=down.bias is not None,
            )
        )
    return out


def added_bias_params(
    geoms: Sequence[ComponentGeometry],
    attention_rates: Sequence[float],
    mlp_rates: Sequence[float],
    multiple: int = DEFAULT_CHANNEL_MULTIPLE,
) -> int:
    """The parameters bias compensation adds to a plan's model: one bias per o_proj / down_proj
    whose component the rates cut (`ComponentGeometry.bias_params_at`).

    The one count of those biases: the planner charges it to a budget, compensation checks the
    biases it installs against it, and plans and reports show it.
    """
    return sum(
        g.bias_params_at("attn", a, multiple) + g.bias_params_at("mlp", m, multiple) for g, a, m in zip(geoms, attention_rates, mlp_rates)
    )


def has_attention_ties(lm: LoadedModel) -> bool:
    """Whether any block of ``lm`` has two GQA shapes of one size (tables then key the tie rule)."""
    return any(counts.has_attention_ties() for counts in block_geometries(lm))
