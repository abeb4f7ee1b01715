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
from collections.abc import Callable
from typing import Any

import pandas as pd

from gap_engine.evaluate.history import RunRecord, fitted_as
from gap_engine.evaluate.tasks import score_text


def run_label(record: RunRecord) -> str:
    """'run 3: dp at 20.00%' (budgets with two decimals, as every page shows them)."""
    budget = f" at {record.budget:.2%}" if record.budget is not None else ""
    return f"run {record.id}: {record.allocator}{budget}"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def throughput_spread(record: RunRecord, kind: str) -> tuple[float, float, int] | None:
    """(lowest, highest, repeats) of a run's ``kind`` ("prefill" or "decode") speed ratios, when stored."""
    stored = (record.params or {}).get("throughput") or {}
    ratios = stored.get(f"{kind}_speedup_repeats")
    if not ratios:
        return None
    return min(ratios), max(ratios), len(ratios)


def within_noise(first: RunRecord, second: RunRecord, kind: str) -> bool | None:
    """Whether two runs' ``kind`` speed ratios are within noise: their repeat ranges overlap.

    None when either run kept no repeats (nothing to say either way).
    """
    a, b = throughput_spread(first, kind), throughput_spread(second, kind)
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


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


# (label, run value, dense value or None, how changes read, dense text or None)
Measure = tuple[str, Callable[..., Any], Callable[..., Any] | None, str, str | None]


def _measures(records: list[RunRecord]) -> list[Measure]:
    """(label, run value, dense value, how changes read, dense text) for every measure.

    ``dense value`` is None where the measure is already relative to dense (KL, agreement,
    loss increases, speed ratios): the dense column then shows ``dense text`` and the runs
    no change against dense.
    """
    sources = []
    for record in records:
        sources += [s for s in record.perplexity if s not in sources]
    rows: list[Measure] = [("parameters", lambda r: r.pruned_params, lambda r: r.dense_params, "relative", None)]
    for source in sources:
        rows += [
            (
                f"perplexity ({source})",
                lambda r, s=source: r.perplexity.get(s),
                lambda r, s=source: r.dense_perplexity.get(s),
                "relative",
                None,
            ),
            (f"held-out KL to dense ({source})", lambda r, s=source: r.kl.get(s), None, "difference", "0"),
            (f"top-1 agreement ({source})", lambda r, s=source: r.top1.get(s), None, "difference", "1"),
        ]
    return (
        rows
        + _task_measures(records)
        + [
            ("predicted loss increase", lambda r: r.predicted_loss, None, "difference", "0"),
            ("measured loss increase (calibration)", lambda r: r.actual_loss, None, "difference", "0"),
            ("prefill speed vs dense", lambda r: r.prefill_speedup, None, "relative", "1.00x"),
            ("decode speed vs dense", lambda r: r.decode_speedup, None, "relative", "1.00x"),
        ]
    )


def task_score(record: RunRecord, task: str, model: str = "model") -> dict[str, Any]:
    """A run's stored lm-eval score of ``task`` (``model``: "model" or "dense"); {} when it has none."""
    scores = (record.tasks or {}).get(model) or {}
    score = scores.get(task) if isinstance(scores, dict) else None
    return score if isinstance(score, dict) else {}


def _task_measures(records: list[RunRecord]) -> list[Measure]:
    """One row per lm-eval task any picked run has: accuracy ± its standard error, its changes read
    as differences; the dense column shows dense's the same way (runs without tasks show '—')."""
    tasks: list[str] = []
    for record in records:
        tasks += [t for t in ((record.tasks or {}).get("model") or {}) if t not in tasks]
    rows: list[Measure] = []
    for task in tasks:
        dense = next((text for r in records if (text := score_text(task_score(r, task, "dense")))), None)
        rows.append((
            f"accuracy ({task})", lambda r, t=task: task_score(r, t).get("acc"),
            lambda r, t=task: task_score(r, t, "dense").get("acc"), "difference", dense or "—",
        ))  # fmt: skip
    return rows


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


def _cell(
    record: RunRecord, reference: RunRecord, label: str, value_of: Callable[..., Any], dense_of: Callable[..., Any] | None, how: str
) -> str:
    value = value_of(record)
    if not _finite(value):
        return "—"
    notes = []
    if dense_of is not None and (change := _change(value, dense_of(record), how)):
        notes.append(f"{change} vs dense")
    spread = throughput_spread(record, label.split()[0]) if "speed" in label else None
    if spread is not None and spread[0] <= 1.0 <= spread[1]:
        notes.append("within noise of dense")
    if record is not reference and "speed" in label and within_noise(record, reference, label.split()[0]):
        notes.append(f"within noise of run {reference.id}: the repeat ranges overlap")
    elif record is not reference and (change := _change(value, value_of(reference), how)):
        notes.append(f"{change} vs run {reference.id}")
    if "speed" in label:
        text = speed_text(record, label.split()[0])
    elif label.startswith("accuracy ("):  # with its standard error: a change smaller than two of them is noise
        text = score_text(task_score(record, label[len("accuracy (") : -1])) or _number(value)
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
    columns = {"measure": ["allocator", "budget (of prunable)", "compensation after the cut"], "dense": ["—", "0%", "—"]}
    for record in records:
        budget = "—" if record.budget is None else f"{record.budget:.2%}"
        columns[run_label(record).split(":")[0]] = [record.allocator, budget, fitted_as(record)]
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


def history_table(frame: pd.DataFrame) -> pd.DataFrame:
    """``history.list_runs()`` for reading: each task's numeric ``acc``/``acc_stderr`` (and dense's)
    columns become one text column 'accuracy (TASK)' / 'dense accuracy (TASK)' reading '0.375 ± 0.183',
    placed after the budget; a run without that task has an empty cell. The numeric columns stay in
    ``list_runs`` (charts, CSV). Perplexity and KL follow the accuracy, and the long context columns
    (the loss table's key, the time, the plan hash, the checkpoint folder) go last, so the measured
    numbers are on screen at 1400 px without scrolling."""
    tasks = list(dict.fromkeys(str(c).partition(":")[2] for c in frame.columns if str(c).startswith("acc:")))
    if not tasks:
        return _context_last(frame)
    shown = frame.drop(columns=[c for c in frame.columns if str(c).partition(":")[0] in _TASK_PREFIXES])
    texts = {}
    for task in tasks:
        for prefix, label in (("", "accuracy"), ("dense_", "dense accuracy")):
            texts[f"{label} ({task})"] = [
                score_text({"acc": row.get(f"{prefix}acc:{task}"), "acc_stderr": row.get(f"{prefix}acc_stderr:{task}")}) or ""
                for row in (_finite_values(r) for r in frame.to_dict("records"))
            ]
    at = list(shown.columns).index("budget") + 1 if "budget" in shown.columns else len(shown.columns)
    return _context_last(pd.concat([shown.iloc[:, :at], pd.DataFrame(texts, index=frame.index), shown.iloc[:, at:]], axis=1))


_CONTEXT_COLUMNS = ("created", "table_key", "plan_hash", "checkpoint", "note")  # long, and not what a reader compares


def _context_last(frame: pd.DataFrame) -> pd.DataFrame:
    """The budget, then what was measured (task accuracy, perplexity, KL), then the other numbers,
    the long context columns last."""
    columns = list(frame.columns)
    context = [c for c in _CONTEXT_COLUMNS if c in columns]
    lead = [c for c in columns[: columns.index("budget") + 1] if c not in context] if "budget" in columns else []
    measured = [c for c in columns if str(c).startswith(("accuracy (", "dense accuracy (", "ppl:", "dense_ppl:", "kl:")) and c not in lead]
    return frame[lead + measured + [c for c in columns if c not in lead + measured + context] + context]


_TASK_PREFIXES = frozenset({"acc", "acc_stderr", "acc_norm", "dense_acc", "dense_acc_stderr", "dense_acc_norm"})


def _finite_values(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its NaN cells (runs without a task) dropped."""
    return {key: value for key, value in row.items() if not (isinstance(value, float) and math.isnan(value))}
