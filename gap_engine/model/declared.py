"""Declared = stored: a model's files hold exactly the tensors its architecture and config declare.

transformers loads what it can place and lets the rest go with a log line. Tensors the config
does not declare (q/k/v/o or MLP biases under ``attention_bias``/``mlp_bias`` false, any stray
name) are dropped; tensors it declares but the files lack are initialised (biases to zero,
matrices at random); a GGUF tensor its name map has no place for is skipped. Each time the
model that runs is not the one stored, and nothing fails. Every local load path (a plain or
sharded folder, .safetensors or .bin; a gap checkpoint; a GGUF file) hands what its loader
found to this module, which turns any difference into one ``ModelLoadError`` line naming a
tensor.

Not differences, because the loaders' own reports already account for them: an LM head tied
to the embeddings and stored once (or stored twice, equal), buffers built from the config
(rotary ``inv_freq``, also when an old checkpoint stores it), names transformers renames on
load (a base model's keys without the ``model.`` prefix), shards listed by an index file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gap_engine.core.errors import ModelLoadError


def _and_more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def refuse_undeclared(where: str, missing: Iterable[str], unexpected: Iterable[str]) -> None:
    """ModelLoadError naming the first tensor the files store but the config does not declare,
    or the config declares but the files do not store. (A tensor stored in another shape than
    declared fails inside both loaders already.)

    Args:
        where: the folder or file, for the message.
        missing: names the architecture has and the files lack (after tying and renaming).
        unexpected: names the files hold and the architecture has no place for.
    """
    extra, absent = sorted(unexpected), sorted(missing)
    if extra:
        raise ModelLoadError(
            f"{where} stores tensor '{extra[0]}'{_and_more(extra)}, which its config.json does not declare "
            "(for biases: attention_bias, mlp_bias); loading would drop it. Fix config.json or remove the tensor"
        )
    if absent:
        raise ModelLoadError(
            f"{where}: config.json declares tensor '{absent[0]}'{_and_more(absent)}, which the weights files do not store; "
            "loading would make it up (zeros or random values). Fix config.json (for biases: attention_bias, mlp_bias) or add the tensor"
        )


def refuse_transformers_differences(where: str, model: Any, loading_info: dict[str, Any]) -> None:
    """``refuse_undeclared`` and ``refuse_untied_head`` on a model transformers loaded.

    Args:
        where: the folder, hub id or file, for the message.
        model: what ``from_pretrained(..., output_loading_info=True)`` returned first.
        loading_info: what it returned second (its ``missing_keys`` and ``unexpected_keys``
            already leave out tied, renamed and ignorable names).
    """
    refuse_undeclared(where, loading_info.get("missing_keys") or (), loading_info.get("unexpected_keys") or ())
    refuse_untied_head(where, model)


def refuse_untied_head(where: str, model: Any) -> None:
    """ModelLoadError when config.json ties the LM head to the input embeddings but the files
    store a head of other values: transformers then keeps both untied with a warning, and every
    consumer that reads ``tie_word_embeddings`` (a re-save, an export) would drop the stored head.

    Args:
        where: the folder or file, for the message.
        model: a transformers *ForCausalLM after its weights were loaded and tied.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is embeddings.weight:
        return
    raise ModelLoadError(
        f"{where} stores an LM head (lm_head.weight) that differs from the input embeddings, but its config.json ties them "
        "(tie_word_embeddings: true); set tie_word_embeddings to false or remove lm_head.weight"
    )


def gguf_names(model: Any, architecture: str) -> set[str]:
    """The GGUF tensor names transformers places in ``model`` when it loads a GGUF file of
    ``architecture`` (``general.architecture``: llama, qwen2, qwen3, gemma3, ...).

    The top level of transformers' own ``get_gguf_hf_weights_map``: the gguf package's name
    map applied to every full name of the state dict, then the architecture's fallbacks.
    transformers repeats this for every submodule (for models saved from their base class),
    building the name map anew each time, which costs seconds on a 30-block model; the
    causal-LM families gap supports are named in full at the top level, so this one pass
    finds the same names (``tests/model/test_declared.py`` compares both).

    Raises:
        ModelLoadError: an architecture the gguf package does not know.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = next((key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ModelLoadError(f"GGUF architecture '{architecture}' is unknown to the gguf package")
    processor_class: Any = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    processor = processor_class(config=model.config.to_dict())
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    placed: dict[str, str] = {}
    for full_name in model.state_dict():
        hf_name = processor.preprocess_name(full_name)
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "")
        suffix = f".{suffix}" if suffix else ""
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(placed, suffix, "", hf_name)
        else:
            placed[gguf_name + suffix] = hf_name
    return set(placed)


def unplaced_gguf_tensors(gguf_file: Path, model: Any) -> list[str]:
    """The tensors of a GGUF file that transformers has no place for in ``model`` (which it
    skips without a word: a bias the architecture does not declare, Llama 3's
    ``rope_freqs.weight``), in file order.

    Args:
        gguf_file: the .gguf file ``model`` was loaded from.
        model: the transformers model built from that file's metadata.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    placed = gguf_names(model, str(reader.fields["general.architecture"].contents()))
    return [tensor.name for tensor in reader.tensors if tensor.name not in placed]


def refuse_unplaced_gguf_tensors(gguf_file: Path, model: Any) -> None:
    """ModelLoadError naming the first tensor of ``gguf_file`` that loading ``model`` dropped."""
    unplaced = unplaced_gguf_tensors(gguf_file, model)
    if unplaced:
        raise ModelLoadError(
            f"{gguf_file} stores tensor '{unplaced[0]}'{_and_more(unplaced)}, which the {model.config.model_type} model its "
            "metadata declares has no place for; transformers would drop it. Load the original Hugging Face folder instead"
        )
