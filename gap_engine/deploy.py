"""Deployable checkpoints: storage precision, the transformers hook, the model card, re-saving.

``export.save_pruned`` writes the pruned weights and calls into this module for what makes
the folder usable outside this tool:

- the weights are stored in half precision by default (bfloat16; float16 and float32 on
  request), which halves the folder; tied tensors stay one tensor;
- the checkpoint's fingerprint is that of the weights as gap's loader rebuilds them
  (upcast to float32, as the engine computes), so a bfloat16 folder still verifies;
- ``hf_remote.add_remote_code`` makes ``AutoModelForCausalLM.from_pretrained(folder,
  trust_remote_code=True)`` work without gap_engine;
- ``model_card.write_model_card`` describes what was done (README.md).

``resave_checkpoint`` rewrites an existing checkpoint in another precision (``gap export
--format hf --dtype ...``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .errors import ExportError

log = logging.getLogger(__name__)

SAVE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DEFAULT_SAVE_DTYPE = "bfloat16"  # half the bytes of float32; same exponent range, so no overflow
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
    return str(dtype).removeprefix("torch.")


def cast_state_dict(model: nn.Module, dtype: str | torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict with floating tensors in ``dtype``; tied tensors stay shared.

    transformers' ``save_pretrained`` drops a tied copy (the LM head of SmolLM2) only when
    both names point at the same storage, so each distinct tensor is cast exactly once.

    Raises:
        ExportError: a weight that does not fit float16's range (it would become inf).
    """
    target = parse_dtype(dtype)
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        # Same memory, same view: the tied copies of one parameter.
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), name if not tensor.numel() else "")
        if key not in cast:
            converted = tensor.detach().to(target) if tensor.is_floating_point() else tensor.detach()
            if target == torch.float16 and tensor.is_floating_point() and not torch.isfinite(converted).all():
                raise ExportError(f"weight {name} exceeds the float16 range; save as bfloat16 or float32")
            cast[key] = converted
        out[name] = cast[key]
    return out


def stored_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """The fingerprint gap's loader will compute for these stored weights (upcast to float32)."""
    from .models import state_fingerprint

    return state_fingerprint({name: t.to(torch.float32) if t.is_floating_point() else t for name, t in state.items()})


def set_config_dtype(folder: Path, dtype: str | torch.dtype) -> None:
    """Record the storage dtype in config.json, where ``from_pretrained(dtype="auto")`` reads it."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = dtype_name(parse_dtype(dtype))
    path.write_text(json.dumps(config, indent=2) + "\n")


def finish_checkpoint(folder: Path, plan, marker: dict, eval_report: dict | None = None, name: str | None = None) -> None:
    """Add what makes a checkpoint folder deployable: remote code, the eval report, the model card.

    Args:
        folder: the checkpoint folder being written (weights, config.json, tokenizer present).
        plan: the RatePlan that was applied.
        marker: the gap_pruned.json content.
        eval_report: an ``EvalReport.to_dict()`` of this pruned model, if one was measured.
        name: the folder's final name, for the model card's load snippets.
    """
    from .hf_remote import add_remote_code
    from .model_card import write_model_card

    add_remote_code(folder)
    if eval_report is not None:
        (folder / EVAL_REPORT_FILE).write_text(json.dumps(eval_report, indent=2, default=str) + "\n")
    write_model_card(folder, plan, marker, eval_report, name)


def read_eval_report(folder: Path) -> dict | None:
    path = Path(folder) / EVAL_REPORT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        log.warning("ignoring unreadable %s", path)
        return None


def resave_checkpoint(source: str | Path, out_dir: str | Path, dtype: str = DEFAULT_SAVE_DTYPE) -> Path:
    """Load a pruned checkpoint (verifying it) and write it again in ``dtype``.

    The plan, kept indices and any saved evaluation report travel along; the model card is
    written afresh.

    Raises:
        ModelLoadError: ``source`` is not a readable, consistent gap checkpoint.
        ExportError: ``out_dir`` is ``source`` or cannot be written, or the dtype is unknown.
    """
    from .export import load_pruned, save_pruned
    from .surgery import PruneResult

    parse_dtype(dtype)
    source, out_dir = Path(source), Path(out_dir)
    if out_dir.resolve() == source.resolve():
        raise ExportError(f"the output folder {out_dir} is the checkpoint itself; choose another")
    lm = load_pruned(source)
    if lm.pruned_from is None or lm.pruned_from.get("plan") is None:
        raise ExportError(f"{source} has no plan.json; it cannot be re-saved as a gap checkpoint")
    from .plan import RatePlan

    try:
        kept = json.loads((source / "kept_indices.json").read_text())
        result = PruneResult(
            plan=RatePlan.from_dict(lm.pruned_from["plan"]),
            kept_kv_heads=kept["kept_kv_heads"],
            kept_heads=kept["kept_heads"],
            kept_channels=kept["kept_channels"],
            params_after=lm.param_count(),
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ExportError(f"{source}/kept_indices.json is missing or malformed: {exc}") from None
    try:
        return save_pruned(lm, result, out_dir, dtype=dtype, eval_report=read_eval_report(source))
    except OSError as exc:
        raise ExportError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
