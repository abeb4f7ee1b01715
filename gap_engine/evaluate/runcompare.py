"""Runs side by side, the way an experiment tracker shows them.

One row per measure (allocator, budget, parameters, held-out perplexity, KL and top-1
agreement per text, predicted and measured loss increase, prefill and decode speed with
their spread over repeats, run time); one column for the dense model and one per run.
Every run's value comes with its change against dense and against the first run picked
(the reference), so two runs read at a glance. The history stores every throughput repeat
(``pipeline.runs``), so a speed shows as its median and the range of the repeats: a ratio
of 1.4x with a range of 1.2-1.7x is not a 1.4x speed-up yet.

Pure: history records in, a table of display text out (the app and the report share it).
"""

from __future__ import annotations

import math

import pandas as pd

from gap_engine.evaluate.history import RunRecord


def run_label(record: RunRecord) -> str:
    """'run 3: dp at 20.0%'."""
    budget = f" at {record.budget:.1%}" if record.budget is not None else ""
    return f"run {record.id}: {record.allocator}{budget}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def throughput_spread(record: RunRecord, kind: str) -> tuple[float, float, int] | None:
    """(lowest, highest, repeats) of a run's ``kind`` ("prefill" or "decode") speed ratios, when stored."""
    stored = (record.params or {}).get("throughput") or {}
    ratios = stored.get(f"{kind}_speedup_repeats")
    if not ratios:
        return None
    return min(ratios), max(ratios), len(ratios)


def speed_text(record: RunRecord, kind: str) -> str:
    """'1.42x (1.31-1.55x over 5 repeats)', or '1.42x' for a run with one number, or '—'."""
    median = getattr(record, f"{kind}_speedup")
    if not _finite(median):
        return "—"
    spread = throughput_spread(record, kind)
    if spread is None:
        return f"{median:.2f}x"
    low, high, repeats = spread
    return f"{median:.2f}x ({low:.2f}–{high:.2f}x over {repeats} repeats)"


def _measures(records: list[RunRecord]) -> list[tuple]:
    """(label, run value, dense value, how changes read, dense text) for every measure.

    ``dense value`` is None where the measure is already relative to dense (KL, agreement,
    loss increases, speed ratios): the dense column then shows ``dense text`` and the runs
    no change against dense.
    """
    sources = []
    for record in records:
        sources += [s for s in record.perplexity if s not in sources]
    rows = [("parameters", lambda r: r.pruned_params, lambda r: r.dense_params, "relative", None)]
    for source in sources:
        rows += [
            (f"perplexity ({source})", lambda r, s=source: r.perplexity.get(s), lambda r, s=source: r.dense_perplexity.get(s), "relative", None),
            (f"KL to dense ({source})", lambda r, s=source: r.kl.get(s), None, "difference", "0"),
            (f"top-1 agreement ({source})", lambda r, s=source: r.top1.get(s), None, "difference", "1"),
        ]
    return rows + [
        ("predicted loss increase", lambda r: r.predicted_loss, None, "difference", "0"),
        ("measured loss increase", lambda r: r.actual_loss, None, "difference", "0"),
        ("prefill speed vs dense", lambda r: r.prefill_speedup, None, "relative", "1.00x"),
        ("decode speed vs dense", lambda r: r.decode_speedup, None, "relative", "1.00x"),
    ]


def _number(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:,.2f}M"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.3f}"


def _change(value: float, base: float, how: str) -> str | None:
    if not (_finite(value) and _finite(base)):
        return None
    if how == "relative":
        return None if base == 0 else f"{(value / base - 1) * 100:+.1f}%"
    return f"{value - base:+.4f}"


def _cell(record: RunRecord, reference: RunRecord, label: str, value_of, dense_of, how: str) -> str:
    value = value_of(record)
    if not _finite(value):
        return "—"
    notes = []
    if dense_of is not None and (change := _change(value, dense_of(record), how)):
        notes.append(f"{change} vs dense")
    if record is not reference and (change := _change(value, value_of(reference), how)):
        notes.append(f"{change} vs run {reference.id}")
    if "speed" in label:
        text = speed_text(record, label.split()[0])
    else:
        text = _number(value)
    return text + (f" ({', '.join(notes)})" if notes else "")


def comparison_frame(records: list[RunRecord]) -> pd.DataFrame:
    """The runs side by side: a ``measure`` column, ``dense``, then one column per run.

    A run's cell is its value, then its change against dense and, from the second run on,
    against the first (the reference): "12.41 (+8.1% vs dense, +2.0% vs run 3)". Speeds
    carry their median and spread over repeats.
    """
    if not records:
        return pd.DataFrame(columns=["measure", "dense"])
    reference = records[0]
    columns = {"measure": ["allocator", "budget (of prunable)"], "dense": ["—", "0%"]}
    for record in records:
        columns[run_label(record).split(":")[0]] = [record.allocator, "—" if record.budget is None else f"{record.budget:.2%}"]
    for label, value_of, dense_of, how, dense_text in _measures(records):
        dense = next((v for v in (dense_of(r) for r in records) if _finite(v)), None) if dense_of else None
        columns["measure"].append(label)
        columns["dense"].append(dense_text or ("—" if dense is None else _number(dense)))
        for record in records:
            columns[run_label(record).split(":")[0]].append(_cell(record, reference, label, value_of, dense_of, how))
    columns["measure"].append("run time")
    columns["dense"].append("—")
    for record in records:
        columns[run_label(record).split(":")[0]].append("—" if record.seconds is None else f"{record.seconds:.0f} s")
    return pd.DataFrame(columns)
