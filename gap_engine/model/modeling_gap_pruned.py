"""Modeling code for a checkpoint pruned by gap_engine: transformers' own models, narrower layers.

This file is copied into every pruned checkpoint folder and named in its config.json
``auto_map``, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads the checkpoint with nothing but torch and transformers installed (gap_engine is not
needed). A pruned block keeps fewer attention heads, KV heads and MLP channels than the
dense model; the widths of every block are in config.json's ``per_layer_config``, the
heterogeneous-layer field of transformers' ``PreTrainedConfig``. transformers' Llama,
Mistral, Qwen2, Qwen3 and Gemma 3 classes build every block from the global widths (their
configs even refuse to validate when the widths vary), so the classes here

- subclass each family's config only to validate the per-layer widths instead, and
- subclass each family's ``*ForCausalLM``: the library builds its usual dense skeleton
  (on the meta device when loading, so it costs no memory), then every block's q/k/v/o and
  gate/up/down projections are replaced by linears of the recorded widths, and, where
  config.json's ``"gap_output_bias"`` says so (gap's bias compensation: ``true`` for every
  block, or one ``[o_proj, down_proj]`` pair of booleans per block), ``o_proj`` and
  ``down_proj`` get a bias.

Attention, rotary embeddings, the KV cache and generation are the library's own code: the
attention infers its head count from the projection shapes and repeats K/V by
``num_key_value_groups``, which is set per block here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

    # What the mixins below are always combined with (see _family), so that their super() calls type-check.
    _ConfigMixinBase = PreTrainedConfig
    _ModelMixinBase = PreTrainedModel
else:
    _ConfigMixinBase = _ModelMixinBase = object

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
OUTPUT_BIAS = "gap_output_bias"  # config.json: true (every o_proj and down_proj has a bias) or per block [o_proj, down_proj]
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@contextlib.contextmanager
def _dense_view(config: PreTrainedConfig) -> Iterator[PreTrainedConfig]:
    """Let the library's constructors read the dense widths from a heterogeneous config.

    Outside this block a global read of a per-layer width raises, as transformers intends,
    so no later code silently uses a dense width for a pruned block.
    """
    # The library warns once per attribute on such reads; here they are deliberate.
    heterogeneity_log = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")
    level = heterogeneity_log.level
    heterogeneity_log.setLevel(logging.ERROR)
    config.allow_global_per_layer_attribute_access = True
    try:
        yield config
    finally:
        config.__dict__.pop("allow_global_per_layer_attribute_access", None)
        heterogeneity_log.setLevel(level)


def _resized_linear(old: nn.Linear, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """A linear of the new shape on the old one's device and dtype (its values are loaded later),
    with a bias when the old one had one or ``bias`` asks for it."""
    bias = bias or old.bias is not None
    return nn.Linear(in_features, out_features, bias=bias, device=old.weight.device, dtype=old.weight.dtype)


def add_output_biases(model: PreTrainedModel, record: Any) -> None:
    """Give o_proj and down_proj a bias where ``record`` (config.json's ``gap_output_bias``) says:
    every block's when it is true, else block ``i``'s o_proj when ``record[i][0]`` and its
    down_proj when ``record[i][1]`` (their values are loaded later)."""
    decoder: Any = model.model
    layers = decoder.layers
    layout = [(True, True)] * len(layers) if record is True else [tuple(pair) for pair in record]
    if len(layout) != len(layers):
        raise ValueError(f"{OUTPUT_BIAS} lists {len(layout)} layers, the model has {len(layers)}")
    for layer, wanted in zip(layers, layout):
        for owner, name, bias in ((layer.self_attn, "o_proj", wanted[0]), (layer.mlp, "down_proj", wanted[1])):
            old = getattr(owner, name)
            if bias and old.bias is None:
                setattr(owner, name, _resized_linear(old, old.in_features, old.out_features, bias=True))


def narrow_layers(model: PreTrainedModel) -> None:
    """Resize every block's projections to the widths in ``model.config.per_layer_config``."""
    config = model.config
    if not config.is_heterogeneous:
        return
    decoder: Any = model.model  # the family's decoder: its blocks, attention and MLP modules carry family attributes
    for index, layer in enumerate(decoder.layers):
        widths = config.per_layer_config[index]
        heads, kv_heads, channels = widths.num_attention_heads, widths.num_key_value_heads, widths.intermediate_size
        attention, mlp = layer.self_attn, layer.mlp
        head_dim = attention.head_dim
        hidden = attention.q_proj.in_features
        q, k, v, o = (getattr(attention, name) for name in ATTENTION_PROJECTIONS)
        attention.q_proj = _resized_linear(q, hidden, heads * head_dim)
        attention.k_proj = _resized_linear(k, hidden, kv_heads * head_dim)
        attention.v_proj = _resized_linear(v, hidden, kv_heads * head_dim)
        attention.o_proj = _resized_linear(o, heads * head_dim, hidden)
        # The forward repeats each K/V head this many times to meet the query heads.
        attention.num_key_value_groups = heads // kv_heads
        gate, up, down = (getattr(mlp, name) for name in MLP_PROJECTIONS)
        mlp.gate_proj = _resized_linear(gate, hidden, channels)
        mlp.up_proj = _resized_linear(up, hidden, channels)
        mlp.down_proj = _resized_linear(down, channels, hidden)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = channels


class _PerLayerWidthsConfig(_ConfigMixinBase):
    """Validation of per-layer widths, in place of the family's global-width checks."""

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        # save_pretrained then lists every block's widths, not only those that differ from
        # the dense ones, so a re-saved folder stays readable block by block.
        self.serialize_explicit_per_layer_config = True

    def validate_architecture(self) -> None:
        if not self.is_heterogeneous:
            super().validate_architecture()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
            return
        for index, widths in enumerate(self.per_layer_config):
            heads, kv_heads = widths.num_attention_heads, widths.num_key_value_heads
            if not (1 <= kv_heads <= heads and heads % kv_heads == 0 and widths.intermediate_size >= 1):
                raise ValueError(
                    f"layer {index}: {heads} heads over {kv_heads} KV heads and "
                    f"{widths.intermediate_size} MLP channels is not a valid pruned block"
                )


class _NarrowedCausalLM(_ModelMixinBase):
    """Builds the family's dense model, then narrows its blocks to the recorded widths."""

    def __init__(self, config: PreTrainedConfig, *args: Any, **kwargs: Any) -> None:
        with _dense_view(config):
            super().__init__(config, *args, **kwargs)
        narrow_layers(self)
        record = getattr(config, OUTPUT_BIAS, False)
        if record:
            add_output_biases(self, record)


def _family(name: str, config_base: type, model_base: type) -> tuple[type, type]:
    """The config and causal-LM classes of one family, as module-level names auto_map can find."""
    config_class = type(f"GapPruned{name}Config", (_PerLayerWidthsConfig, config_base), {"__module__": __name__})
    model_class = type(
        f"GapPruned{name}ForCausalLM", (_NarrowedCausalLM, model_base), {"__module__": __name__, "config_class": config_class}
    )
    return config_class, model_class


GapPrunedLlamaConfig, GapPrunedLlamaForCausalLM = _family("Llama", LlamaConfig, LlamaForCausalLM)
GapPrunedMistralConfig, GapPrunedMistralForCausalLM = _family("Mistral", MistralConfig, MistralForCausalLM)
GapPrunedQwen2Config, GapPrunedQwen2ForCausalLM = _family("Qwen2", Qwen2Config, Qwen2ForCausalLM)
GapPrunedQwen3Config, GapPrunedQwen3ForCausalLM = _family("Qwen3", Qwen3Config, Qwen3ForCausalLM)
GapPrunedGemma3TextConfig, GapPrunedGemma3TextForCausalLM = _family("Gemma3Text", Gemma3TextConfig, Gemma3ForCausalLM)
