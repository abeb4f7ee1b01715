"""The on-disk format of a pruned checkpoint: written by `save_pruned`, read by `read_pruned`.

A pruned checkpoint is a folder with
- ``model.safetensors`` and ``config.json`` (written by transformers' ``save_pretrained``),
  where config.json also carries ``per_layer_config``: one entry per block with its
  ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size`` (the field
  transformers uses for heterogeneous layers);
- the tokenizer files;
- ``plan.json``, ``plan.yaml`` and ``kept_indices.json`` (which heads, KV groups and MLP
  channels of the dense model each block kept);
- ``gap_pruned.json``: the marker the loader checks first (format version, base model,
  fingerprints, parameter count, storage dtype, and the compensation the kept units got);
- when compensation gave them biases, ``"gap_output_bias"`` in config.json: ``true`` when
  every block's ``o_proj`` and ``down_proj`` carries a bias, else one ``[o_proj, down_proj]``
  pair of booleans per block (a projection that lost no input gets no bias); the loader, the
  remote code and the GGUF export all read it;
- what lets other tools use it (``deploy``): ``modeling_gap_pruned.py`` and an ``auto_map``
  in config.json, so plain transformers builds the narrowed blocks with
  ``trust_remote_code=True``; a model card ``README.md``; ``eval_report.json`` when the
  model was evaluated before saving.

Weights are stored in bfloat16 unless another precision is asked for; the recorded
fingerprint is that of the stored weights upcast to float32, which is what reading back
rebuilds (the engine computes in float32).

The folder is written under a temporary name and renamed into place when complete.
Reading builds the dense architecture without initialising weights, narrows every block to
its recorded widths (``slicing.narrow_to_widths``), then loads the tensors strictly.
``loading.load_model`` wraps the result as a LoadedModel and checks its fingerprint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gap_engine.core.config import DEFAULT_SAVE_DTYPE
from gap_engine.core.errors import ModelLoadError, PlanError, first_line
from gap_engine.core.fingerprint import FINGERPRINT_FORMAT, combined_fingerprint
from gap_engine.core.fsutil import atomic_directory, refuse_special_files
from gap_engine.core.jsontext import json_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import check_per_layer_config, check_pruned_marker, parse_json, read_json_file, read_kept_indices
from gap_engine.core.validate_meaning import check_kept_fits
from gap_engine.model import declared
from gap_engine.model.adapters import adapter_for
from gap_engine.model.loaded import LoadedModel, config_digest, tokenizer_digest
from gap_engine.model.model_card import write_model_card
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.remote_code import add_remote_code, refuse_foreign_code
from gap_engine.model.slicing import add_output_biases_, layer_widths, narrow_to_widths, output_bias_layout
from gap_engine.model.storage import (
    EVAL_REPORT_FILE,
    cast_state_dict,
    dtype_name,
    parse_dtype,
    set_config_dtype,
    stored_fingerprint,
)

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
PRUNED_MARKER = "gap_pruned.json"  # written last; its presence makes a folder a gap checkpoint
# transformers' switch for reading a per-layer width from the global config (see save_pruned).
GLOBAL_WIDTH_READS = "allow_global_per_layer_attribute_access"
# config.json's record of bias compensation: true (every block's o_proj and down_proj has a
# bias) or per block [o_proj, down_proj] booleans (the name modeling_gap_pruned.py reads too).
OUTPUT_BIAS = "gap_output_bias"
BiasLayout = list[tuple[bool, bool]]  # per block: whether its o_proj and its down_proj carry a bias


def output_bias_record(layout: BiasLayout) -> bool | list[list[bool]] | None:
    """What config.json records of a model's output biases: true when every block has both, the
    per-block pairs when only some do, None (nothing written) when none does."""
    if layout and all(attention and mlp for attention, mlp in layout):
        return True
    if any(attention or mlp for attention, mlp in layout):
        return [[attention, mlp] for attention, mlp in layout]
    return None


def read_output_bias_record(value: object, num_layers: int, where: str) -> BiasLayout | None:
    """The per-block layout config.json's ``gap_output_bias`` records (None: no output bias).

    Raises:
        ModelLoadError: neither a boolean nor one [o_proj, down_proj] pair of booleans per block.
    """
    if value is False:
        return None
    if value is True:
        return [(True, True)] * num_layers
    if (
        isinstance(value, list)
        and len(value) == num_layers
        and all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(flag, bool) for flag in pair) for pair in value)
    ):
        return [(pair[0], pair[1]) for pair in value]
    raise ModelLoadError(f"{where}/config.json {OUTPUT_BIAS} must be true, false or one [o_proj, down_proj] pair of true/false per layer")


def _folder_fingerprint(folder: Path, state: dict[str, torch.Tensor]) -> str:
    """What loading ``folder`` will call the model: the stored weights (read back as float32) with
    the config and tokenizer as they are read back from its files. transformers picks the
    tokenizer class from the family (a Qwen2 config makes any tokenizer.json Qwen2's pipeline),
    so the tokenizer is read back here rather than taken from the model in memory."""
    config, _, _ = _read_config(folder)
    return combined_fingerprint(stored_fingerprint(state), config_digest(config), tokenizer_digest(read_tokenizer(folder, config)))


def is_pruned_checkpoint(path: str | Path) -> bool:
    """True for a folder written by `save_pruned`."""
    return (Path(path) / PRUNED_MARKER).is_file()


def save_pruned(
    lm: LoadedModel,
    plan: RatePlan,
    kept_indices: dict[str, Any],
    out_dir: str | Path,
    dtype: str = DEFAULT_SAVE_DTYPE,
    eval_report: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
) -> Path:
    """Write a pruned LoadedModel, its plan and kept indices to ``out_dir`` (replaced atomically).

    Args:
        lm: the pruned LoadedModel (its model, tokenizer and adapter are written).
        plan: the plan it was pruned with.
        kept_indices: surgery's record of which heads, KV groups and channels each block kept.
        out_dir: the checkpoint folder.
        dtype: storage precision, one of config.SAVE_DTYPES.
        eval_report: an ``EvalReport.to_dict()`` of this pruned model, for the model card.
        recovery: what a recovery fine-tune ran (``recover.files.card_summary``), for the model card.
    Returns:
        ``out_dir``.
    Raises:
        ExportError: an unknown dtype, a weight beyond float16's range, a family without remote code.
    """
    out_dir = Path(out_dir)
    widths = layer_widths(lm.adapter, lm.model)
    state = cast_state_dict(lm.model, dtype)
    with atomic_directory(out_dir) as tmp:
        # a copy: saving pops the dict's entries. (The ignore: LoadedModel.model is typed as the Module it
        # is; save_pretrained is transformers' own, and its wrapped signature does not type-check.)
        lm.model.save_pretrained(tmp, state_dict=dict(state))  # type: ignore[operator]
        set_config_dtype(tmp, dtype)
        lm.tokenizer.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config["per_layer_config"] = {str(i): w for i, w in enumerate(widths)}
        # A plain AutoTokenizer.from_pretrained(folder) builds the family's own config first, and
        # its width checks read the global head counts; this lets them read the dense values
        # (the remote code narrows the blocks, and turns the strict reads back on once built).
        config[GLOBAL_WIDTH_READS] = True
        bias_record = output_bias_record(output_bias_layout(lm.adapter, lm.model))
        if bias_record is not None:
            config[OUTPUT_BIAS] = bias_record
        config_path.write_text(json_text(config, "config.json", indent=2) + "\n")
        (tmp / "plan.json").write_text(plan.to_json())
        (tmp / "plan.yaml").write_text(plan.to_yaml())
        (tmp / "kept_indices.json").write_text(json_text(kept_indices, "kept_indices.json") + "\n")
        marker = {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "base_model": plan.model,
            "base_fingerprint": plan.model_fingerprint,
            "plan_hash": plan.content_hash(),  # the same identity the explorer and the run history show
            "fingerprint": _folder_fingerprint(tmp, state),
            "fingerprint_format": FINGERPRINT_FORMAT,
            "param_count": lm.param_count(),
            "widths": widths,
            "dtype": dtype_name(parse_dtype(dtype)),
            # what the kept units got after the cut (compensation_pass); None: surgery alone
            "compensation": (lm.pruned_from or {}).get("compensation"),
        }
        add_remote_code(tmp)
        if eval_report is not None:
            (tmp / EVAL_REPORT_FILE).write_text(json_text(eval_report, EVAL_REPORT_FILE, indent=2, default=str) + "\n")
        write_model_card(tmp, plan, marker, eval_report, out_dir.name, recovery)
        (tmp / PRUNED_MARKER).write_text(json_text(marker, PRUNED_MARKER, indent=2) + "\n")
    log.info("saved pruned checkpoint to %s (%s)", out_dir, marker["dtype"])
    return out_dir


@dataclass
class PrunedCheckpoint:
    """A checkpoint folder read back: the narrowed model and what the folder records about it."""

    model: nn.Module  # the *ForCausalLM with every block at its recorded widths
    tokenizer: object
    plan: RatePlan | None  # plan.json, when present
    base_model: str | None  # the dense model it was pruned from
    base_fingerprint: str | None  # that model's fingerprint
    fingerprint: str | None  # the pruned model's fingerprint recorded at save time
    fingerprint_format: int = 1  # 1: a sample of the weights only (``fingerprint.sampled_state_fingerprint``)
    compensation: dict[str, Any] | None = None  # the marker's record of the compensation (None: surgery alone)


@dataclass
class CheckpointFiles:
    """What a checkpoint folder's small files say, each one checked; no tensor is read."""

    marker: dict[str, Any]  # gap_pruned.json, its fields type-checked
    config: Any  # the dense architecture's transformers config (per_layer_config and auto_map left out)
    widths: list[dict[str, Any]]  # per block: num_attention_heads, num_key_value_heads, intermediate_size
    tokenizer: object
    plan: RatePlan | None  # plan.json, when present
    output_bias: BiasLayout | None = None  # per block, whether o_proj and down_proj carry a bias (None: none does)


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json_file(path, LIMITS.metadata_bytes, str(path), ModelLoadError)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not whole (not a regular file, an unreadable header, a header
    that promises more or fewer bytes than the file holds), or None; reads the header only."""
    if not path.is_file():
        return f"{path.name} is not a regular file"
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if size < 8 or header_len > min(size - 8, LIMITS.metadata_bytes * 100):
                return f"{path.name} is truncated ({size:,} bytes)"
            header = parse_json(handle.read(header_len).decode("utf-8"), f"{path.name} header", ModelLoadError)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, ModelLoadError) as exc:
        return f"{path.name} is unreadable: {first_line(exc)}"
    expected = 8 + header_len + max(ends, default=0)
    if expected != size:
        return f"{path.name} holds {size:,} bytes, its header describes {expected:,}"
    return None


def _check_weight_files(folder: Path) -> None:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{folder} holds no .safetensors file")
    for shard in shards:
        problem = safetensors_problem(shard)
        if problem:
            raise ModelLoadError(f"{folder}: {problem}")


def _load_tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    _check_weight_files(folder)
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:  # safetensors raises several kinds on a damaged file
            raise ModelLoadError(f"cannot read {shard.name}: {first_line(exc)}") from None
    return state


def _read_config(folder: Path) -> tuple[Any, list[dict[str, Any]], BiasLayout | None]:
    """The dense architecture's config, the per-block widths of config.json and its output biases."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_dict = _read_json(folder / "config.json")
    config_dict.pop(GLOBAL_WIDTH_READS, None)
    bias_record = config_dict.pop(OUTPUT_BIAS, False)
    config_dict.pop("auto_map", None)  # it points transformers at the remote code; here gap narrows the blocks
    widths = check_per_layer_config(config_dict.pop("per_layer_config", None), config_dict.get("num_hidden_layers"), str(folder))
    output_bias = read_output_bias_record(bias_record, len(widths), str(folder))
    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"{folder}: unknown model_type {model_type!r}")
    try:
        return CONFIG_MAPPING[model_type].from_dict(config_dict), widths, output_bias
    except Exception as exc:  # transformers validates configs with several exception kinds
        raise ModelLoadError(f"{folder}/config.json is not a valid {model_type} config: {first_line(exc)}") from None


def _build_narrowed(
    folder: Path, config: Any, widths: list[dict[str, Any]], output_bias: BiasLayout | None, device: str | None = None
) -> Any:
    """The architecture of ``config`` (a transformers *ForCausalLM, typed Any as transformers
    returns it) with every block at ``widths`` (and biases on the o_proj and down_proj that
    ``output_bias`` names), weights uninitialised (on ``device`` "meta": shapes only, no
    memory, for checking the files)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    adapter = adapter_for(config)
    try:
        with no_init_weights(), torch.device(device) if device else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except Exception as exc:  # an edited config (0 KV heads, odd sizes) fails in many ways inside transformers
        raise ModelLoadError(f"{folder}/config.json does not build a model: {type(exc).__name__}: {first_line(exc)}") from None
    try:
        narrow_to_widths(adapter, model, widths)
    except (ValueError, KeyError, TypeError, ZeroDivisionError, IndexError) as exc:
        raise ModelLoadError(f"{folder}: per_layer_config does not fit the architecture: {first_line(exc)}") from None
    if output_bias is not None:
        add_output_biases_(adapter, model, output_bias)
    return model


# The files a tokenizer is read from; a change to any of them (size, time) reads it again.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
)  # fmt: skip
_TOKENIZERS: dict[
    tuple[str, tuple[tuple[str, int, int], ...]], object
] = {}  # (folder, its tokenizer files' stats) -> tokenizer, newest last
_TOKENIZERS_KEPT = 8
_TOKENIZERS_LOCK = threading.Lock()


def read_tokenizer(folder: str | Path, config: Any = None) -> object:
    """``AutoTokenizer.from_pretrained(folder)`` from local files, read once per process while
    its files are unchanged: a command checks a folder's tokenizer before it loads the model
    (and the model's load reuses it). Tokenizers are not changed after loading (a missing pad
    token is set to EOS, the same each time), so one object serves every load.

    Args:
        folder: a model folder or checkpoint.
        config: the transformers config, for a checkpoint whose config.json a plain read cannot parse.
    Raises:
        whatever transformers raises on damaged files.
    """
    from transformers import AutoTokenizer

    folder = Path(folder).resolve()
    refuse_foreign_code(folder, is_pruned_checkpoint(folder))
    stats = []
    for name in TOKENIZER_FILES:
        try:
            info = (folder / name).stat()
        except OSError:
            continue
        stats.append((name, info.st_size, info.st_mtime_ns))
    key = (str(folder), tuple(stats))
    with _TOKENIZERS_LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
    extra = {"config": config} if config is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False, **extra)
    with _TOKENIZERS_LOCK:
        _TOKENIZERS[key] = tokenizer
        while len(_TOKENIZERS) > _TOKENIZERS_KEPT:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    return tokenizer


def inspect_pruned(folder: str | Path) -> CheckpointFiles:
    """Check everything a checkpoint folder holds except the tensors' values, reading no tensor.

    The marker, config.json (built on the meta device and narrowed, so an edited config fails
    here), every weights file's header, the tokenizer, plan.json (its layer count that of
    config.json) and kept_indices.json (`validate_meaning.check_kept_fits`). Commands call this before
    they read any text, so a damaged checkpoint is one line and no work.

    Raises:
        ModelLoadError (PlanError for plan.json): the first file found wrong.
    """
    folder = Path(folder)
    refuse_special_files(folder, ModelLoadError)  # a FIFO named model.safetensors would block the read
    marker = check_pruned_marker(_read_json(folder / PRUNED_MARKER), str(folder))
    if marker.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ModelLoadError(f"{folder}: checkpoint format {marker.get('format_version')!r} is not supported")
    config, widths, output_bias = _read_config(folder)  # reads config.json as data (its auto_map left out): no code runs
    refuse_foreign_code(folder, gap_checkpoint=True)
    _build_narrowed(folder, config, widths, output_bias, device="meta")
    _check_weight_files(folder)
    # config= stops AutoTokenizer from re-reading config.json, whose per_layer_config it cannot parse.
    try:
        tokenizer = read_tokenizer(folder, config)
    except Exception as exc:  # tokenizers raise many kinds on a damaged tokenizer.json
        raise ModelLoadError(f"{folder}: the tokenizer files cannot be read: {type(exc).__name__}: {first_line(exc)}") from None
    plan = RatePlan.load(folder / "plan.json") if (folder / "plan.json").is_file() else None
    if plan is not None and plan.num_layers != len(widths):
        raise PlanError(f"{folder}/plan.json is for {plan.num_layers} layers, but config.json has {len(widths)}")
    if (folder / "kept_indices.json").exists():  # copied into every re-saved and recovered checkpoint
        dense = {name: getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
        check_kept_fits(read_kept_indices(folder, ModelLoadError), widths, dense, str(folder), ModelLoadError)
    return CheckpointFiles(marker=marker, config=config, widths=widths, tokenizer=tokenizer, plan=plan, output_bias=output_bias)


def read_pruned(folder: str | Path) -> PrunedCheckpoint:
    """Rebuild the model of a checkpoint written by `save_pruned`.

    Raises:
        ModelLoadError: missing or inconsistent files, or tensors that do not match.
    """
    folder = Path(folder)
    files = inspect_pruned(folder)
    config = files.config
    model = _build_narrowed(folder, config, files.widths, files.output_bias)
    state = _load_tensors(folder)
    try:
        missing_keys, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise ModelLoadError(f"{folder}: tensors do not match the recorded widths: {first_line(exc)}") from None
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    declared.refuse_undeclared(str(folder), set(missing_keys) - tied, unexpected)
    # A tied head is stored once; stored twice it must be the same tensor (refuse_untied_head).
    if tied and ("lm_head.weight" not in state or torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)):
        model.lm_head.weight = model.model.embed_tokens.weight
    declared.refuse_untied_head(str(folder), model)
    return PrunedCheckpoint(
        model=model,
        tokenizer=files.tokenizer,
        plan=files.plan,
        base_model=files.marker.get("base_model"),
        base_fingerprint=files.marker.get("base_fingerprint"),
        fingerprint=files.marker.get("fingerprint"),
        fingerprint_format=files.marker.get("fingerprint_format") or 1,
        compensation=files.marker.get("compensation"),
    )
