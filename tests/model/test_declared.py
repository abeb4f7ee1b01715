"""Declared = stored: a model whose files hold tensors its config does not declare, or lack
tensors it declares, is refused in one line naming a tensor, on every local load path (a plain
folder, a gap checkpoint, a GGUF file); the legitimate differences (tied heads, renamed keys,
shards, .bin files, stored rotary buffers) still load.

Tiny models from configs, saved and then edited as a careless user or a foreign tool would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gap_engine.core.errors import ModelLoadError
from gap_engine.model.adapters import supported_model_types
from gap_engine.model.loading import load_model

FAMILIES = supported_model_types()  # every family an adapter serves


def _saved(lm, folder: Path, **save_options) -> Path:
    lm.model.save_pretrained(folder, **save_options)
    lm.tokenizer.save_pretrained(folder)
    return folder


def _edit_tensors(folder: Path, edit) -> None:
    """Apply ``edit`` to the tensors of every .safetensors file of ``folder`` (each rewritten whole)."""
    for path in sorted(folder.glob("*.safetensors")):
        state = load_file(str(path))
        edit(state)
        save_file(state, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def _block_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """A bias for every q/k/v/o and gate/up/down projection of every block that has none."""
    torch.manual_seed(1)
    return {
        f"{name}.bias": torch.randn(module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name and module.bias is None
    }


def _refusal(target) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(target))
    assert "\n" not in str(info.value)
    return str(info.value)


# ---- a plain Hugging Face folder ------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_undeclared_block_biases_are_refused_naming_one(make_tiny, tmp_path, family):
    lm = make_tiny(family)
    folder = _saved(lm, tmp_path / "biased")
    biases = _block_biases(lm.model)
    assert len(biases) >= 2 * 4  # o_proj and the MLP's three in each block even where q/k/v carry biases (qwen2)
    _edit_tensors(folder, lambda state: state.update(biases))
    line = _refusal(folder)
    first = sorted(biases)[0]
    assert f"stores tensor '{first}' (and {len(biases) - 1} more)" in line and "does not declare" in line, line


@pytest.mark.parametrize(
    "family, declared",
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"attention_bias": True}), ("gemma3_text", {"attention_bias": True})],
)
@pytest.mark.slow
def test_declared_biases_that_are_not_stored_are_refused(make_tiny, tmp_path, family, declared):
    folder = _saved(make_tiny(family), tmp_path / "declared")
    _edit_config(folder, **declared)
    line = _refusal(folder)
    assert "config.json declares tensor 'model.layers.0." in line and ".bias'" in line and "do not store" in line, line


def test_an_unrelated_extra_tensor_is_refused(make_tiny, tmp_path):
    folder = _saved(make_tiny("llama"), tmp_path / "extra")
    _edit_tensors(folder, lambda state: state.update({"model.layers.1.self_attn.scale": torch.ones(4)}))
    assert "stores tensor 'model.layers.1.self_attn.scale'," in _refusal(folder)


@pytest.mark.slow
def test_a_tied_head_stored_with_other_values_is_refused(make_tiny, tmp_path):
    lm = make_tiny("llama", tie_word_embeddings=True)
    folder = _saved(lm, tmp_path / "untied")

    def store_head(state, values):
        state["lm_head.weight"] = values

    _edit_tensors(folder, lambda state: store_head(state, state["model.embed_tokens.weight"].clone()))
    again = load_model(str(folder))  # stored twice but equal (as .bin files store a tied head): one tensor
    assert again.model.lm_head.weight is again.model.model.embed_tokens.weight
    _edit_tensors(folder, lambda state: store_head(state, torch.randn_like(state["model.embed_tokens.weight"])))
    line = _refusal(folder)
    assert "lm_head.weight" in line and "tie_word_embeddings" in line, line


@pytest.mark.slow
def test_the_cli_refuses_undeclared_biases_in_one_line(make_tiny, tmp_path):
    lm = make_tiny("llama")
    folder = _saved(lm, tmp_path / "biased")
    _edit_tensors(folder, lambda state: state.update(_block_biases(lm.model)))
    argv = ["eval", "--model", str(folder), "--samples", "2", "--seq-len", "32", "--no-dense", "--no-throughput", "--generations", "0"]
    done = subprocess.run([sys.executable, "-m", "gap_engine", *argv], capture_output=True, text=True, timeout=600, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("gap: error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and "stores tensor 'model.layers.0.mlp.down_proj.bias'" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""


# ---- what still loads -------------------------------------------------------------------------
def _same_weights(loaded, lm) -> None:
    stored = lm.model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, stored[name]), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.slow
def test_plain_and_tied_folders_still_load(make_tiny, tmp_path, family, tied):
    lm = make_tiny(family, tie_word_embeddings=tied)
    folder = _saved(lm, tmp_path / "plain")
    assert ("lm_head.weight" in load_file(str(folder / "model.safetensors"))) is not tied
    loaded = load_model(str(folder))
    _same_weights(loaded, lm)
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) is tied


@pytest.mark.slow
def test_shards_renamed_keys_bin_files_and_stored_rotary_buffers_still_load(make_tiny, tmp_path):
    lm = make_tiny("llama", tie_word_embeddings=True)
    sharded = _saved(lm, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    _same_weights(load_model(str(sharded)), lm)

    # a base model's keys (no "model." prefix), which transformers renames on load; and an old
    # checkpoint's stored rotary buffer, which the architecture computes from the config
    renamed = _saved(lm, tmp_path / "renamed")

    def rename(state):
        for name in list(state):
            state[name.removeprefix("model.")] = state.pop(name)
        state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_tensors(renamed, rename)
    assert "layers.0.mlp.up_proj.weight" in load_file(str(renamed / "model.safetensors"))
    _same_weights(load_model(str(renamed)), lm)

    as_bin = _saved(lm, tmp_path / "bin")
    (as_bin / "model.safetensors").unlink()
    torch.save(lm.model.state_dict(), as_bin / "pytorch_model.bin")  # both the head and the embeddings, as .bin files do
    _same_weights(load_model(str(as_bin)), lm)
    extra = {**lm.model.state_dict(), "model.layers.0.mlp.up_proj.bias": torch.ones(lm.model.config.intermediate_size)}
    torch.save(extra, as_bin / "pytorch_model.bin")
    assert "stores tensor 'model.layers.0.mlp.up_proj.bias'," in _refusal(as_bin)


# ---- a gap checkpoint -----------------------------------------------------------------------
def _checkpoint(make_tiny, folder: Path, **overrides) -> tuple[object, Path]:
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import make_plan
    from gap_engine.prune.importance import compute_importance
    from gap_engine.prune.surgery import apply_plan

    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, **overrides)
    ids = torch.randint(5, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    result = apply_plan(lm, make_plan(lm, [0.5, 0.0], [0.25, 0.0], "wanda"), compute_importance(lm, ids, "wanda"))
    return lm, save_pruned(lm, result.plan, result.kept_indices(), folder)


@pytest.mark.slow
def test_a_checkpoint_with_undeclared_biases_is_refused_naming_one(make_tiny, tmp_path):
    lm, folder = _checkpoint(make_tiny, tmp_path / "ckpt")
    biases = {name: tensor.to(torch.bfloat16) for name, tensor in _block_biases(lm.model).items()}
    _edit_tensors(folder, lambda state: state.update(biases))
    line = _refusal(folder)
    assert f"stores tensor '{sorted(biases)[0]}' (and {len(biases) - 1} more)" in line, line


@pytest.mark.slow
def test_a_checkpoint_whose_config_declares_output_biases_it_lacks_is_refused(make_tiny, tmp_path):
    _, folder = _checkpoint(make_tiny, tmp_path / "ckpt")
    _edit_config(folder, gap_output_bias=True)  # every o_proj and down_proj then declares a bias
    line = _refusal(folder)
    assert "config.json declares tensor 'model.layers.0.mlp.down_proj.bias' (and 3 more)" in line, line


@pytest.mark.slow
def test_a_tied_checkpoint_storing_another_head_is_refused(make_tiny, tmp_path):
    lm, folder = _checkpoint(make_tiny, tmp_path / "ckpt", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    loaded = load_model(str(folder))
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    _edit_tensors(folder, lambda state: state.update({"lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])}))
    line = _refusal(folder)
    assert "stores an LM head (lm_head.weight)" in line and "tie_word_embeddings" in line, line


# ---- a GGUF file ----------------------------------------------------------------------------------
# A byte-level BPE vocabulary just large enough for transformers to build a tokenizer from GGUF.
_TOKENS = ["<|endoftext|>", "Ġ"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["he", "in", "Ġt"]
_MERGES = ["h e", "i n", "Ġ t"]


def _write_gguf(path: Path, model: nn.Module, extra: dict[str, torch.Tensor], leave_out: str = "") -> Path:
    """``model`` as a float32 GGUF of its own architecture, with ``extra`` tensors added and the
    tensors whose GGUF name contains ``leave_out`` (when given) left out."""
    import gguf

    config = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[config.model_type]
    writer = gguf.GGUFWriter(str(path), config.model_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(_TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([1] * len(_TOKENS))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        tensors[f"{names.get_name(base)}.{suffix}"] = tensor
    tensors.update(extra)
    for name, tensor in tensors.items():
        if not (leave_out and leave_out in name):
            writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_model(family: str) -> nn.Module:
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=len(_TOKENS)), dtype=torch.float32)


def test_a_gguf_loads_its_tensors_and_refuses_one_transformers_would_drop(tmp_path):
    model = _tiny_model("llama")
    loaded = load_model(str(_write_gguf(tmp_path / "tiny.gguf", model, {})))
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.weight", "lm_head.weight"):
        assert torch.equal(loaded.model.state_dict()[name], model.state_dict()[name]), name  # not permuted: no q/k

    biased = _write_gguf(tmp_path / "biased.gguf", model, {"blk.0.attn_q.bias": torch.ones(model.config.hidden_size)})
    line = _refusal(biased)
    assert "stores tensor 'blk.0.attn_q.bias'," in line and "the llama model" in line, line
    # Llama 3's rope scaling as llama.cpp's converter stores it: transformers reads no rope scaling from a llama GGUF
    scaled = _write_gguf(tmp_path / "llama3.gguf", model, {"rope_freqs.weight": torch.ones(model.config.head_dim // 2)})
    assert "stores tensor 'rope_freqs.weight'," in _refusal(scaled)


def test_a_gguf_lacking_tensors_its_architecture_declares_is_refused(tmp_path):
    model = _tiny_model("qwen2")  # Qwen2's q/k/v always carry biases
    line = _refusal(_write_gguf(tmp_path / "no-bias.gguf", model, {}, leave_out="_q.bias"))
    assert "declares tensor 'model.layers.0.self_attn.q_proj.bias' (and 1 more)" in line, line


@pytest.mark.parametrize(
    "family, architecture", [("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3_text", "gemma3")]
)
@pytest.mark.parametrize("tied", [False, True])
def test_the_gguf_name_map_is_the_one_transformers_loads_by(family, architecture, tied):
    """gap's one-pass map against transformers' own, which walks every submodule."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from gap_engine.model.declared import gguf_names

    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=len(_TOKENS), tie_word_embeddings=tied, attention_bias=True))
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    theirs = set(get_gguf_hf_weights_map(model, processor, model_type=architecture))
    assert gguf_names(model, architecture) == theirs
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= theirs
