"""Storage precision of a pruned checkpoint, and the fingerprint of the weights as stored.

Checkpoints are stored in bfloat16 by default (float16 and float32 on request), which halves
the folder; tied tensors stay one tensor. The recorded fingerprint is that of the weights as
gap's loader rebuilds them (upcast to float32, as the engine computes), so a bfloat16 folder
still verifies when it is read back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gap_engine.core.config import SAVE_DTYPES as SAVE_DTYPE_NAMES
from gap_engine.core.errors import ExportError
from gap_engine.core.fingerprint import state_fingerprint
from gap_engine.core.jsontext import json_text

log = logging.getLogger(__name__)

SAVE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}
EVAL_REPORT_FILE = "eval_report.json"  # an evaluation report saved with the checkpoint, for its card


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A storage dtype by name ('bfloat16', 'float16', 'float32', or 'bf16'/'fp16'/'fp32').

    Raises:
        ExportError: any other name.
    """
    if isinstance(name, torch.dtype) and name in SAVE_DTYPES.values():
        return name
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in SAVE_DTYPES:
        raise ExportError(f"unknown dtype '{name}'; choose one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (the names config.json and SAVE_DTYPES use)."""
    return str(dtype).removeprefix("torch.")


def cast_state_dict(model: nn.Module, dtype: str | torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict with floating tensors in ``dtype``; tied tensors stay shared.

    transformers' ``save_pretrained`` drops a tied copy (the LM head of SmolLM2) only when
    both names point at the same storage, so each distinct tensor is cast exactly once.

    Raises:
        ExportError: a weight that does not fit float16's range (it would become inf).
    """
    target = parse_dtype(dtype)
    cast: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        # Same memory, same view: the tied copies of one parameter.
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            name if not tensor.numel() else "",
        )
        if key not in cast:
            converted = tensor.detach().to(target) if tensor.is_floating_point() else tensor.detach()
            if target == torch.float16 and tensor.is_floating_point() and not torch.isfinite(converted).all():
                raise ExportError(f"weight {name} exceeds the float16 range; save as bfloat16 or float32")
            cast[key] = converted
        out[name] = cast[key]
    return out


def stored_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """The weights fingerprint gap's loader will compute for these stored weights (``state_fingerprint``
    hashes floating values as float32, as they are read back)."""
    return state_fingerprint(state)


def round_to_storage(model: torch.nn.Module, dtype: str) -> None:
    """Round every floating parameter to ``dtype``'s precision in place (kept in its own dtype),
    so what is measured in memory is exactly what a checkpoint in ``dtype`` stores."""
    target = parse_dtype(dtype)
    with torch.no_grad():
        for param in {id(p): p for p in model.parameters()}.values():
            if param.is_floating_point() and param.dtype != target:
                param.copy_(param.to(target).to(param.dtype))


def set_config_dtype(folder: Path, dtype: str | torch.dtype) -> None:
    """Record the storage dtype in config.json, where ``from_pretrained(dtype="auto")`` reads it."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = dtype_name(parse_dtype(dtype))
    path.write_text(json_text(config, str(path), indent=2) + "\n")


def read_eval_report(folder: Path) -> dict[str, Any] | None:
    """The evaluation report saved with a checkpoint (for its model card), or None."""
    from gap_engine.core.errors import ExportError
    from gap_engine.core.validate import read_evaluation_file

    path = Path(folder) / EVAL_REPORT_FILE
    if not path.exists():
        return None
    try:
        return read_evaluation_file(path, ExportError)
    except ExportError as exc:  # the card is written without it; the weights are what matters
        log.warning("ignoring %s: %s", path.name, exc)
        return None
