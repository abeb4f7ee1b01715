"""The ``i44 declared`` cases of ``bench_hostile.py`` (declared = stored): model folders and checkpoints whose
tensors differ from what their config.json declares. ``cases(bench)`` is called with the running
bench module (its ``Case``, helpers and ``FIXTURES``, read when a case is prepared).

- **i44 declared** (beside ``hostile_rules_and_identity``'s identity cases for undeclared and unstored biases):
  MLP biases declared and none stored, a stray tensor, a tied head stored with other values, a checkpoint with an extra bias or a
  bias flag it does not store; controls that must still load: shards with an index, a base
  model's keys (no ``model.`` prefix, renamed by transformers), a stored rotary buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

bench = None  # the running bench_hostile module, set by cases()


def _tensors(folder: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Apply ``edit`` to the tensors of ``folder``/model.safetensors (rewritten whole)."""

    def prepare(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = d / folder / "model.safetensors"
        state = load_file(str(path))
        edit(state)
        save_file(state, str(path), metadata={"format": "pt"})

    return prepare


def _block_biases(state: dict) -> None:
    """A bias for every 2-D projection weight of every block (q/k/v/o, gate/up/down), in its dtype."""
    import torch

    for name in [n for n in state if ".layers." in n and n.endswith("_proj.weight")]:
        state[name.removesuffix("weight") + "bias"] = torch.full((state[name].shape[0],), 0.5, dtype=state[name].dtype)


def _extra(name: str, rows: int = 4) -> Callable[[dict], None]:
    import torch

    return lambda state: state.update({name: torch.ones(rows)})


def _untie_head(state: dict) -> None:
    state["lm_head.weight"] = state["lm_head.weight"] * 2  # the fixture stores its own head: make it differ for sure


def _without_prefix(state: dict) -> None:
    for name in list(state):
        if name.startswith("model."):
            state[name.removeprefix("model.")] = state.pop(name)


def _sharded(d: Path) -> None:
    """tiny-llama re-saved in shards of 100 KB with an index file (transformers' own format)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = bench.FIXTURES / "tiny-llama"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = d / "sharded"
    model.save_pretrained(out, max_shard_size="100KB")
    for path in src.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            (out / path.name).write_bytes(path.read_bytes())


def cases(module) -> list:
    global bench
    bench = module
    Case, copy_fixture, both, edit_json = bench.Case, bench.copy_fixture, bench.both, bench.edit_json

    def ev(folder: str) -> list:
        return bench._eval("{d}/" + folder)

    m = copy_fixture("tiny-llama", "m")
    return [
        Case(
            "eval: config declares MLP biases only, none stored",
            "i44 declared",
            ev("m"),
            both(m, edit_json("m/config.json", lambda c: c.update(mlp_bias=True))),
        ),
        Case("eval: an unrelated extra tensor", "i44 declared", ev("m"), both(m, _tensors("m", _extra("model.layers.1.self_attn.scale")))),
        Case("eval: a top-level stray tensor", "i44 declared", ev("m"), both(m, _tensors("m", _extra("vision_tower.weight")))),
        Case(
            "eval: tied in config, another head stored",
            "i44 declared",
            ev("m"),
            both(m, _tensors("m", _untie_head), edit_json("m/config.json", lambda c: c.update(tie_word_embeddings=True))),
        ),
        Case(
            "eval: checkpoint with an undeclared q_proj bias",
            "i44 declared",
            ev("ck"),
            both(copy_fixture("ck"), _tensors("ck", _extra("model.layers.0.self_attn.q_proj.bias", 64))),
        ),
        Case(
            "eval: checkpoint declares output biases it lacks",
            "i44 declared",
            ev("ck"),
            both(copy_fixture("ck"), edit_json("ck/config.json", lambda c: c.update(gap_output_bias=True))),
        ),
        Case("eval: sharded folder with an index (control)", "i44 declared", ev("sharded"), _sharded, expect="ok"),
        Case(
            "eval: base-model keys without the model. prefix (control)",
            "i44 declared",
            ev("m"),
            both(m, _tensors("m", _without_prefix)),
            expect="ok",
        ),
        Case(
            "eval: a stored rotary inv_freq (control)",
            "i44 declared",
            ev("m"),
            both(m, _tensors("m", _extra("model.layers.0.self_attn.rotary_emb.inv_freq", 8))),
            expect="ok",
        ),
    ]
