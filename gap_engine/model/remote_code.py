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

gap itself never runs a folder's code (``code_refusal``): it rebuilds its own checkpoints with
its own classes, passes ``trust_remote_code=False`` to every transformers load, and refuses a
folder whose ``config.json`` or ``tokenizer_config.json`` names code in ``auto_map`` (where
transformers would otherwise ask "Do you wish to run the custom code? [y/N]", or run it).
The one exception is the ``auto_map`` it writes itself, accepted only beside a modeling file
byte-identical to its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gap_engine.core.errors import ExportError, ModelLoadError
from gap_engine.model.adapters import MODEL_TYPES, model_type_facts

MODELING_FILE = "modeling_gap_pruned.py"
MODELING_SOURCE = Path(__file__).with_name(MODELING_FILE)


def auto_map_for(model_type: str) -> dict[str, str]:
    """The ``auto_map`` entry that points transformers' Auto classes at the remote code
    (the classes the model type's adapter names, ``ModelTypeFacts.remote_classes``).

    Raises:
        ExportError: a model type the remote code does not cover.
    """
    facts = model_type_facts(model_type)
    if facts is None:
        raise ExportError(f"no transformers remote code for model type '{model_type}'; covered: {', '.join(sorted(MODEL_TYPES))}")
    config_class, model_class = facts.remote_classes
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


# The files whose ``auto_map`` makes transformers import a folder's Python.
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json")


_CHECKED_BYTES = 64 << 20  # a tokenizer_config.json listing many added tokens runs to megabytes


class _Unchecked(Exception):
    """A file too large to be read for ``auto_map``: refused rather than left unread."""


def _auto_map(path: Path) -> object:
    """``auto_map`` of a JSON file, or None (no file, no field, or no JSON transformers could read either).

    Read with the plain JSON parser transformers uses, not gap's strict one: a foreign config
    legitimately holds what gap's own files may not (``model_max_length: 1e30`` as a 31-digit
    integer), and a file we could not parse would be one transformers reads.
    """
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as handle:
            raw = handle.read(_CHECKED_BYTES + 1)
    except OSError:
        return None  # unreadable here is unreadable to transformers too
    if len(raw) > _CHECKED_BYTES:
        raise _Unchecked(f"its {path.name} is too large to be checked for code ({_CHECKED_BYTES >> 20} MiB at most)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None  # not JSON (or nested past the parser): transformers cannot read it either
    return data.get("auto_map") if isinstance(data, dict) else None


def code_refusal(folder: str | Path, gap_checkpoint: bool) -> str | None:
    """Why loading ``folder`` with transformers would import Python that is not gap's own, or None.

    Args:
        folder: a model folder, checkpoint or hub snapshot.
        gap_checkpoint: the folder holds gap's checkpoint marker: its config.json may carry the
            ``auto_map`` gap writes, beside a modeling file byte-identical to ``MODELING_SOURCE``.
    """
    folder = Path(folder)
    for name in CODE_NAMING_FILES:
        try:
            auto_map = _auto_map(folder / name)
        except _Unchecked as exc:
            return str(exc)
        if auto_map is None:
            continue
        if gap_checkpoint and name == "config.json" and _is_our_auto_map(folder, auto_map):
            if _is_our_modeling_file(folder / MODELING_FILE):
                continue
            return f"its {MODELING_FILE} is not gap's own (edited, or written by another gap version)"
        return f"its {name} names code of its own in auto_map ({_named_code(auto_map)})"
    return None


def _is_our_auto_map(folder: Path, auto_map: object) -> bool:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))  # parsed already by _auto_map
    model_type = config.get("model_type")
    return model_type_facts(model_type) is not None and auto_map == auto_map_for(model_type)


def _is_our_modeling_file(path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.read_bytes() == MODELING_SOURCE.read_bytes()
    except OSError:
        return False


def _named_code(auto_map: object) -> str:
    values = list(auto_map.values()) if isinstance(auto_map, dict) else [auto_map]
    names = sorted({str(name) for value in values for name in (value if isinstance(value, list) else [value]) if name})
    shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
    return shown[:160] or "empty"


def refuse_foreign_code(folder: str | Path, gap_checkpoint: bool) -> None:
    """ModelLoadError (one line) when ``folder`` names code that is not gap's own (``code_refusal``).

    Also makes any transformers load in this process refuse, rather than ask, where it would
    prompt to run code: a prompt on stdout that waits for an answer is no way to say no.
    """
    forbid_code_prompts()
    why = code_refusal(folder, gap_checkpoint)
    if why:
        raise ModelLoadError(
            f"{folder}: {why}; gap never runs a model folder's code, so it is refused (load it with transformers yourself if you trust it)"
        )


def forbid_code_prompts() -> None:
    """Turn transformers' "Do you wish to run the custom code? [y/N]" prompt into an error.

    Every load passes ``trust_remote_code=False``; this covers a load we did not write (a library
    that calls ``from_pretrained`` itself): with a time-out of 0, transformers refuses at once.
    """
    import transformers.dynamic_module_utils as dynamic_modules

    dynamic_modules.TIME_OUT_REMOTE_CODE = 0
