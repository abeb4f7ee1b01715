"""Shared look of every figure: the template, colours, labels and tick helpers."""

from __future__ import annotations

import math

from plotly.colors import sequential

from gap_engine.plan.allocator_registry import ALLOCATORS

TEMPLATE = "plotly_white"
KIND_LABEL = {"attn": "attention", "mlp": "MLP", "block": "block"}
ATTN_COLOR = "#4C78A8"
MLP_COLOR = "#F58518"
UNIFORM_COLOR = str(ALLOCATORS["uniform"].color)
DP_COLOR = str(ALLOCATORS["dp"].color)
CURRENT_COLOR = "#E45756"
TEXT_COLOR = "#31333F"
BYTES_PER_PARAM = 4  # the engine keeps weights in float32
SLIDER_STEPS = 101  # steps of an exported planner figure's own slider
DEPTH_SCALE = "Viridis"  # layer depth, shallow (dark) to deep (yellow)


def allocator_style(allocator: str, default_color: str | None = "#888") -> tuple[str, str | None]:
    """(marker symbol, colour) of an allocator's points, from its registry entry; a circle in
    ``default_color`` where the entry names no colour or no entry has the name (a hand-made plan)."""
    entry = ALLOCATORS.choices.get(allocator)
    return (entry.symbol, entry.color or default_color) if entry is not None else ("circle", default_color)


def _off_placeholder(color: str) -> str:
    """Streamlit's front end rewrites the colours #000001..#0000ff (its theme placeholders)
    wherever they occur, even with ``theme=None``: Magma's darkest, #000004, became a light
    pink in the app while the PNG export drew it black. Nudge such colours off the range."""
    return "#010005" if color.lower().startswith("#0000") and len(color) == 7 else color


# High loss dark, as in a printed heat map; an explicit list, so no theme can flip it.
HEAT_SCALE = [[i / (len(sequential.Magma_r) - 1), _off_placeholder(c)] for i, c in enumerate(sequential.Magma_r)]
OBJECTIVE_NAME = {"nll": "NLL", "kl": "KL"}

# The run history's columns as a reader should see them (one place: table, charts, report).
RUN_COLUMN_LABELS = {
    "id": "run",
    "created": "when (UTC)",
    "model": "model",
    "table_key": "loss table",
    "allocator": "allocator",
    "budget": "budget (of prunable)",
    "dense_params": "dense parameters",
    "pruned_params": "parameters after",
    "predicted_loss": "predicted loss increase",
    "actual_loss": "measured loss increase",
    "prefill_speedup": "prefill speed vs dense",
    "decode_speedup": "decode speed vs dense",
    "checkpoint": "checkpoint",
    "plan_hash": "plan hash",
    "seconds": "run time (s)",
    "note": "note",
    "compensation": "compensation",
    "bias_params": "bias parameters added",
    "net_removed": "net parameters removed",
}
_SOURCE_COLUMN_LABELS = {
    "ppl": "perplexity ({})",
    "dense_ppl": "dense perplexity ({})",
    "kl": "held-out KL to dense ({})",
    "top1": "top-1 agreement ({})",
    "acc": "accuracy ({})",
    "acc_stderr": "accuracy ± ({})",
    "acc_norm": "acc_norm ({})",
    "dense_acc": "dense accuracy ({})",
    "dense_acc_stderr": "dense accuracy ± ({})",
    "dense_acc_norm": "dense acc_norm ({})",
}


def column_label(name: str) -> str:
    """What a reader sees for a run-history column (``ppl:wiki-sample`` -> ``perplexity (wiki-sample)``)."""
    if name in RUN_COLUMN_LABELS:
        return RUN_COLUMN_LABELS[name]
    prefix, _, source = str(name).partition(":")
    if source and prefix in _SOURCE_COLUMN_LABELS:
        return _SOURCE_COLUMN_LABELS[prefix].format(source)
    return str(name)


def loss_label(objective: str, what: str = "increase") -> str:
    """Axis title of a loss: ``NLL increase (nats/token)``."""
    return f"{OBJECTIVE_NAME.get(objective, objective)} {what} (nats/token)"


def component_kinds(table) -> list[str]:
    seen = []
    for _, kind in table.components:
        if kind not in seen:
            seen.append(kind)
    return seen


def log_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """One tick per decade between low and high (> 0), written as plain numbers."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    values = [10.0**e for e in range(first, last + 1)]
    return values, [f"{v:g}" for v in values]
