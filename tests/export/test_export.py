"""Deploying a pruned checkpoint: plain transformers, llama.cpp (GGUF), half precision, model card.

Tiny models of every family check the load paths exactly; the real SmolLM2-135M, pruned with
small settings, checks that llama.cpp's next-token predictions agree with PyTorch's.
transformers runs in a subprocess whose import path cannot reach gap_engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gap_engine.cli import main
from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.export.gguf import write_gguf
from gap_engine.model.adapters import supported_model_types
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import apply_plan

FAMILIES = supported_model_types()  # every family an adapter serves
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889 as the centrepiece of the 1889 World's Fair."
)


def _ids(n=2, t=24, seed=0):
    return torch.randint(5, 4000, (n, t), generator=torch.Generator().manual_seed(seed))


def _pruned_tiny(make_tiny, family, **overrides):
    """A tiny model with one pruned block (fewer heads, KV heads, channels) and one kept whole."""
    widths = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128}
    widths.update(overrides)
    lm = make_tiny(family, **widths)
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.0], "wanda")
    result = apply_plan(lm, plan, compute_importance(lm, _ids(), "wanda"))
    return lm, result


def _save(lm, result, folder, **options) -> Path:
    return save_pruned(lm, result.plan, result.kept_indices(), folder, **options)


@torch.no_grad()
def _logits(lm, ids):
    return lm.model(input_ids=ids, use_cache=False).logits


# ---- plain transformers, without gap_engine ----------------------------------------------
_REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    try:
        import gap_engine
        hidden = False
    except ImportError:
        hidden = True
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from peft import LoraConfig, get_peft_model

    report = {"gap_engine_hidden": hidden}
    for folder in sys.argv[1:]:
        ids = torch.load(folder + "/../ids.pt")
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            torch.save(model(ids).logits, folder + "/../remote_logits.pt")
        # generate with the KV cache must equal greedy decoding without it
        generated = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            full = model(generated, use_cache=False).logits
        cache_consistent = torch.equal(full[0, 7:-1].argmax(-1), generated[0, 8:])
        if folder == sys.argv[1]:  # once: without dtype=, the stored bfloat16 from config.json
            half = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            report["default_dtype"] = str(half.dtype)
            prompt = tokenizer("The tower", return_tensors="pt")
            report["half_generated"] = half.generate(**prompt, max_new_tokens=3, do_sample=False).shape[1]
        # peft wraps it; the LoRA weights get gradients
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
        out = peft_model(input_ids=ids, labels=ids)
        out.loss.backward()
        lora_grads = [p.grad.abs().sum().item() for n, p in peft_model.named_parameters() if "lora_B" in n]
        report[folder] = {
            "class": type(model).__name__,
            "cache_consistent": cache_consistent,
            "generated": generated.shape[1],
            "q_proj_rows": [layer.self_attn.q_proj.out_features for layer in model.model.layers],
            "lora_modules": len(lora_grads),
            "lora_grad_nonzero": all(g > 0 for g in lora_grads),
            "tokenizer_class": type(tokenizer).__name__,
        }
    print(json.dumps(report))
    """
)


def _run_without_gap_engine(script: str, args: list[str], tmp_path: Path) -> dict:
    """Run ``script`` in a fresh interpreter that sees site-packages but not gap_engine.

    -I drops the script's folder, the working directory and PYTHON* variables from the path;
    -S skips site-packages' .pth files, among them gap_engine's editable install, so
    site-packages is added back by hand as a plain directory.
    """
    site_packages = sysconfig.get_paths()["purelib"]
    bootstrap = f"import sys; sys.path.append({site_packages!r}); sys.argv = ['remote'] + {args!r}; exec({script!r})"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", bootstrap], check=False, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.heavy  # three families loaded by plain transformers in subprocesses: ~30 s; make test-all
def test_transformers_loads_every_family_without_gap_engine(make_tiny, tmp_path):
    """Every family, and two bias-compensated checkpoints (``gap_output_bias``), in one subprocess."""
    folders, expected, widths = [], {}, {}
    ids = _ids()
    cases = [(family, _pruned_tiny(make_tiny, family)) for family in FAMILIES]
    cases += [(f"{family}-compensated", _compensated_tiny(make_tiny, family)) for family in ("llama", "gemma3_text")]
    for name, (lm, result) in cases:
        family_dir = tmp_path / name
        family_dir.mkdir()
        folder = family_dir / "ckpt"
        _save(lm, result, folder)  # bfloat16 storage, the default
        torch.save(ids, family_dir / "ids.pt")
        reloaded = load_model(str(folder))  # gap's loader: float32
        expected[str(folder)] = _logits(reloaded, ids)
        widths[str(folder)] = [layer.self_attn.q_proj.out_features for layer in reloaded.adapter.layers(reloaded.model)]
        folders.append(str(folder))
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_gap_pruned.")
        # block 1 of a compensated model lost nothing: biases on block 0 alone
        assert config.get("gap_output_bias", False) == ([[True, True], [False, False]] if name.endswith("compensated") else False)
        assert (folder / "modeling_gap_pruned.py").is_file()

    report = _run_without_gap_engine(_REMOTE_SCRIPT, folders, tmp_path)
    assert report["gap_engine_hidden"], "the subprocess could import gap_engine"
    assert report["default_dtype"] == "torch.bfloat16" and report["half_generated"] > 3
    for folder in folders:
        row = report[folder]
        assert row["class"].startswith("GapPruned"), row
        assert row["q_proj_rows"] == widths[folder] and row["q_proj_rows"][0] < row["q_proj_rows"][1]
        remote = torch.load(Path(folder).parent / "remote_logits.pt")
        torch.testing.assert_close(remote, expected[folder], rtol=0, atol=0)  # identical to gap's loader
        assert row["cache_consistent"] and row["generated"] == 14
        assert row["lora_modules"] == 2 * 3 and row["lora_grad_nonzero"]


# ---- bias compensation: the biases travel everywhere ------------------------------------------
def _compensated_tiny(make_tiny, family, mode="bias+refit"):
    """A tiny model with block 0 pruned and compensated (biases on its o_proj and down_proj), block 1 whole (no bias)."""
    lm = make_tiny(family, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, hidden_size=128, head_dim=32)
    calib = WindowSpec(n_samples=4, seq_len=64, batch_size=2)
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, calib), "wanda")
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.0], "wanda")
    return lm, prune_compensated(lm, plan, scores, calib, CompensationSettings(mode=mode))


@pytest.mark.slow
def test_a_bias_compensated_checkpoint_gives_the_same_logits_everywhere(make_tiny, tmp_path, capsys):
    """The engine's loader, llama.cpp and the re-save (plain transformers: the test above)."""
    ids = _ids(1, 32)
    lm, result = _compensated_tiny(make_tiny, "llama")
    o_bias = [lm.adapter.attention_projections(layer)[3].bias for layer in lm.adapter.layers(lm.model)]
    assert o_bias[0].abs().max() > 0 and o_bias[1] is None  # block 1 lost nothing: no bias
    assert result.compensation["bias_params"] == 2 * 128  # block 0's two biases, hidden 128 each
    folder = _save(lm, result, tmp_path / "ckpt", dtype="float32")
    assert json.loads((folder / "config.json").read_text())["gap_output_bias"] == [[True, True], [False, False]]
    assert json.loads((folder / "gap_pruned.json").read_text())["compensation"]["mode"] == "bias+refit"
    card = (folder / "README.md").read_text()
    assert "| compensation after the cut | bias\\+refit (damping 0.01, fitted block by block on 4 x 64" in card
    reloaded = load_model(str(folder))  # the engine's loader
    assert reloaded.pruned_from["compensation"]["mode"] == "bias+refit"
    want = _logits(reloaded, ids)
    torch.testing.assert_close(want, _logits(lm, ids), rtol=0, atol=0)

    # llama.cpp's deci graph adds attn_output.bias and ffn_down.bias: the same logits up to f16
    path = tmp_path / "compensated.gguf"
    assert main(["export", str(folder), "--out", str(path), "--json"]) == 0
    names = _gguf_tensor_names(path)
    assert {"blk.0.attn_output.bias", "blk.0.ffn_down.bias"} <= names and not {"blk.1.attn_output.bias", "blk.1.ffn_down.bias"} & names
    got = _llama_cpp_logits(path, ids[0].tolist())
    block = lm.adapter.layers(lm.model)[0]  # the same model without its biases: how far they move the logits
    lm.adapter.attention_projections(block)[3].bias.data.zero_()
    lm.adapter.mlp_projections(block)[2].bias.data.zero_()
    want, unbiased = want[0].numpy(), _logits(lm, ids)[0].numpy()
    error, bias_effect = np.abs(got - want).max(), np.abs(unbiased - want).max()
    assert error < 0.01 * np.abs(want).max() and error < 0.1 * bias_effect, (error, bias_effect)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9

    # gap export --format hf re-saves it with its biases, flag and record
    resaved = tmp_path / "resaved"
    capsys.readouterr()
    assert main(["export", str(folder), "--format", "hf", "--dtype", "float32", "--out", str(resaved)]) == 0
    assert json.loads((resaved / "config.json").read_text())["gap_output_bias"] == [[True, True], [False, False]]
    assert json.loads((resaved / "gap_pruned.json").read_text())["compensation"]["mode"] == "bias+refit"
    torch.testing.assert_close(_logits(load_model(str(resaved)), ids)[0].numpy(), want, rtol=0, atol=0)


def _gguf_tensor_names(path: Path) -> set[str]:
    import gguf

    return {tensor.name for tensor in gguf.GGUFReader(str(path)).tensors}


# ---- half precision ------------------------------------------------------------------------
@pytest.mark.slow
def test_half_precision_round_trips(make_tiny, tmp_path):
    lm, result = _pruned_tiny(make_tiny, "llama")
    ids = _ids()
    full = _save(lm, result, tmp_path / "float32", dtype="float32")
    full_bytes = (full / "model.safetensors").stat().st_size
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        half = _save(lm, result, tmp_path / dtype, dtype=dtype)
        assert (half / "model.safetensors").stat().st_size < 0.51 * full_bytes
        assert json.loads((half / "config.json").read_text())["dtype"] == dtype
        assert json.loads((half / "gap_pruned.json").read_text())["dtype"] == dtype

        # gap's loader computes in float32: the stored values, upcast exactly, and a verified fingerprint
        reloaded = load_model(str(half))
        assert next(reloaded.model.parameters()).dtype == torch.float32
        for name, tensor in reloaded.model.state_dict().items():
            torch.testing.assert_close(tensor, lm.model.state_dict()[name].to(torch_dtype).float(), rtol=0, atol=0)
        assert (_logits(reloaded, ids) - _logits(lm, ids)).abs().max() < 0.05

    # the CLI re-saves a checkpoint in another precision; the copy verifies and matches
    resaved = tmp_path / "resaved"
    assert main(["export", str(tmp_path / "float16"), "--format", "hf", "--dtype", "float32", "--out", str(resaved)]) == 0
    again = load_model(str(resaved))
    assert again.fingerprint == reloaded.fingerprint  # the float16 checkpoint's, loaded last
    torch.testing.assert_close(_logits(again, ids), _logits(reloaded, ids), rtol=0, atol=0)
    assert (resaved / "README.md").is_file() and (resaved / "modeling_gap_pruned.py").is_file()


# ---- model card -----------------------------------------------------------------------------
@pytest.mark.slow
def test_model_card_names_the_plan(make_tiny, tmp_path):
    lm, result = _pruned_tiny(make_tiny, "qwen2")
    report = {
        "perplexity": {"wiki-sample": 31.5},
        "dense": {"perplexity": {"wiki-sample": 27.25}},
        "kl_to_dense": {"wiki-sample": 0.125},
        "top1_agreement": {"wiki-sample": 0.8},
        "generations": [{"prompt": "The capital of France is", "model": " Paris.", "dense": " Paris, the"}],
        "settings": {"n_samples": 4, "seq_len": 64, "seed": 0},
    }
    folder = _save(lm, result, tmp_path / "my-pruned", eval_report=report)
    card = (folder / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers" and "pruned" in meta["tags"]
    plan = result.plan
    assert plan.model_fingerprint in body and "tiny-qwen2" in body
    rows = [line for line in body.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2
    assert f"{plan.attention_rates[0]:.3f}" in rows[0] and f"{plan.mlp_rates[0]:.3f}" in rows[0]
    kept = result.kept_heads[0], result.kept_kv_heads[0]
    assert f"| {len(kept[0])}/8 | {len(kept[1])}/2 |" in rows[0] and "| 8/8 | 2/2 |" in rows[1]  # kept / dense
    assert "31.500" in body and "27.250" in body and "Paris." in body
    assert "from_pretrained('my-pruned', trust_remote_code=True" in body and "AutoTokenizer.from_pretrained('my-pruned')" in body
    assert "gap export my-pruned --format gguf" in body
    assert "## Limits" in body
    assert json.loads((folder / "eval_report.json").read_text())["perplexity"]["wiki-sample"] == 31.5


@pytest.mark.slow
def test_the_cards_parameter_count_is_the_models_and_says_what_compensation_added(make_tiny, tmp_path):
    lm, result = _compensated_tiny(make_tiny, "llama", mode="bias")
    folder = _save(lm, result, tmp_path / "ckpt")
    marker = json.loads((folder / "gap_pruned.json").read_text())
    assert marker["param_count"] == lm.param_count()  # the biases are the model's parameters
    row = next(line for line in (folder / "README.md").read_text().splitlines() if line.startswith("| parameters |"))
    assert f"→ {lm.param_count():,}" in row
    assert "includes 256 bias parameters that compensation added" in row  # block 0's o_proj and down_proj, hidden 128


# ---- GGUF and llama.cpp ----------------------------------------------------------------------
def _llama_cpp_logits(path: Path, tokens: list[int], flash_attn: bool = False) -> np.ndarray:
    """Logits of every position, computed by llama.cpp itself."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(64, len(tokens)), logits_all=True, n_threads=1, flash_attn=flash_attn, verbose=False)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)  # (T, V)
    llm.close()
    return logits


def _gguf_fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_gguf_of_a_pruned_tiny_model_runs_in_llama_cpp(make_tiny, tmp_path, family):
    lm, _ = _pruned_tiny(make_tiny, family, hidden_size=128, head_dim=32)
    ids = _ids(1, 32)
    expected = _logits(lm, ids)[0].numpy()  # (T, V)
    scale = np.abs(expected).max()
    # f16 lands near 1e-3 of the logit scale; a layout error (unpermuted q/k rows) near 3e-2.
    # q8_0 quantises activations too, so its check is looser and f16 guards the layout.
    for outtype, tolerance in (("f16", 0.01), ("q8_0", 0.03)):
        path = tmp_path / f"tiny-{outtype}.gguf"
        summary = write_gguf(lm, path, outtype)
        fields = _gguf_fields(path)
        assert fields["general.architecture"] == "deci"
        # layer 0 lost heads, KV heads and channels; layer 1 is kept whole
        assert fields["deci.attention.head_count"] == summary.head_count == [4, 8]
        assert fields["deci.attention.head_count_kv"] == [1, 2]
        assert fields["deci.feed_forward_length"] == [96, 128]
        got = _llama_cpp_logits(path, ids[0].tolist())
        assert np.abs(got - expected).max() < tolerance * scale, (outtype, np.abs(got - expected).max() / scale)
        assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    # flash attention keeps each layer's own V width (without it llama.cpp pads to the widest)
    with_fa = _llama_cpp_logits(tmp_path / "tiny-f16.gguf", ids[0].tolist(), flash_attn=True)
    assert np.abs(with_fa - expected).max() < 0.01 * scale


@pytest.mark.slow
def test_gguf_llama3_rope_scaling_matches(make_tiny, tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 2.0,
        "original_max_position_embeddings": 8,
    }
    lm = make_tiny("llama", hidden_size=128, head_dim=32, rope_parameters=rope)
    path = tmp_path / "llama3.gguf"
    write_gguf(lm, path, "f16")
    ids = _ids(1, 40)
    expected = _logits(lm, ids)[0].numpy()
    got = _llama_cpp_logits(path, ids[0].tolist())
    assert np.abs(got - expected).max() < 0.01 * np.abs(expected).max()


@pytest.mark.slow
def test_gguf_of_pruned_smollm2_agrees_with_pytorch(tmp_path):
    lm = load_model("smollm2-135m")
    n = lm.num_layers
    # heterogeneous: every third block loses attention heads, MLP rates vary (27% of prunable).
    # Wanda scores from a short real-text window keep it a working model, as the pipeline does;
    # a magnitude-pruned one is so damaged that f16 rounding alone flips near-tied predictions.
    calibration = torch.tensor([lm.tokenizer(TEXT * 3, add_special_tokens=False).input_ids[:96]])
    plan = make_plan(lm, [0.45 if i % 3 == 0 else 0.0 for i in range(n)], [0.1 + 0.2 * (i % 3) for i in range(n)], "wanda")
    apply_plan(lm, plan, compute_importance(lm, calibration, "wanda"))
    path = tmp_path / "smol.gguf"
    summary = write_gguf(lm, path, "f16")
    assert min(summary.head_count) < 9 and max(summary.head_count) == 9
    assert summary.tokenizer_pre == "gpt-2"

    from llama_cpp import Llama

    # llama.cpp splits the text into the same tokens as the model's own tokenizer
    llm = Llama(model_path=str(path), n_ctx=128, logits_all=True, n_threads=1, verbose=False)
    hf_ids = lm.tokenizer(TEXT, add_special_tokens=False).input_ids
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == hf_ids
    llm.eval(hf_ids)
    got = np.array(llm.scores[: len(hf_ids)])
    llm.close()
    expected = _logits(lm, torch.tensor([hf_ids]))[0].numpy()
    agreement = (got.argmax(-1) == expected.argmax(-1)).mean()
    assert agreement >= 0.95, agreement


# ---- bad input: one line, nothing left behind ---------------------------------------------------
def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gap: error: ")
    return err[-1]


@pytest.mark.parametrize("family, named", [("qwen3", "q/k norms"), ("gemma3_text", "Gemma 3")])
@pytest.mark.slow
def test_gguf_refuses_other_families(make_tiny, tmp_path, capsys, family, named):
    lm, result = _pruned_tiny(make_tiny, family)
    folder = _save(lm, result, tmp_path / "ckpt")
    out = tmp_path / "out.gguf"
    line = _one_line_error(capsys, ["export", str(folder), "--format", "gguf", "--out", str(out)])
    assert f"'{family}'" in line and named in line and "supported: llama, mistral, qwen2" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.slow
def test_bad_checkpoints_and_targets_fail_cleanly(make_tiny, tmp_path, capsys):
    lm, result = _pruned_tiny(make_tiny, "llama")
    good = _save(lm, result, tmp_path / "good")
    corrupt = _save(lm, result, tmp_path / "corrupt")
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    no_config = _save(lm, result, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    good_files = sorted(p.name for p in good.iterdir())

    cases = [
        (["export", str(corrupt), "--out", str(tmp_path / "x.gguf")], "model.safetensors"),
        (["export", str(no_config), "--out", str(tmp_path / "x.gguf")], "config.json"),
        (["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x.gguf")], "missing"),
        (["export", str(good), "--out", str(blocker / "x.gguf")], "is a file, not a folder"),
        (["export", str(corrupt), "--format", "hf", "--out", str(tmp_path / "x")], "model.safetensors"),
        (["export", str(good), "--format", "hf", "--out", str(good)], "is the same path as the checkpoint"),
        (["export", str(good), "--format", "hf", "--out", str(blocker / "x")], "is a file, not a folder"),
    ]
    for argv, fragment in cases:
        assert fragment in _one_line_error(capsys, argv), argv
        assert sorted(p.name for p in tmp_path.iterdir()) == before, argv
        assert sorted(p.name for p in good.iterdir()) == good_files


@pytest.mark.slow
def test_dense_and_pruned_gguf_from_the_cli(make_tiny, tmp_path, capsys):
    """The 0% case (a dense model) and a checkpoint go through the same command."""
    lm, result = _pruned_tiny(make_tiny, "llama", hidden_size=128, head_dim=32)
    folder = _save(lm, result, tmp_path / "ckpt")
    assert main(["export", str(folder), "--outtype", "q8_0", "--out", str(tmp_path / "p.gguf"), "--json"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    dense = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, hidden_size=128, head_dim=32)
    dense.model.save_pretrained(tmp_path / "dense")
    dense.tokenizer.save_pretrained(tmp_path / "dense")
    assert main(["export", str(tmp_path / "dense"), "--outtype", "q8_0", "--out", str(tmp_path / "d.gguf"), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["head_count"] == [8, 8] and full["feed_forward_length"] == [128, 128]
    assert pruned["head_count"] == [4, 8] and pruned["bytes"] < full["bytes"]
    ids = _ids(1, 16)[0].tolist()
    dense_logits = _llama_cpp_logits(tmp_path / "d.gguf", ids)
    assert np.isfinite(dense_logits).all()


def test_the_card_says_when_a_compensation_was_fitted_through_the_output_norms():
    from gap_engine.model.model_card import compensation_text
    from gap_engine.prune.compensations import CompensationSettings

    weighted = CompensationSettings(mode="bias+refit", weighting="output-norm").to_dict()
    assert compensation_text(weighted) == (
        "bias\\+refit (damping 0.01, each token, BOS included, weighted through the norms after o_proj and down_proj)"
    )
    assert "weighted" not in compensation_text(CompensationSettings(mode="bias+refit").to_dict())
