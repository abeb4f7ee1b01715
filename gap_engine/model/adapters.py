"""Model-family adapters: where the prunable parts of a decoder-only LM live.

Every supported family (Llama/SmolLM2/Mistral, Qwen2, Qwen3, Gemma3 text) stores its
blocks as ``model.model.layers[i]`` with ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``; they differ in model_type names, biases, q/k norms and how the
final logits are formed. Those differences are data on one ``ArchitectureAdapter``, found in
a registry keyed by ``config.model_type`` (the way llm-compressor keys its layer mappings),
so no other module carries its own ``if model_type == ...`` list. What the later stages need to
know of each model type (its remote-code classes, whether llama.cpp's GGUF graph runs it,
whether its q/k/v carry biases by default) is a ``ModelTypeFacts`` record on the adapter, read
through ``model_type_facts`` without loading a model: adding a family is an adapter here and its
classes in ``modeling_gap_pruned.py``.

Head geometry is read from the tensors, not from the config, so an adapter works the same
on a dense model and on one whose layers were pruned to different widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gap_engine.core.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class LayerGeometry:
    """Widths of one decoder block as they are now (after any pruning)."""

    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA groups)
    head_dim: int  # per-head width
    intermediate_size: int  # MLP channels (gate/up rows, down columns)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class ModelTypeFacts:
    """What the stages beyond the model's own modules need to know of one ``config.model_type``."""

    name: str  # the config.model_type value
    label: str  # how people name it, in messages that list what is supported
    # (config class, causal-LM class) in modeling_gap_pruned.py, the remote code a checkpoint ships: that file runs where
    # gap_engine may not be installed, so it spells its pairs out and cannot read these; a test checks each is defined there
    remote_classes: tuple[str, str]
    # q/k/v carry biases even where config.json has no attention_bias (the cost model prices them)
    qkv_bias_by_default: bool = False
    # what llama.cpp's deci graph has no place for; empty when the GGUF export supports the type
    gguf_refusal: str = ""
    # the criterion that prunes GAP's DP plans when none is asked for (``plan.step``); empty: the table's own.
    # Chosen per family on the selection part of held-out text (bench/results/quality.md), never on what reports it.
    default_step: str = ""
    # the compensation after a step that leaves the kept columns as they were (not OBS) when none is asked for
    # (``prune.compensations.default_for``); empty: ``config.DEFAULT_COMPENSATION``. Chosen per family the same way.
    default_compensation: str = ""
    # the fewest calibration windows that compensation is fitted on when no count is asked (``--fit-samples``) and the
    # calibration has fewer (``prune.compensations.fit_window_count``); 0: the calibration's own. Chosen the same way.
    default_fit_windows: int = 0
    # how that fit counts its tokens when no weighting is asked (``CompensationSettings.weighting``,
    # ``prune.compensations.family_weighting``): "output-norm" only where ``output_norm_names`` name norms. Chosen the same way.
    default_fit_weighting: str = "tokens"

    @property
    def gguf_supported(self) -> bool:
        return not self.gguf_refusal


@dataclass(frozen=True)
class ArchitectureAdapter:
    """Names and conventions of one model family."""

    family: str  # human name shown in errors and listings
    types: tuple[ModelTypeFacts, ...]  # the config.model_type values this adapter serves, with their facts
    attention_name: str = "self_attn"
    mlp_name: str = "mlp"
    query_name: str = "q_proj"
    key_name: str = "k_proj"
    value_name: str = "v_proj"
    output_name: str = "o_proj"
    gate_name: str = "gate_proj"
    up_name: str = "up_proj"
    down_name: str = "down_proj"
    # the norms a block applies to o_proj's and down_proj's outputs before adding them to the residual stream (Gemma's
    # post-norms); empty where the outputs are added as they are. A norm rescales each token's output to a fixed size,
    # so an error there weighs by the inverse of the token's own output size (``CompensationSettings.weighting``).
    output_norm_names: tuple[str, str] = ("", "")

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(facts.name for facts in self.types)

    # ---- where things are -------------------------------------------------------------
    # transformers' submodules are found by name; the casts record what the family puts there.
    # A block's attention and MLP are typed Any: each family's classes carry their own
    # bookkeeping attributes (head_dim, num_key_value_groups, intermediate_size).
    def decoder(self, model: nn.Module) -> nn.Module:
        """The bare decoder (embeddings, blocks, final norm) of a *ForCausalLM model."""
        return cast(nn.Module, model.model)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return cast(nn.ModuleList, self.decoder(model).layers)

    def attention(self, layer: nn.Module) -> Any:
        return getattr(layer, self.attention_name)

    def mlp(self, layer: nn.Module) -> Any:
        return getattr(layer, self.mlp_name)

    def attention_projections(self, layer: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """(q, k, v, o) linear layers of a block."""
        attn = self.attention(layer)
        return getattr(attn, self.query_name), getattr(attn, self.key_name), getattr(attn, self.value_name), getattr(attn, self.output_name)

    def mlp_projections(self, layer: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down) linear layers of a block."""
        mlp = self.mlp(layer)
        return getattr(mlp, self.gate_name), getattr(mlp, self.up_name), getattr(mlp, self.down_name)

    def output_norm(self, layer: nn.Module, attention: bool) -> nn.Module | None:
        """The norm applied to the output of o_proj (``attention``) or down_proj before the residual, or None."""
        name = self.output_norm_names[0 if attention else 1]
        return cast(nn.Module, getattr(layer, name)) if name else None

    def final_norm(self, model: nn.Module) -> nn.Module:
        return cast(nn.Module, self.decoder(model).norm)

    def lm_head(self, model: nn.Module) -> nn.Module:
        return cast(nn.Module, model.lm_head)

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and any logit soft-capping, as the model's own forward does."""
        logits: torch.Tensor = self.lm_head(model)(self.final_norm(model)(hidden))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- geometry ---------------------------------------------------------------------
    def geometry(self, layer: nn.Module) -> LayerGeometry:
        attn = self.attention(layer)
        q, k, _, _ = self.attention_projections(layer)
        head_dim = int(attn.head_dim)
        gate, _, _ = self.mlp_projections(layer)
        return LayerGeometry(
            n_heads=q.out_features // head_dim,
            n_kv_heads=k.out_features // head_dim,
            head_dim=head_dim,
            intermediate_size=gate.out_features,
        )

    def set_head_counts(self, layer: nn.Module, n_heads: int, n_kv_heads: int) -> None:
        """Update the attention module's bookkeeping after its projections were sliced.

        The forward infers the head count from the projection shapes (``view(..., -1, head_dim)``)
        but repeats K/V by ``num_key_value_groups``, which must follow the new grouping.
        """
        attn = self.attention(layer)
        attn.num_key_value_groups = n_heads // n_kv_heads
        for name, value in (("num_heads", n_heads), ("num_key_value_heads", n_kv_heads)):
            if hasattr(attn, name):
                setattr(attn, name, value)


LLAMA = ArchitectureAdapter(
    family="Llama (Llama 2/3, SmolLM2, Mistral)",
    types=(
        # SmolLM2: OBS ties the table's criterion with bias at 10-30% and beats it at 40-50% on selection
        ModelTypeFacts("llama", "Llama, SmolLM2", ("GapPrunedLlamaConfig", "GapPrunedLlamaForCausalLM"), default_step="obs"),
        ModelTypeFacts("mistral", "Mistral", ("GapPrunedMistralConfig", "GapPrunedMistralForCausalLM")),
    ),
)
QWEN = ArchitectureAdapter(
    family="Qwen2/Qwen3",
    types=(
        # Qwen2's q/k/v always have biases (transformers' Qwen2 has no attention_bias switch); deci reads them.
        ModelTypeFacts("qwen2", "Qwen2", ("GapPrunedQwen2Config", "GapPrunedQwen2ForCausalLM"), qkv_bias_by_default=True),
        ModelTypeFacts("qwen3", "Qwen3", ("GapPrunedQwen3Config", "GapPrunedQwen3ForCausalLM"), gguf_refusal="Qwen3's per-head q/k norms"),
    ),
)
GEMMA3 = ArchitectureAdapter(
    family="Gemma3 text",
    types=(
        ModelTypeFacts(
            "gemma3_text",
            "Gemma 3",
            ("GapPrunedGemma3TextConfig", "GapPrunedGemma3TextForCausalLM"),
            gguf_refusal="Gemma 3's extra norms, scaled embeddings and logit soft-capping",
            # Gemma 3 270M, DP's plans (bench/results/quality_gemma.md, selection part): bias+refit below bias in mean KL
            # at every budget 10-50% and lowest of the four at 20-50% (at 10% refit and none are 3% lower)
            default_compensation="bias+refit",
            # fitted on 64 windows of the table's text, not its 16: DP's selection KL 13% lower at 20% and 7% at 40% on
            # every source, 128 no better than 64 (bench/results/refit_windows_gemma.md, selection part)
            default_fit_windows=64,
            # fitted through the post-norms: at 20% and 40% every method's every fit has a lower selection KL weighted
            # than not (DP's bias+refit 0.57 against 0.82 and 1.28 against 1.50; bench/results/quality_gemma_norm.md),
            # DP's on every source (bench/results/output_norm_gemma.md); both selection parts
            default_fit_weighting="output-norm",
        ),
    ),
    output_norm_names=("post_attention_layernorm", "post_feedforward_layernorm"),
)

ADAPTERS: dict[str, ArchitectureAdapter] = {t: a for a in (LLAMA, QWEN, GEMMA3) for t in a.model_types}
MODEL_TYPES: dict[str, ModelTypeFacts] = {facts.name: facts for a in (LLAMA, QWEN, GEMMA3) for facts in a.types}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def model_type_facts(model_type: object) -> ModelTypeFacts | None:
    """The facts of a ``config.model_type`` (read from config.json, so possibly not a string), or None for one no adapter serves."""
    return MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


def qkv_bias_by_default(model_type: object) -> bool:
    """Whether a model type's q/k/v carry biases where its config.json names no attention_bias (False for one no adapter serves)."""
    facts = model_type_facts(model_type)
    return facts is not None and facts.qkv_bias_by_default


def has_output_norms(model_type: object) -> bool:
    """Whether a model type's blocks normalise the outputs of o_proj and down_proj before the residual (Gemma 3's
    post-norms), so a compensation may be fitted through them (False for one no adapter serves)."""
    adapter = ADAPTERS.get(model_type) if isinstance(model_type, str) else None
    return adapter is not None and any(adapter.output_norm_names)


def adapter_for(model_or_config: object) -> ArchitectureAdapter:
    """The adapter for a model (or its config), or UnsupportedArchitectureError naming the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    try:
        return ADAPTERS[str(model_type)]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture '{model_type}' is not supported; supported model types: {', '.join(supported_model_types())}"
        ) from None
