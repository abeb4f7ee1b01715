"""Export: the plan as JSON/YAML, and a pruned checkpoint that loads again.

A pruned checkpoint is a folder with
- ``model.safetensors`` and ``config.json`` (written by transformers' ``save_pretrained``),
  where config.json also carries ``per_layer_config``: one entry per block with its
  ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size`` (the field
  transformers uses for heterogeneous layers);
- the tokenizer files;
- ``plan.json``, ``plan.yaml`` and ``kept_indices.json`` (which heads, KV groups and MLP
  channels of the dense model each block kept);
- ``gap_pruned.json``: the marker ``load_pruned`` checks first (format version, base model,
  fingerprints, parameter count).

The folder is written under a temporary name and renamed into place when complete.
``load_pruned`` builds the dense architecture without initialising weights, narrows every
block to its recorded widths, then loads the tensors strictly and checks the fingerprint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .errors import ModelLoadError
from .fsutil import atomic_directory, atomic_write_text
from .models import PRUNED_MARKER, LoadedModel, _finish
from .plan import RatePlan
from .surgery import PruneResult, current_widths, prune_attention_, prune_mlp_

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1


def save_plan(plan: RatePlan, path: str | Path) -> Path:
    """Write a plan as JSON, or YAML when the suffix is .yaml/.yml (atomically)."""
    return plan.save(path)


def save_pruned(
    lm: LoadedModel, result: PruneResult, out_dir: str | Path, dtype: str = "bfloat16", eval_report: dict | None = None
) -> Path:
    """Write the pruned model, its plan and kept indices to ``out_dir`` (replaced atomically).

    ``dtype`` is the storage precision (see ``deploy``); ``eval_report`` goes into the model card.
    """
    from .deploy import cast_state_dict, dtype_name, finish_checkpoint, parse_dtype, set_config_dtype, stored_fingerprint

    out_dir = Path(out_dir)
    widths = current_widths(lm)
    state = cast_state_dict(lm.model, dtype)
    fingerprint = stored_fingerprint(state)
    with atomic_directory(out_dir) as tmp:
        lm.model.save_pretrained(tmp, state_dict=dict(state))  # a copy: saving pops the dict's entries
        set_config_dtype(tmp, dtype)
        lm.tokenizer.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config["per_layer_config"] = {str(i): w for i, w in enumerate(widths)}
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "plan.json").write_text(result.plan.to_json())
        (tmp / "plan.yaml").write_text(result.plan.to_yaml())
        (tmp / "kept_indices.json").write_text(json.dumps(result.kept_indices()) + "\n")
        marker = {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "base_model": result.plan.model,
            "base_fingerprint": result.plan.model_fingerprint,
            "fingerprint": fingerprint,
            "param_count": lm.param_count(),
            "widths": widths,
            "dtype": dtype_name(parse_dtype(dtype)),
        }
        (tmp / PRUNED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        finish_checkpoint(tmp, result.plan, marker, eval_report, out_dir.name)
    log.info("saved pruned checkpoint to %s", out_dir)
    return out_dir


def _narrow_to_widths(lm_adapter, model, widths: list[dict]) -> None:
    layers = lm_adapter.layers(model)
    if len(widths) != len(layers):
        raise ModelLoadError(f"per_layer_config lists {len(widths)} layers, the model has {len(layers)}")
    for layer, w in zip(layers, widths):
        geom = lm_adapter.geometry(layer)
        heads, kv, channels = w["num_attention_heads"], w["num_key_value_heads"], w["intermediate_size"]
        if heads % kv or heads > geom.n_heads or kv > geom.n_kv_heads or channels > geom.intermediate_size:
            raise ModelLoadError(f"per_layer_config entry {w} does not fit the base architecture")
        if heads < geom.n_heads or kv < geom.n_kv_heads:
            # Any indices give the right shapes; the real tensors are loaded over them next.
            per_group = heads // kv
            kept_heads = [g * geom.group_size + j for g in range(kv) for j in range(per_group)]
            prune_attention_(lm_adapter, layer, list(range(kv)), kept_heads)
        if channels < geom.intermediate_size:
            prune_mlp_(lm_adapter, layer, list(range(channels)))


def load_pruned(folder: str | Path, dtype: str | None = None) -> LoadedModel:
    """Rebuild a checkpoint written by ``save_pruned``.

    Args:
        folder: the checkpoint folder.
        dtype: None (default) builds float32 whatever the storage precision, because the
            engine computes in float32; "auto" keeps the stored precision; or a dtype name.
    Raises:
        ModelLoadError: missing or inconsistent files, or tensors that do not match.
    """
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .adapters import adapter_for
    from .deploy import dtype_name, stored_fingerprint

    folder = Path(folder)
    try:
        marker = json.loads((folder / PRUNED_MARKER).read_text())
        config_dict = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{folder} is not a readable gap checkpoint: {exc}") from None
    if marker.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ModelLoadError(f"{folder}: checkpoint format {marker.get('format_version')} is not supported")
    # auto_map points transformers at the folder's remote code; gap narrows the blocks itself.
    config_dict.pop("auto_map", None)
    per_layer = config_dict.pop("per_layer_config", None)
    if not per_layer:
        raise ModelLoadError(f"{folder}/config.json has no per_layer_config")
    widths = [per_layer[str(i)] for i in range(len(per_layer))]
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"{folder}: unknown model_type {model_type!r}")
    config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    adapter = adapter_for(config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=_load_dtype(dtype, marker))
    _narrow_to_widths(adapter, model, widths)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{folder} holds no .safetensors file")
    state = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {shard.name}: {exc}") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ModelLoadError(f"{folder}: tensors do not match the recorded widths: {str(exc).splitlines()[0]}") from None
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(f"{folder}: missing tensors {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    # config= stops AutoTokenizer from re-reading config.json, whose per_layer_config it cannot parse.
    tokenizer = AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)
    plan = RatePlan.load(folder / "plan.json") if (folder / "plan.json").is_file() else None
    pruned_from = {
        "model": marker.get("base_model"),
        "fingerprint": marker.get("base_fingerprint"),
        "plan": plan.to_dict() if plan else None,
    }
    lm = _finish(model, tokenizer, str(folder), str(folder), pruned_from=pruned_from)
    # Recorded as the float32 view of the stored weights (deploy.stored_fingerprint); a model
    # built in a narrower dtype than stored has rounded them, so there is nothing to compare.
    if model.dtype == torch.float32 or dtype_name(model.dtype) == marker.get("dtype", "float32"):
        loaded = lm.fingerprint if model.dtype == torch.float32 else stored_fingerprint(model.state_dict())
        if marker.get("fingerprint") and marker["fingerprint"] != loaded:
            raise ModelLoadError(f"{folder}: weights fingerprint {loaded} differs from the recorded {marker['fingerprint']}")
    return lm


def _load_dtype(dtype: str | None, marker: dict) -> torch.dtype:
    from .deploy import parse_dtype

    if dtype is None:
        return torch.float32
    return parse_dtype(marker.get("dtype", "float32") if dtype == "auto" else dtype)


def write_kept_indices(result: PruneResult, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(result.kept_indices()) + "\n")
