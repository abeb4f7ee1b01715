"""GGUF export for llama.cpp: a pruned (or dense) Llama-family model as the ``deci`` architecture.

llama.cpp's ``deci`` architecture (NVIDIA's Nemotron-NAS / DeciLM) reads
``deci.attention.head_count``, ``deci.attention.head_count_kv`` and
``deci.feed_forward_length`` as per-layer arrays and builds every block at its own widths;
otherwise its graph is Llama's: RMSNorm, rotary attention with GQA, optional q/k/v biases,
SiLU-gated MLP, tied or separate LM head. So every model whose blocks are exactly that
computation fits:

- Llama, SmolLM2, Mistral (``llama``/``mistral``), and
- Qwen2 (``qwen2``: Llama plus q/k/v biases, which the deci loader reads when present).

Qwen3 normalises q and k per head before the rotary embedding and Gemma 3 adds
post-norms, a scaled embedding and logit soft-capping; the deci graph has none of these,
so both are refused with a one-line error.

Conventions (as llama.cpp's own converter writes Llama models): tensors are named by the
gguf package's name map (``blk.N.attn_q.weight`` ...); q/k rows are permuted per head
from transformers' rotate-half layout to the interleaved pairs llama.cpp's "normal" rope
expects; 1-D tensors (norms, biases) stay float32; ``f16`` stores every matrix in float16,
``q8_0`` quantises every matrix whose rows are a multiple of 32 values (the q8_0 block) and
keeps the rest in float16. The tokenizer (byte-level BPE, the ``gpt2`` model of llama.cpp)
is written from the model's own tokenizer.json: token list and types, merges, special ids
and chat template. The file is written through ``fsutil.atomic_file`` like every output:
under a pid-tagged temporary name beside its target, renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from gap_engine.core.config import GGUF_OUTTYPES
from gap_engine.core.errors import ExportError, OutputError
from gap_engine.core.fsutil import atomic_file
from gap_engine.data.bos import Tokenizer
from gap_engine.model.adapters import MODEL_TYPES, model_type_facts
from gap_engine.model.loaded import LoadedModel

if TYPE_CHECKING:
    import gguf
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

ARCH = "deci"
OUTTYPES = GGUF_OUTTYPES
# The model types whose blocks are deci's computation (see module docstring), as their adapters say.
GGUF_MODEL_TYPES = tuple(name for name, facts in MODEL_TYPES.items() if facts.gguf_supported)
# Byte-level BPE pre-tokenizers recognised from tokenizer.json, by the llama.cpp name of
# the same splitting: GPT-2's regex alone, or single digits first, then GPT-2's regex.
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
_SINGLE_DIGITS = {"type": "Digits", "individual_digits": True}


@dataclass
class GgufSummary:
    """What was written."""

    path: str  # the .gguf file
    outtype: str  # f16 or q8_0
    bytes: int  # file size
    tensors: int  # tensor count
    head_count: list[int]  # per layer
    head_count_kv: list[int]  # per layer
    feed_forward_length: list[int]  # per layer
    tokenizer_pre: str  # llama.cpp pre-tokenizer name written
    kept_f16: list[str] = field(default_factory=list)  # matrices q8_0 could not take (row length)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# llama.cpp's pre-tokenizer names are short lower-case words (llama-bpe, qwen2, smollm, gpt-4o).
_TOKENIZER_PRE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def check_tokenizer_pre(name: str | None) -> None:
    """ExportError for a --tokenizer-pre that is no llama.cpp pre-tokenizer name (a path, a newline)."""
    if name is not None and not _TOKENIZER_PRE_NAME.match(name):
        raise ExportError(
            f"--tokenizer-pre {name[:60]!r} is not a llama.cpp pre-tokenizer name (lower-case letters, digits, '-', '_', '.'; e.g. llama-bpe)"
        )


def check_supported(model_type: object) -> None:
    """ExportError (one line, naming what is supported) unless the family fits GGUF ``deci``."""
    facts = model_type_facts(model_type)
    if facts is not None and facts.gguf_supported:
        return
    if not isinstance(model_type, str):  # a tampered config.json
        model_type = f"{str(model_type)[:40]} (not a name)"
    reason = f" ({facts.gguf_refusal} have no place in llama.cpp's deci graph)" if facts is not None else ""
    labels = ", ".join(MODEL_TYPES[name].label for name in GGUF_MODEL_TYPES)
    raise ExportError(
        f"GGUF export does not support model type '{model_type[:80]}'{reason}; supported: {', '.join(GGUF_MODEL_TYPES)} ({labels})"
    )


def detect_tokenizer_pre(tokenizer_json: dict[str, Any]) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level BPE tokenizer.json.

    Raises:
        ExportError: a splitting this function cannot name (pass ``tokenizer_pre`` explicitly).
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}

    def is_(node: dict[str, Any], pattern: dict[str, Any]) -> bool:
        return all(node.get(k) == v for k, v in pattern.items())

    if is_(pre, _BYTE_LEVEL):
        return "gpt-2"
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if parts and len(parts) == 2 and is_(parts[0], _SINGLE_DIGITS) and is_(parts[1], _BYTE_LEVEL):
        return "smollm"
    raise ExportError(
        f"cannot name the tokenizer's pre-tokenizer ({json.dumps(pre)[:80]}) for llama.cpp; "
        "pass tokenizer_pre (--tokenizer-pre), e.g. llama-bpe for Llama 3, qwen2 for Qwen2"
    )


def _tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: Tokenizer, vocab_size: int, tokenizer_pre: str | None) -> str:
    """Write the tokenizer keys; returns the pre-tokenizer name used."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="gap-gguf-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        path = Path(tmp) / "tokenizer.json"
        if not path.is_file():
            raise ExportError("the tokenizer has no tokenizer.json (a fast tokenizer is needed for GGUF export)")
        tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
        model = tokenizer_json.get("model") or {}
        decoder = tokenizer_json.get("decoder") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
            raise ExportError(
                "GGUF export writes byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2, GPT-2 style); "
                f"this one is {model.get('type')} with a {decoder.get('type')} decoder"
            )
        pre = tokenizer_pre or detect_tokenizer_pre(tokenizer_json)
        tokens: list[str | None] = [None] * vocab_size
        types = [gguf.TokenType.NORMAL] * vocab_size
        for text, index in model["vocab"].items():
            if index < vocab_size:
                tokens[index] = text
        for added in tokenizer_json.get("added_tokens") or []:
            index = added["id"]
            if index < vocab_size:
                tokens[index] = added["content"]
                types[index] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        for index, text in enumerate(tokens):
            if text is None:  # the embedding has rows the tokenizer never produces
                tokens[index] = f"[PAD{index}]"
                types[index] = gguf.TokenType.UNUSED
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(cast(list[str], tokens))  # every None was filled in just above
        writer.add_token_types(types)
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=vocab_size)
        # Whether BOS/EOS are added is behaviour that not every tokenizer file states: ask the tokenizer.
        plain = tokenizer("Hello", add_special_tokens=False).input_ids
        framed = tokenizer("Hello").input_ids
        extra = len(framed) - len(plain)
        special.add_special_token["bos"] = extra > 0 and framed[0] == tokenizer.bos_token_id
        special.add_special_token["eos"] = extra > 0 and framed[-1] == tokenizer.eos_token_id
        special.add_to_gguf(writer, quiet=True)
    return pre


def _rope_metadata(writer: gguf.GGUFWriter, config: PretrainedConfig) -> np.ndarray | None:
    """Rotary settings; returns llama3-style frequency factors to store, if any."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return None
    if kind == "llama3":
        return _llama3_rope_factors(rope, config.head_dim)
    raise ExportError(f"rope type '{kind}' is not supported by the GGUF export; supported: default, linear, llama3")


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's rope scaling (stored as llama.cpp's rope_freqs).

    Wavelengths shorter than original_context / high_freq_factor keep their frequency,
    longer than original_context / low_freq_factor are divided by ``factor``, and the band
    between is interpolated smoothly.
    """
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (head_dim/2,)
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    factors = np.where(
        wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    )
    return factors.astype(np.float32)


def _rope_pairs_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder q/k output rows per head: transformers rotates (i, i + d/2), llama.cpp (2i, 2i + 1).

    Works on a weight (rows, in) or a bias (rows,); rows = heads * head_dim.
    """
    rest = weight.shape[1:]
    per_head = weight.reshape(-1, 2, head_dim // 2, *rest)  # (H, 2, D/2, ...)
    return per_head.transpose(1, 2).reshape(weight.shape)


def _tensor_data(name: str, tensor: torch.Tensor, outtype: str, kept_f16: list[str]) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(array, raw_dtype) for one tensor at the requested outtype."""
    import gguf

    array = tensor.detach().to(torch.float32).cpu().numpy()
    if array.ndim == 1:
        return array, None  # norms and biases stay float32, as llama.cpp expects
    if outtype == "q8_0":
        if gguf.quants.Q8_0.can_quantize(array):
            return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        kept_f16.append(name)
    return array.astype(np.float16), None


def write_gguf(lm: LoadedModel, out_path: str | Path, outtype: str = "f16", tokenizer_pre: str | None = None) -> GgufSummary:
    """Write a loaded model (pruned or dense) as a GGUF file for llama.cpp.

    Args:
        lm: a LoadedModel of a supported family (its weights as loaded, any dtype).
        out_path: the .gguf file to write (replaced atomically).
        outtype: "f16" or "q8_0".
        tokenizer_pre: llama.cpp pre-tokenizer name; None detects it from tokenizer.json.
    Returns:
        A GgufSummary.
    Raises:
        ExportError: unsupported family, rope type, tokenizer or outtype; unwritable target.
    """
    if outtype not in OUTTYPES:
        raise ExportError(f"unknown GGUF outtype '{outtype}'; choose one of {', '.join(OUTTYPES)}")
    check_tokenizer_pre(tokenizer_pre)
    config = cast("PretrainedConfig", lm.model.config)  # a transformers model's config (LoadedModel types the model as a Module)
    check_supported(getattr(config, "model_type", None))
    if getattr(config, "use_sliding_window", False):
        raise ExportError("a Qwen2 model that uses sliding-window attention cannot be written as GGUF deci")
    out_path = Path(out_path)
    try:
        with atomic_file(out_path) as tmp:  # the shared writer: pid-tagged temporary, umask, one-line disk errors
            summary = _write(lm, config, tmp, outtype, tokenizer_pre)
    except OutputError as exc:
        raise ExportError(str(exc)) from None
    summary.path = str(out_path)
    summary.bytes = out_path.stat().st_size
    log.info("wrote %s (%s, %.1f MiB)", out_path, outtype, summary.bytes / 2**20)
    return summary


def _write(lm: LoadedModel, config: PretrainedConfig, path: Path, outtype: str, tokenizer_pre: str | None) -> GgufSummary:
    import gguf

    adapter, model = lm.adapter, lm.model
    layers = adapter.layers(model)
    geometries = [adapter.geometry(layer) for layer in layers]
    head_dim = geometries[0].head_dim
    hidden = adapter.attention_projections(layers[0])[0].in_features
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(f"{lm.pruned_from.get('model')} (gap-pruned)" if lm.pruned_from else str(lm.name))
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_block_count(len(layers))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length([g.intermediate_size for g in geometries])
    writer.add_head_count([g.n_heads for g in geometries])
    writer.add_head_count_kv([g.n_kv_heads for g in geometries])
    # Without these llama.cpp derives head_dim as hidden / head_count of layer 0, wrong once it is pruned.
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    vocab_size = cast(torch.nn.Linear, adapter.lm_head(model)).out_features
    writer.add_vocab_size(vocab_size)
    rope_factors = _rope_metadata(writer, config)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if outtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(file_type)
    if outtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    pre = _tokenizer_metadata(writer, lm.tokenizer, vocab_size, tokenizer_pre)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DECI, len(layers))
    kept_f16: list[str] = []
    tied = adapter.lm_head(model).weight is cast(Any, model).get_input_embeddings().weight  # the transformers model's own method
    count = 0
    if rope_factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors)
        count += 1
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when output is absent
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"no GGUF name for tensor {hf_name}")
        if name.split(".")[-2] in ("attn_q", "attn_k"):
            tensor = _rope_pairs_interleaved(tensor, head_dim)
        data, raw_dtype = _tensor_data(name, tensor, outtype, kept_f16)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if kept_f16:
        log.info("q8_0 kept %d matrices in f16 (rows not a multiple of 32): %s", len(kept_f16), ", ".join(kept_f16[:4]))
    return GgufSummary(
        path=str(path),
        outtype=outtype,
        bytes=0,
        tensors=count,
        head_count=[g.n_heads for g in geometries],
        head_count_kv=[g.n_kv_heads for g in geometries],
        feed_forward_length=[g.intermediate_size for g in geometries],
        tokenizer_pre=pre,
        kept_f16=kept_f16,
    )


def export_gguf(model: str | Path, out_path: str | Path, outtype: str = "f16", tokenizer_pre: str | None = None) -> GgufSummary:
    """Load a checkpoint folder, built-in name or model folder and write it as GGUF.

    A gap checkpoint is checked (family) before its weights are read, so an unsupported
    family costs no load. The dense built-in ``smollm2-135m`` is the 0% case.

    Raises:
        ModelLoadError: the model cannot be loaded (corrupt folder, missing files).
        ExportError: see ``write_gguf``.
    """
    from gap_engine.model.loading import load_model

    folder = Path(model)
    if folder.is_dir() and (folder / "config.json").exists():
        check_supported(_model_type(folder))
    if outtype not in OUTTYPES:
        raise ExportError(f"unknown GGUF outtype '{outtype}'; choose one of {', '.join(OUTTYPES)}")
    check_tokenizer_pre(tokenizer_pre)
    return write_gguf(load_model(str(model)), out_path, outtype, tokenizer_pre)


def _model_type(folder: Path) -> object:
    """config.json's model_type, the file read through the validation layer (ExportError otherwise)."""
    from gap_engine.core.limits import LIMITS
    from gap_engine.core.validate import read_json_file

    config = read_json_file(folder / "config.json", LIMITS.metadata_bytes, f"{folder}/config.json", ExportError)
    if not isinstance(config, dict):
        raise ExportError(f"{folder}/config.json does not hold a JSON object")
    return config.get("model_type")


def gguf_problem(checkpoint: str | Path) -> str | None:
    """Why a checkpoint folder cannot be written as GGUF (one line), or None when it can."""
    try:
        check_supported(_model_type(Path(checkpoint)))
    except ExportError as exc:
        return str(exc)
    return None


def gguf_bytes(checkpoint: str | Path, outtype: str = "f16") -> bytes:
    """A checkpoint as GGUF file bytes (for a download): written to a temporary file, read, removed.

    Raises:
        ModelLoadError, ExportError: as ``export_gguf``.
    """
    with tempfile.TemporaryDirectory(prefix="gap-gguf-") as tmp:
        path = Path(tmp) / "model.gguf"
        export_gguf(checkpoint, path, outtype)
        return path.read_bytes()
