"""The transformers remote-code hook of a pruned checkpoint.

``modeling_gap_pruned.py`` (beside this module) is the modeling code: it imports only torch
and transformers, so it runs where gap_engine is not installed. ``add_remote_code`` copies
it into a checkpoint folder and names its classes in config.json's ``auto_map``; then

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

rebuilds the pruned model with the family's own transformers classes. This is the way
heterogeneous-width models are published (Nemotron-NAS, DeciLM): transformers 5.24 parses
``per_layer_config`` but its Llama/Mistral/Qwen/Gemma classes still build every block from
the global widths and their configs refuse per-layer head counts, so a folder without
remote code cannot be loaded by the library alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gap_engine.core.errors import ExportError

MODELING_FILE = "modeling_gap_pruned.py"
MODELING_SOURCE = Path(__file__).with_name(MODELING_FILE)

# config.model_type -> (config class, causal-LM class) in modeling_gap_pruned.py
REMOTE_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("GapPrunedLlamaConfig", "GapPrunedLlamaForCausalLM"),
    "mistral": ("GapPrunedMistralConfig", "GapPrunedMistralForCausalLM"),
    "qwen2": ("GapPrunedQwen2Config", "GapPrunedQwen2ForCausalLM"),
    "qwen3": ("GapPrunedQwen3Config", "GapPrunedQwen3ForCausalLM"),
    "gemma3_text": ("GapPrunedGemma3TextConfig", "GapPrunedGemma3TextForCausalLM"),
}


def auto_map_for(model_type: str) -> dict[str, str]:
    """The ``auto_map`` entry that points transformers' Auto classes at the remote code.

    Raises:
        ExportError: a model type the remote code does not cover.
    """
    try:
        config_class, model_class = REMOTE_CLASSES[model_type]
    except KeyError:
        raise ExportError(
            f"no transformers remote code for model type '{model_type}'; covered: {', '.join(sorted(REMOTE_CLASSES))}"
        ) from None
    module = Path(MODELING_FILE).stem
    return {"AutoConfig": f"{module}.{config_class}", "AutoModelForCausalLM": f"{module}.{model_class}"}


def add_remote_code(folder: str | Path) -> None:
    """Copy the modeling file into ``folder`` and add ``auto_map`` to its config.json.

    Args:
        folder: a checkpoint folder being written (its config.json holds ``per_layer_config``).
    Raises:
        ExportError: config.json is missing or unreadable, or its model type is not covered.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {config_path}: {exc}") from None
    config["auto_map"] = auto_map_for(config.get("model_type"))
    shutil.copyfile(MODELING_SOURCE, folder / MODELING_FILE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
