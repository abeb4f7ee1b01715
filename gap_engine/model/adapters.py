"""Model-family adapters: where the prunable parts of a decoder-only LM live.

Every supported family (Llama/SmolLM2/Mistral, Qwen2, Qwen3, Gemma3 text) stores its
blocks as ``model.model.layers[i]`` with ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``; they differ in model_type names, biases, q/k norms and how the
final logits are formed. Those differences are data on one ``ArchitectureAdapter``, found in
a registry keyed by ``config.model_type`` (the way llm-compressor keys its layer mappings),
so no other module carries its own ``if model_type == ...`` list.

Head geometry is read from the tensors, not from the config, so an adapter works the same
on a dense model and on one whose layers were pruned to different widths.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class ArchitectureAdapter:
    """Names and conventions of one model family."""

    family: str  # human name shown in errors and listings
    model_types: tuple[str, ...]  # config.model_type values this adapter serves
    attention_name: str = "self_attn"
    mlp_name: str = "mlp"
    query_name: str = "q_proj"
    key_name: str = "k_proj"
    value_name: str = "v_proj"
    output_name: str = "o_proj"
    gate_name: str = "gate_proj"
    up_name: str = "up_proj"
    down_name: str = "down_proj"

    # ---- where things are -------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        """The bare decoder (embeddings, blocks, final norm) of a *ForCausalLM model."""
        return model.model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.decoder(model).layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attention_name)

    def mlp(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.mlp_name)

    def attention_projections(self, layer: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """(q, k, v, o) linear layers of a block."""
        attn = self.attention(layer)
        return tuple(getattr(attn, n) for n in (self.query_name, self.key_name, self.value_name, self.output_name))

    def mlp_projections(self, layer: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down) linear layers of a block."""
        mlp = self.mlp(layer)
        return tuple(getattr(mlp, n) for n in (self.gate_name, self.up_name, self.down_name))

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and any logit soft-capping, as the model's own forward does."""
        logits = self.lm_head(model)(self.final_norm(model)(hidden))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- geometry ---------------------------------------------------------------------
    def geometry(self, layer: nn.Module) -> LayerGeometry:
        attn = self.attention(layer)
        q, k, _, _ = self.attention_projections(layer)
        head_dim = attn.head_dim
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


LLAMA = ArchitectureAdapter(family="Llama (Llama 2/3, SmolLM2, Mistral)", model_types=("llama", "mistral"))
QWEN = ArchitectureAdapter(family="Qwen2/Qwen3", model_types=("qwen2", "qwen3"))
GEMMA3 = ArchitectureAdapter(family="Gemma3 text", model_types=("gemma3_text",))

ADAPTERS: dict[str, ArchitectureAdapter] = {t: a for a in (LLAMA, QWEN, GEMMA3) for t in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model_or_config) -> ArchitectureAdapter:
    """The adapter for a model (or its config), or UnsupportedArchitectureError naming the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture '{model_type}' is not supported; supported model types: {', '.join(supported_model_types())}"
        ) from None
