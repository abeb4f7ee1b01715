"""The model card (README.md) of a pruned checkpoint, in the Hugging Face model-card style.

YAML front matter for the hub (library, tags, base model when it is a hub id), then what
was done: the base model and its fingerprint, the plan as a per-layer table, the settings
of the loss table behind a DP plan (from the cache when it is still there, else what its
key says), evaluation numbers and generations when a report was measured, how to load the
folder in transformers and in llama.cpp, and the limits. Pure text rendering plus one
atomic write.

Every string that comes from the user or from a file (folder name, base model, plan fields,
source names, generations, cached table settings) is data, never markup or code: it is
escaped for the context it lands in (``md_text`` for Markdown text and table cells, where
HTML is escaped too; ``repr`` for a Python string literal; ``shlex.quote`` for a shell
word), and a name that is not one printable line appears in the snippets as a placeholder.
"""

from __future__ import annotations

import html
import json
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gap_engine.core.cachepaths import META_FILE, entry_dir
from gap_engine.core.errors import GapError
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import read_json_file

if TYPE_CHECKING:
    from gap_engine.model.rateplan import RatePlan

CARD_FILE = "README.md"


def table_settings(table_key: str | None) -> dict[str, Any] | None:
    """What is known of the loss table behind a plan: its cached spec, else its key's parts.

    The key reads ``<model>-<objective>-<mode>-<estimator>-<hash>`` (see tables.table_key).
    """
    if not table_key:
        return None
    try:
        meta = read_json_file(entry_dir(table_key) / META_FILE, LIMITS.metadata_bytes, META_FILE, GapError)
    except GapError:
        meta = {}  # a table evicted from (or never in) this machine's cache, or a damaged entry
    spec = meta.get("spec") if isinstance(meta, dict) else None
    if isinstance(spec, dict):
        return {"key": table_key, **spec}
    parts = table_key.rsplit("-", 4)
    if len(parts) == 5:
        return {"key": table_key, "objective": parts[1], "mode": parts[2], "estimator": parts[3]}
    return {"key": table_key}


# Characters with a meaning in Markdown text or a table cell, escaped with a backslash.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!|~])")
# A Hugging Face hub id, the only base model the front matter names.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
SNIPPET_PLACEHOLDER = "CHECKPOINT_FOLDER"


def md_text(value: object, limit: int = 500) -> str:
    """``value`` as inert Markdown text (also safe in a table cell): one line, HTML escaped,
    Markdown punctuation backslash-escaped, at most ``limit`` characters."""
    text = "" if value is None else str(value)
    text = "".join(ch if ch.isprintable() else " " for ch in text)[:limit]
    return _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(text, quote=True))


def snippet_name(folder_name: str) -> str:
    """The folder name for the code snippets, or a placeholder when it is not one printable line."""
    return folder_name if folder_name and folder_name.isprintable() and len(folder_name) <= 255 else SNIPPET_PLACEHOLDER


def _fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, bool):
        return md_text(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "" if value is None else md_text(value)


def _plan_table(plan: RatePlan, widths: list[dict[str, Any]], dense: dict[str, Any]) -> list[str]:
    rows = [
        "| layer | attention removed | query heads | KV heads | MLP removed | MLP channels |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, w in enumerate(widths):
        rows.append(
            f"| {i} | {plan.attention_rates[i]:.3f} | {w['num_attention_heads']}/{dense['heads']} "
            f"| {w['num_key_value_heads']}/{dense['kv_heads']} | {plan.mlp_rates[i]:.3f} "
            f"| {w['intermediate_size']}/{dense['channels']} |"
        )
    return rows


def _eval_section(report: dict[str, Any]) -> list[str]:
    lines = ["## Evaluation", ""]
    settings = report.get("settings") or {}
    if settings:
        lines.append(
            f"Held-out windows: {md_text(settings.get('n_samples'))} x {md_text(settings.get('seq_len'))} tokens per source "
            f"(seed {md_text(settings.get('seed'))}), never overlapping the calibration text"
            + (f" ({md_text(settings['heldout_split'])} part of the held-out text)." if settings.get("heldout_split") else ".")
        )
        lines.append("")
    dense = report.get("dense") or {}
    lines += ["| source | perplexity | dense perplexity | KL to dense (nats/token) | top-1 agreement |", "|---|---:|---:|---:|---:|"]
    for source, ppl in (report.get("perplexity") or {}).items():
        lines.append(
            f"| {md_text(source)} | {_fmt(ppl)} | {_fmt((dense.get('perplexity') or {}).get(source))} "
            f"| {_fmt((report.get('kl_to_dense') or {}).get(source), 4)} | {_fmt((report.get('top1_agreement') or {}).get(source))} |"
        )
    throughput = report.get("throughput") or {}
    ratios = {k: v for k, v in throughput.items() if k.endswith("speedup") and isinstance(v, (int, float))}
    if ratios:
        lines += [
            "",
            "PyTorch throughput against the dense model, same run: " + ", ".join(f"{md_text(k)} {v:.2f}x" for k, v in ratios.items()),
        ]
    generations = report.get("generations") or []
    if generations:
        lines += ["", "Greedy generations:", ""]
        for g in generations:
            if not isinstance(g, dict):
                continue
            dense_text = f" (dense: {md_text(repr(g['dense']))})" if g.get("dense") else ""
            lines.append(f"- {md_text(g.get('prompt'))} → {md_text(repr(g.get('model')))}" + dense_text)
    return lines + [""]


def _recovery_section(recovery: dict[str, Any]) -> list[str]:
    """What the recovery fine-tune ran, and the held-out numbers before and after it."""
    objective = md_text(recovery.get("objective"))
    if recovery.get("teacher"):
        objective += f" from {md_text(recovery['teacher'])}"
        if recovery.get("temperature") is not None:
            objective += f", temperature {_fmt(float(recovery['temperature']), 2)}"
    lines = ["## Recovery", "", "| | |", "|---|---|"]
    lines += [
        f"| method | {md_text(recovery.get('method'))} |",
        f"| objective | {objective} |",
        f"| training text (calibration part) | {', '.join(md_text(t) for t in recovery.get('tasks') or [])} |",
        f"| steps | {int(recovery.get('steps') or 0):,} |",
        f"| training tokens | {int(recovery.get('tokens') or 0):,} |",
        f"| training time | {float(recovery.get('train_seconds') or 0.0):.0f} s |",
        f"| peak learning rate | {float(recovery.get('lr') or 0.0):.3g} |",
        *_judge_rows(recovery.get("judge")),
        "",
        "Held-out numbers before → after recovery:",
        "",
        "| source | perplexity | KL to dense (nats/token) | top-1 agreement |",
        "|---|---:|---:|---:|",
    ]
    before, after = recovery.get("before") or {}, recovery.get("after") or {}

    def pair(key: str, source: str, digits: int) -> str:
        b, a = (before.get(key) or {}).get(source), (after.get(key) or {}).get(source)
        return f"{_fmt(b, digits) or '–'} → {_fmt(a, digits) or '–'}"

    for source in after.get("perplexity") or {}:
        lines.append(
            f"| {md_text(source)} | {pair('perplexity', source, 3)} | {pair('kl_to_dense', source, 4)} "
            f"| {pair('top1_agreement', source, 3)} |"
        )
    return lines + [""]


def _judge_rows(judge: Any) -> list[str]:
    """The snapshot judged best during training and the curve it was chosen from (none: no rows)."""
    if not isinstance(judge, dict) or not judge.get("by"):
        return []
    curve = ", ".join(
        f"{int(row.get('step', 0))}: {float(row.get('score', 0.0)):.4g}" for row in judge.get("curve") or [] if isinstance(row, dict)
    )
    return [
        f"| snapshot kept | step {int(judge.get('best_step') or 0):,}, the best by {md_text(judge['by'])} |",
        f"| judged (step: score) | {md_text(curve)} |",
    ]


def _params_line(params: dict[str, Any], marker: dict[str, Any]) -> str:
    """'dense → stored' parameters (the stored count is the checkpoint's, biases included), the
    share of the prunable ones the cut removed, and the biases compensation added back."""
    after = f"{marker.get('param_count', 0):,}"
    compensation = marker.get("compensation")
    biases = compensation.get("bias_params") if isinstance(compensation, dict) else None
    added = (
        f"; includes {biases:,} bias parameters that compensation added"
        if isinstance(biases, int) and not isinstance(biases, bool) and biases > 0
        else ""
    )
    if not isinstance(params.get("dense_total"), int):
        return after + (f" ({added[2:]})" if added else "")
    line = f"{params['dense_total']:,} → {after}"
    removed = params.get("removed_fraction_of_prunable")
    if isinstance(removed, float):
        line += f" ({removed:.1%} of the prunable attention and MLP parameters removed{added})"
    elif added:
        line += f" ({added[2:]})"
    return line


def compensation_text(record: object) -> str:
    """One line on what the kept units got after the cut: the mode and how it was fitted."""
    if not isinstance(record, dict) or record.get("mode") in (None, "none"):
        return "none (the kept weights are the dense model's)"
    text = md_text(record.get("mode"))
    windows = record.get("windows") if isinstance(record.get("windows"), dict) else {}
    details = []
    if isinstance(record.get("damping"), (int, float)) and "refit" in str(record.get("mode")):
        details.append(f"damping {float(record['damping']):g}")
    if windows:
        details.append(
            f"fitted block by block on {md_text(windows.get('n_samples'))} x {md_text(windows.get('seq_len'))} "
            f"calibration tokens of {md_text(windows.get('data'))}"
        )
    if record.get("target") == "dense":
        details.append("matching the dense model's own activations")
    if record.get("weighting") == "output-norm":
        details.append("each token, BOS included, weighted through the norms after o_proj and down_proj")
    return text + (f" ({', '.join(details)})" if details else "")


def _usage_and_limits(folder_name: str, evaluated: bool, recovered: bool = False) -> list[str]:
    """The card's "Use it" (transformers, llama.cpp, gap) and "Limits" sections.

    The folder name lands in Python as a string literal (``repr``) and in the shell as one
    quoted word (``shlex.quote``); the tokenizer needs no remote code, so its line asks for none.
    """
    name = snippet_name(folder_name)
    gguf_name = name + ".gguf"
    llama_cpp_code = f"from llama_cpp import Llama; print(Llama({gguf_name!r}, flash_attn=True)('The capital of France is', max_tokens=32))"
    return [
        "## Use it",
        "",
        "transformers (the folder carries its modeling code, `modeling_gap_pruned.py`, which subclasses "
        "transformers' own classes with narrower blocks; gap_engine is not needed):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True, dtype="auto")',
        f"tokenizer = AutoTokenizer.from_pretrained({name!r})",
        "```",
        "",
        "llama.cpp (Llama-family and Qwen2 checkpoints; written as llama.cpp's `deci` architecture, "
        "which reads per-layer head counts and MLP widths):",
        "",
        "```bash",
        f"gap export {shlex.quote(name)} --format gguf --outtype q8_0 --out {shlex.quote(gguf_name)}",
        f'llama-cli -m {shlex.quote(gguf_name)} -fa on -p "The capital of France is" -n 32',
        f"python -c {shlex.quote(llama_cpp_code)}",
        "```",
        "",
        "gap_engine itself:",
        "",
        "```bash",
        f"gap eval --model {shlex.quote(name)}",
        "```",
        "",
        "or `gap_engine.model.loading.load_model`.",
        "",
        "## Limits",
        "",
        (
            "- Recovered by the short fine-tune above only, not retrained: expect higher perplexity than the base model"
            if recovered
            else "- Pruned without any retraining or distillation: expect higher perplexity than the base model, growing with the budget"
        )
        + ("; the numbers above come from small held-out samples." if evaluated else "."),
        "- The calibration text (for the importance scores and the loss table) was small and English; "
        "other domains and languages may lose more.",
        "- Loading the model with transformers needs `trust_remote_code=True` (the folder's own "
        "`modeling_gap_pruned.py`; read it first) and transformers >= 5.24 (its heterogeneous "
        "`per_layer_config`); the tokenizer loads without it.",
        "- GGUF export covers the Llama family (Llama, SmolLM2, Mistral) and Qwen2; Qwen3 (q/k norms) and "
        "Gemma 3 do not fit llama.cpp's per-layer `deci` architecture. In q8_0, MLP tensors whose width "
        "is not a multiple of 32 stay f16. Run llama.cpp with flash attention (as above): without it, "
        "llama.cpp pads every layer's V cache to the widest layer's.",
        "- Safety, bias and licence terms are those of the base model.",
        "",
    ]


def render_model_card(
    folder_name: str,
    plan: RatePlan,
    marker: dict[str, Any],
    config: dict[str, Any],
    eval_report: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
) -> str:
    """The README.md text of a checkpoint.

    Args:
        folder_name: the checkpoint folder's name (used in the load snippets).
        plan: the applied RatePlan.
        marker: the gap_pruned.json content (fingerprints, parameter count, widths, dtype).
        config: the folder's config.json (dense widths, model type).
        eval_report: an ``EvalReport.to_dict()``, or None.
        recovery: what a recovery fine-tune ran (``recover.files.card_summary``), or None.
    """
    base = marker.get("base_model") or plan.model
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["pruned", "structured-pruning", "gap-engine", str(config.get("model_type", ""))[:64]],
    }
    if isinstance(base, str) and _HUB_ID.match(base):
        front["base_model"] = base
    widths = marker.get("widths") or []
    dense = {
        "heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads"),
        "channels": config.get("intermediate_size"),
    }
    params = plan.params or {}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    lines += [
        f"# {md_text(folder_name)}",
        "",
        f"{md_text(base)} with attention heads and MLP channels physically removed by gap_engine "
        "(GAP: layer-adaptive structured pruning, EMNLP 2025): each block keeps its own number of "
        "heads and channels, chosen under one global parameter budget.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {md_text(base)} (weights fingerprint {md_text(marker.get('base_fingerprint'))}) |",
        f"| parameters | {_params_line(params, marker)} |",
        f"| allocator | {md_text(plan.allocator)}" + (f", budget {plan.budget:.3f}" if isinstance(plan.budget, float) else "") + " |",
        f"| within-layer criterion | {md_text(plan.criterion)} (MLP widths in multiples of {md_text(plan.channel_multiple)}) |",
        f"| compensation after the cut | {compensation_text(marker.get('compensation'))} |",
        f"| stored as | {md_text(marker.get('dtype', 'float32'))} safetensors, fingerprint {md_text(marker.get('fingerprint'))} |",
        f"| plan made | {md_text(plan.created)} |",
        "",
        "## Plan",
        "",
        "Fraction of each component's parameters removed, and the widths that remain "
        "(kept / dense). `plan.json` / `plan.yaml` hold the plan, `kept_indices.json` which heads, "
        "KV groups and channels of the dense model every block kept.",
        "",
        *_plan_table(plan, widths, dense),
        "",
    ]
    table = table_settings(plan.table_key)
    lines += ["## Loss table", ""]
    if table:
        lines.append(
            "The allocator read this sensitivity table (per layer and rate, the loss increase when only that component is pruned):"
        )
        lines.append("")
        lines += [f"- {md_text(k)}: {md_text(v)}" for k, v in table.items()]
        if isinstance(plan.predicted_loss, float):
            lines.append(f"- predicted summed loss increase of this plan: {plan.predicted_loss:.4f}")
    else:
        lines.append(f"None: the rates were set by the {md_text(plan.allocator)} allocator without a loss table.")
    lines.append("")
    if recovery:
        lines += _recovery_section(recovery)
    if eval_report:
        lines += _eval_section(eval_report)
    lines += _usage_and_limits(folder_name, bool(eval_report), bool(recovery))
    return "\n".join(lines)


def write_model_card(
    folder: str | Path,
    plan: RatePlan,
    marker: dict[str, Any],
    eval_report: dict[str, Any] | None = None,
    name: str | None = None,
    recovery: dict[str, Any] | None = None,
) -> Path:
    """Render the card from the folder's config.json and write README.md (atomically).

    ``name`` is the folder name the load snippets use (the final name, when ``folder`` is
    still the temporary folder of an atomic write).
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return atomic_write_text(folder / CARD_FILE, render_model_card(name or folder.name, plan, marker, config, eval_report, recovery))
