"""The stakeholder report: one self-contained HTML file about a loss table, a plan and its run.

What a reader needs to judge a pruning, in one file that opens from disk with no server
and no network (plotly.js is inlined once, fonts are the system's): the model and the
loss table's settings, the sensitivity chart, the DP front with the chosen plan marked,
the per-layer plan, and, when a run or an evaluation is given, the measured numbers
beside the dense model's and the greedy generations side by side; a run also brings its
takeaway sentence and the measured frontier of the runs it compares with (`takeaway.run_story`).

`build_report` assembles the HTML from engine objects; `write_report` writes it
atomically; `evaluation_from_run` / `evaluation_from_report` bring a history run or a
``gap eval --json`` report into one shape. The figures are `figures`' (the app draws the
same ones).
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from gap_engine import __version__
from gap_engine.core.config import DEFAULT_BUDGET
from gap_engine.core.errors import GapError, PlanError
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import check_evaluation_report, read_json_file
from gap_engine.evaluate import history
from gap_engine.evaluate.takeaway import RunStory, run_story
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.units import ComponentGeometry
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.front_view import RemovedShares, plan_figures, removed_shares, step_at_budget
from gap_engine.plan.problem import Constraints
from gap_engine.prune.compensations import adds_biases
from gap_engine.views import figures

if TYPE_CHECKING:
    from gap_engine.pipeline.runs import BaselinePlan

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["select2d", "lasso2d"]}


class ReportError(GapError):
    """A report cannot be made from these inputs (mismatched table, plan or run)."""


# ---- evaluation numbers, from a run or an eval report -------------------------------------
def evaluation_from_report(report: dict, label: str = "evaluation") -> dict:
    """The report's view of an ``EvalReport.to_dict()`` (what ``gap eval --json`` prints).

    Raises:
        ReportError: not an evaluation report.
    """
    if not isinstance(report, dict) or not isinstance(report.get("perplexity"), dict):
        raise ReportError(f"{label} is not an evaluation report (no 'perplexity' object): make it with `gap eval --json`")
    dense = report.get("dense") or {}
    throughput = report.get("throughput") or {}
    return {
        "label": label,
        "params": report.get("params"),
        "dense_params": dense.get("params"),
        "perplexity": dict(report["perplexity"]),
        "dense_perplexity": dict(dense.get("perplexity") or {}),
        "kl": dict(report.get("kl_to_dense") or {}),
        "top1": dict(report.get("top1_agreement") or {}),
        "predicted_loss": None,
        "actual_loss": None,
        "prefill_speedup": throughput.get("prefill_speedup"),
        "decode_speedup": throughput.get("decode_speedup"),
        "generations": [
            {"prompt": g.get("prompt", ""), "dense": g.get("dense", ""), "pruned": g.get("model", "")}
            for g in report.get("generations") or []
        ],
        "tasks": dict(report.get("task_accuracy") or {}),
        "dense_tasks": dict(report.get("dense_task_accuracy") or {}),
        "compensation": str(report.get("compensation") or "none"),
        "bias_params": _whole_or_none(report.get("bias_params")),
    }


def _whole_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def evaluation_from_run(record) -> dict:
    """The report's view of a `history.RunRecord`."""
    return {
        "label": f"run {record.id} ({record.created})",
        "params": record.pruned_params,
        "dense_params": record.dense_params,
        "perplexity": dict(record.perplexity),
        "dense_perplexity": dict(record.dense_perplexity),
        "kl": dict(record.kl),
        "top1": dict(record.top1),
        "predicted_loss": record.predicted_loss,
        "actual_loss": record.actual_loss,
        "prefill_speedup": record.prefill_speedup,
        "decode_speedup": record.decode_speedup,
        "generations": [
            {"prompt": g.get("prompt", ""), "dense": g.get("dense", ""), "pruned": g.get("model", "")} for g in record.generations or []
        ],
        "tasks": dict((record.tasks or {}).get("model") or {}),
        "dense_tasks": dict((record.tasks or {}).get("dense") or {}),
        "compensation": history.fitted_as(record),
        "bias_params": history.bias_params_of(record),
        "recovery": (record.params or {}).get("recovery"),
    }


# ---- checks ---------------------------------------------------------------------------------
def check_plan(table, plan: RatePlan) -> None:
    """Raise ReportError when ``plan`` is not a plan for ``table``'s model (or names another table)."""
    if plan.model != table.model or plan.num_layers != table.num_layers:
        raise ReportError(
            f"the plan is for {plan.model} ({plan.num_layers} layers), the loss table for {table.model} ({table.num_layers} layers)"
        )
    if plan.model_fingerprint and plan.model_fingerprint != table.model_fingerprint:
        raise ReportError(f"the plan was made for other weights of {plan.model} than the loss table")
    if plan.table_key and plan.table_key != table.key:
        raise ReportError(f"the plan was made from loss table {plan.table_key}, not {table.key}")


def _plan_row(table, plan: RatePlan, evaluation: dict | None = None) -> dict:
    """The plan as a front row; its removal and prediction recomputed from the table's cells, or
    checked against them (`front_view.plan_figures`): a plan's own numbers are never shown unchecked.

    Biases a compensation added (the run's, measured; else those the plan was counted for, checked
    against its own totals) make the row's ``removed`` and ``budget`` net of them, as a charged
    front row's are, and go in ``bias_params``.
    """
    try:
        figures_ = plan_figures(table, plan)
    except PlanError as exc:
        raise ReportError(str(exc)) from None
    known = figures_["removed"] is not None  # off the grid with no count of its own: only its range is known
    biases = _bias_params(plan, evaluation, figures_["removed"]) if known else 0
    removed = figures_["removed"] - biases if known else int(sum(figures_["removed_range"]) // 2)
    return {
        "budget": removed / table.dense_prunable if known else figures_["budget"],
        "removed": removed,
        "bias_params": biases,
        "removed_range": None if known else figures_["removed_range"],
        "predicted_loss": figures_["predicted_loss"] if known else None,  # no point drawn where the count is unknown
        "claimed_loss": figures_["predicted_loss"],
        "attention_rates": list(plan.attention_rates),
        "mlp_rates": list(plan.mlp_rates),
        "label": "GAP DP" if plan.allocator == "dp" else f"{plan.allocator} plan",
    }


def _bias_params(plan: RatePlan, evaluation: dict | None, cut: int) -> int:
    """The parameters compensation's biases add to the model of ``plan``, whose cut removes ``cut``:
    the run's own count when there is one; else what an evaluation's pruned model has beyond
    dense less the cut (an evaluation file counts both models, not the biases); else the plan's
    (when it was counted for a compensation that adds them).

    Raises:
        ReportError: a plan whose bias count contradicts its own totals.
    """
    evaluation = evaluation or {}
    measured = _whole_or_none(evaluation.get("bias_params"))
    if measured is not None:
        return measured
    pruned, dense = _whole_or_none(evaluation.get("params")), _whole_or_none(evaluation.get("dense_params"))
    if pruned is not None and dense is not None and 0 <= pruned - (dense - cut) <= cut:
        return pruned - (dense - cut)
    if not adds_biases(plan.compensation):
        return 0
    params = plan.params
    counts = [params.get(name) for name in ("bias_params", "removed", "pruned_total_with_biases", "pruned_total")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
        raise ReportError("the plan says it was counted for bias compensation but does not count its biases")
    biases, removed, with_biases, without = (int(v) for v in counts)  # type: ignore[arg-type]
    if not 0 <= biases <= removed or with_biases - without != biases:
        raise ReportError(f"the plan counts {biases:,} bias parameters, which its own totals contradict")
    return int(biases)


# ---- the HTML ---------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def plotly_js() -> str:
    """The installed plotly package's plotly.min.js (about 4.6 MB), read from disk once per process
    and safe inside a ``<script>`` element: every report, and any page that needs plotly.js as a
    script of its own, shares this one copy."""
    import plotly

    source = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    return source.replace("</script", "<\\/script")  # cannot end the <script> element early


def _figure_html(fig) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config=PLOT_CONFIG)


def _table(header: list[str], rows: list[list], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _num(value, fmt: str = "{:.4f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return html.escape(fmt.format(value))


def _settings_html(table) -> str:
    spec = table.spec
    rows = [
        ["model", html.escape(table.model)],
        ["loss table", f"<code>{html.escape(table.key)}</code>"],
        ["estimator", html.escape(spec.estimator)],
        ["objective", html.escape(figures.loss_label(spec.objective))],
        [
            "calibration text",
            f"{html.escape(spec.windows.data)}: {spec.windows.n_samples} windows x {spec.windows.seq_len} tokens, seed {spec.windows.seed}",
        ],
        ["within-layer criterion", html.escape(spec.criterion)],
        ["rate grid", html.escape(", ".join(f"{r:g}" for r in table.rate_grid))],
        ["components", f"{len(table.components)} ({html.escape(spec.mode)}: {table.num_layers} layers)"],
        ["MLP channels kept in multiples of", str(spec.channel_multiple)],
        ["dense objective on the calibration text", _num(table.dense_objective)],
        ["prunable parameters", f"{table.dense_prunable:,}"],
        ["built in", f"{table.build_seconds:.0f} s"],
    ]
    return _table(["setting", "value"], rows, "settings")


def _plan_table_html(row: dict, shares: RemovedShares | None = None) -> str:
    """The per-layer rates, and with ``shares`` what they really remove (attention rounds to whole heads)."""
    rates = list(zip(row["attention_rates"], row["mlp_rates"]))
    if shares is None:
        rows = [[str(i), f"{a:.3f}", f"{m:.3f}"] for i, (a, m) in enumerate(rates)]
        return _table(["layer", "attention rate", "MLP rate"], rows, "rates")
    rows = [[str(i), f"{a:.3f}", f"{shares.attention[i]:.1%}", f"{m:.3f}", f"{shares.mlp[i]:.1%}"] for i, (a, m) in enumerate(rates)]
    header = ["layer", "attention rate asked", "attention removed", "MLP rate asked", "MLP removed"]
    return _table(header, rows, "rates")


def _evaluation_html(evaluation: dict, objective: str) -> str:
    sources = list(evaluation["perplexity"])
    rows = []
    for source in sources:
        ppl, dense = evaluation["perplexity"].get(source), evaluation["dense_perplexity"].get(source)
        change = None if ppl is None or not dense else (ppl / dense - 1) * 100
        rows.append(
            [
                html.escape(source),
                _num(dense, "{:.2f}"),
                _num(ppl, "{:.2f}"),
                _num(change, "{:+.1f}%"),
                _num(evaluation["kl"].get(source)),
                _num(evaluation["top1"].get(source), "{:.1%}"),
            ]
        )
    parts = [
        f"<p class='note'>From {html.escape(evaluation['label'])}.</p>",
        _table(
            ["held-out text", "dense perplexity", "pruned perplexity", "change", "held-out KL to dense (nats/token)", "top-1 agreement"],
            rows,
        ),
    ]
    facts = []
    if evaluation.get("dense_params") and evaluation.get("params"):
        facts.append(["parameters", f"{evaluation['dense_params']:,} → {evaluation['params']:,}"])
    name = figures.OBJECTIVE_NAME.get(objective, objective)
    if evaluation.get("predicted_loss") is not None:
        facts.append([f"{name} increase predicted by the table", _num(evaluation["predicted_loss"], "{:+.4f}")])
    if evaluation.get("actual_loss") is not None:
        facts.append([f"{name} increase measured on the calibration text", _num(evaluation["actual_loss"], "{:+.4f}")])
    if evaluation.get("prefill_speedup") is not None:
        facts.append(["prefill speed vs dense", _num(evaluation["prefill_speedup"], "{:.2f}x")])
    if evaluation.get("decode_speedup") is not None:
        facts.append(["decode speed vs dense", _num(evaluation["decode_speedup"], "{:.2f}x")])
    if facts:
        parts.append(_table(["measure", "value"], facts))
    if evaluation["generations"]:
        parts.append("<h3>Greedy generations</h3>")
        for g in evaluation["generations"]:
            parts.append(
                "<div class='generation'>"
                f"<p class='prompt'><b>Prompt</b> {html.escape(g['prompt'])}</p>"
                "<div class='pair'>"
                f"<div><h4>dense</h4><p>{html.escape(g['dense'] or '—')}</p></div>"
                f"<div><h4>pruned</h4><p>{html.escape(g['pruned'])}</p></div>"
                "</div></div>"
            )
    return "\n".join(parts)


def task_table_html(rows: list[tuple[str, dict]]) -> str:
    """Task accuracy as papers print it: tasks as columns, one row per model, an average column.

    Args:
        rows: (label, {task: score dict with acc, acc_stderr}) per model, e.g. dense, plan, recovered.
    """
    tasks = list(dict.fromkeys(task for _, scores in rows for task in scores))
    body = []
    for label, scores in rows:
        cells = [html.escape(label)]
        for task in tasks:
            score = scores.get(task)
            cells.append("—" if score is None else f"{100 * score['acc']:.1f} ± {100 * (score.get('acc_stderr') or 0):.1f}")
        complete = all(task in scores for task in tasks)
        cells.append(f"{100 * sum(scores[t]['acc'] for t in tasks) / len(tasks):.1f}" if complete and tasks else "—")
        body.append(cells)
    examples = {task: next((s[task].get("n") for _, s in rows if task in s), None) for task in tasks}
    header = ["model"] + [f"{html.escape(t)} (n={examples[t]})" for t in tasks] + ["average"]
    return (
        "<p>Accuracy (%) ± its standard error, computed by EleutherAI's lm-evaluation-harness (acc: the choice with the "
        "highest log-likelihood). A difference smaller than about two standard errors is within noise.</p>" + _table(header, body, "tasks")
    )


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #262730; margin: 0; }
main { max-width: 1150px; margin: 0 auto; padding: 1.5rem 1rem 3rem; }
h1 { font-size: 1.9rem; margin-bottom: 0.2rem; }
h2 { margin-top: 2.2rem; border-bottom: 1px solid #e6e6e6; padding-bottom: 0.3rem; }
.note { color: #6b6f76; font-size: 0.9rem; }
.takeaway { font-size: 1.1rem; background: #eef5ee; border-left: 4px solid #54A24B; padding: 0.7rem 1rem; margin-top: 1.2rem; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8rem; margin-top: 1rem; }
.card { background: #f0f2f6; border-radius: 0.6rem; padding: 0.7rem 1rem; min-width: 10rem; }
.card .k { font-size: 0.8rem; color: #6b6f76; }
.card .v { font-size: 1.35rem; font-weight: 600; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border-bottom: 1px solid #e6e6e6; padding: 0.3rem 0.7rem; text-align: left; vertical-align: top; }
td { font-variant-numeric: tabular-nums; }
.generation { margin: 1rem 0; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
.pair > div { background: #f7f8fa; border-radius: 0.5rem; padding: 0.2rem 0.8rem; overflow-wrap: anywhere; }
.pair h4 { margin: 0.4rem 0 0; color: #6b6f76; font-weight: 600; }
@media (max-width: 700px) { .pair { grid-template-columns: 1fr; } }
"""


def _cards_html(table, row: dict, dense_total: int | None, evaluation: dict | None) -> str:
    """The headline numbers of the report, as cards: the parameters left are the model's with the
    biases its compensation added (the number the planner, the run and the model card show)."""
    name = figures.OBJECTIVE_NAME.get(table.spec.objective, table.spec.objective)
    removed = int(row["removed"])  # net of the biases
    biases = int(row.get("bias_params") or 0)
    span = row.get("removed_range")  # a plan between the grid rates with no count of its own
    prunable = table.dense_prunable
    cards = [
        ("model", html.escape(table.model)),
        ("budget (of prunable)", f"{span[0] / prunable:.2%} to {span[1] / prunable:.2%}" if span else f"{row['budget']:.2%}"),
        ("parameters removed", f"{span[0]:,} to {span[1]:,}" if span else f"{removed + biases:,}"),
        (f"predicted {name} increase", _num(row.get("claimed_loss", row.get("predicted_loss")), "{:+.4f}")),
    ]
    if biases:
        cards.insert(3, ("bias parameters added by compensation", f"{biases:,}"))
    measured_left = (evaluation or {}).get("params")
    left = None
    if isinstance(measured_left, int) and not span:
        left = f"{measured_left:,}"
    elif dense_total and span:
        left = f"{dense_total - span[1]:,} to {dense_total - span[0]:,}"
    elif dense_total:
        left = f"{dense_total - removed:,}"  # removed is net of the biases: the model's count with them
    if left is not None:
        cards.append(("parameters left" + (" (biases included)" if biases else ""), left))
    if dense_total:
        cards.insert(1, ("dense parameters", f"{dense_total:,}"))
    if evaluation:
        # a plan saved without compensation and a model pruned with it are told apart here
        cards.append(("compensation after the cut", html.escape(str(evaluation.get("compensation") or "none"))))
        first = next(iter(evaluation["perplexity"]), None)
        if first is not None:
            cards.append((f"perplexity on {html.escape(first)}", _num(evaluation["perplexity"][first], "{:.2f}")))
    return "".join(f"<div class='card'><div class='k'>{k}</div><div class='v'>{v}</div></div>" for k, v in cards)


def _story_sections(story: RunStory | None) -> list[str]:
    """The takeaway sentence and, when the history holds runs to draw, the measured frontier."""
    if story is None:
        return []
    sections = [f"<p class='takeaway'><b>Takeaway.</b> {html.escape(story.takeaway.text)}</p>"]
    if story.compensation is not None:
        sections.append(f"<p class='takeaway'><b>Compensation.</b> {html.escape(story.compensation.text)}</p>")
    if story.frontier:
        sections += [
            "<h2>Measured frontier</h2>",
            "<p>Every finished run on the same held-out windows: perplexity and KL to the dense model against the budget, "
            "one line per allocator. The bars are 95% bootstrap intervals over the held-out windows; a point without one "
            "was recorded before per-window numbers were kept.</p>",
            _figure_html(figures.measured_frontier_figure(story.frontier, story.dense)),
        ]
    return sections


def _task_sections(evaluation: dict | None) -> list[str]:
    """The paper-style task table (dense, the plan, the recovered model when given), if there are tasks."""
    if not evaluation or not evaluation.get("tasks"):
        return []
    rows = [("dense", evaluation.get("dense_tasks") or {}), ("pruned (plan)", evaluation["tasks"])]
    if evaluation.get("recovered_tasks"):
        rows.append(("pruned + recovered", evaluation["recovered_tasks"]))
    return ["<h2>Task accuracy</h2>", task_table_html(rows)]


def _judge_section(evaluation: dict | None) -> list[str]:
    """A recovery run's snapshots judged during training (``recover.judge``) and the one kept, if it judged any."""
    recovery = (evaluation or {}).get("recovery") or {}
    curve = recovery.get("judge_curve") if isinstance(recovery, dict) else None
    if not isinstance(curve, list) or not curve:
        return []
    rows = [[html.escape(str(row.get("step"))), _num(row["score"] if isinstance(row.get("score"), (int, float)) else None),
             "kept" if row.get("step") == recovery.get("best_step") else ""] for row in curve if isinstance(row, dict)]  # fmt: skip
    by = html.escape(str(recovery.get("judge") or "the judge"))
    return ["<h2>Recovery: snapshots judged during training</h2>", f"<p>Scored by {by}; the checkpoint holds the kept one.</p>",
            _table(["step", "score", ""], rows)]  # fmt: skip


def _reported_row(
    table, plan: RatePlan | None, evaluation: dict | None, budget: float, front: list[dict], constraints: Constraints
) -> tuple[dict, str, dict[int, float] | None]:
    """(the row the report is about, a line saying what it is, the locked rates to mark): the plan's
    own row, or without a plan the DP front's row at ``budget``."""
    if plan is not None:
        check_plan(table, plan)
        row = _plan_row(table, plan, evaluation)
        span = row["removed_range"]
        share = f"{span[0] / table.dense_prunable:.2%} to {span[1] / table.dense_prunable:.2%}" if span else f"{row['budget']:.2%}"
        net = ", net of the biases its compensation adds" if row["bias_params"] else ""
        return row, f"{plan.allocator} plan {plan.content_hash()} (removes {share} of prunable parameters{net})", None
    if not 0.0 <= budget < 1.0:
        raise ReportError(f"budget {budget:g} is outside [0, 1): it is the fraction of prunable parameters to remove")
    row = front[step_at_budget(front, list(range(len(front))), budget)]
    locked = {int(k): float(v) for k, v in dict(constraints.locked).items()} or None
    return row, f"GAP DP front row at budget {row['budget']:.2%}", locked


def build_report(
    table,
    plan: RatePlan | None = None,
    evaluation: dict | None = None,
    budget: float = DEFAULT_BUDGET,
    constraints: Constraints | None = None,
    uniform: list[dict] | None = None,
    baselines: list[BaselinePlan] | None = None,
    dense_total: int | None = None,
    source: str = "",
    front: list[dict] | None = None,
    counts: Sequence[ComponentGeometry] | None = None,
    story: RunStory | None = None,
) -> str:
    """The report as one HTML document.

    Args:
        table: the LossTable.
        plan: the chosen plan (checked against the table); None: the DP front row at ``budget``.
        evaluation: `evaluation_from_run` / `evaluation_from_report`, or None.
        budget: without a plan, the budget whose DP front row is reported.
        constraints: the constraints the front is solved under (those of the plan, when known).
        uniform: `front_view.uniform_line` rows to draw (needs the model; the app passes them).
        baselines: baseline plan rows to draw.
        dense_total: all parameters of the dense model, when known (readouts).
        source: how the report was made (shown in the footer).
        front: the DP front rows to draw (the explorer's, charged for the compensation its runs
            apply); None: solved here, uncharged.
        counts: the model's blocks (``units.block_geometries``): the plan's bars then show what
            its rates really remove; None: the rates as asked.
        story: the run's takeaway and measured frontier (`takeaway.run_story`); None: no run.
    Returns:
        HTML text; plotly.js is inlined once and nothing is fetched when it opens.
    Raises:
        ReportError: a plan for another model or table.
        BudgetError: contradictory constraints, or a budget outside [0, 1).
    """
    constraints = constraints or Constraints()
    front = front if front is not None else front_rows(table, dp_front(table, constraints))
    if not front:
        raise ReportError("no plan satisfies these constraints: the front is empty")
    row, what, locked = _reported_row(table, plan, evaluation, budget, front, constraints)
    if plan is not None:
        dense_total = dense_total or plan.params.get("dense_total")
    objective = table.spec.objective
    cards_html = _cards_html(table, row, dense_total, evaluation)
    if plan is not None:  # the identity the explorer, the run history and the checkpoint show
        cards_html += f"<div class='card'><div class='k'>plan hash</div><div class='v'>{plan.content_hash()}</div></div>"
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    sections = [
        f"<h1>GAP pruning report: {html.escape(table.model)}</h1>",
        f"<p class='note'>{html.escape(what)} · made {created} with gap_engine {__version__}</p>",
        f"<div class='cards'>{cards_html}</div>",
        *_story_sections(story),
        "<h2>Loss table</h2>",
        "<p>How much the loss grows when one layer's attention heads or MLP channels are pruned, alone, at each rate. "
        "GAP's planner spends the budget where these curves stay low.</p>",
        _settings_html(table),
        _figure_html(figures.sensitivity_figure(table)),
        "<h2>The plan against the DP front</h2>",
        "<p>Left: the pruning rate of every layer. Right: the least predicted loss the exact DP reaches at every budget, "
        "with the reported plan marked.</p>",
        _figure_html(figures.plan_figure(table, front, row, dense_total, locked, uniform, baselines, counts)),
        "<h2>Per-layer plan</h2>",
        _plan_table_html(
            row, removed_shares(counts, row["attention_rates"], row["mlp_rates"], table.spec.channel_multiple) if counts else None
        ),
    ]
    if evaluation:
        sections += ["<h2>Evaluation</h2>", _evaluation_html(evaluation, objective)]
    sections += _task_sections(evaluation) + _judge_section(evaluation)
    footer = f"<p class='note'>{html.escape(source)}</p>" if source else ""
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>GAP report: {html.escape(table.model)}</title>"
        f"<style>{_CSS}</style>"
        f"<script type='text/javascript'>{plotly_js()}</script>"
        "</head><body><main>\n" + "\n".join(sections) + footer + "\n</main></body></html>\n"
    )


def write_report(path: str | Path, text: str) -> Path:
    """Write the report atomically (a half-written file never appears at ``path``)."""
    return atomic_write_text(path, text)


def read_evaluation(path: str | Path) -> dict:
    """`evaluation_from_report` of a ``gap eval --json`` file.

    Raises:
        ReportError: unreadable, not JSON, or not an evaluation report.
    """
    path = Path(path)
    what = f"evaluation {path}"
    data = read_json_file(path, LIMITS.metadata_bytes, what, ReportError)  # size and nesting bounded: a report reads files a user hands it
    return evaluation_from_report(check_evaluation_report(data, what, ReportError), label=path.name)


@dataclass(frozen=True)
class ReportInputs:
    """What a report shows beside the table: the plan, its measured numbers and the constraints."""

    plan: RatePlan | None  # None: the DP front row at the report's budget
    evaluation: dict | None  # measured numbers (evaluation_from_run / read_evaluation), if any
    constraints: Constraints  # the planner's constraints the plan was made under
    story: RunStory | None = None  # the run's takeaway and measured frontier; None without a run


def report_inputs(
    plan: RatePlan | None,
    run_id: int | None = None,
    evaluation_path: str | Path | None = None,
    constraints: Constraints | None = None,
    plan_name: str = "the plan",
) -> ReportInputs:
    """The report's inputs, assembled one way for `gap report` and the explorer's Export page.

    A run brings its numbers and the constraints it was planned under, and must have pruned
    ``plan`` when both are given; an evaluation file (``gap eval --json``) needs a plan, since it
    does not say which plan made the model.

    Raises:
        ReportError: an evaluation without a plan, or a run that pruned another plan.
        GapError: an unreadable run or evaluation file.
    """
    constraints = constraints or Constraints()
    if evaluation_path is not None:
        if plan is None:
            raise ReportError("--eval needs --plan: an evaluation file does not say which plan made the model")
        return ReportInputs(plan, read_evaluation(evaluation_path), constraints)
    if run_id is None:
        return ReportInputs(plan, None, constraints)
    record = history.get_run(run_id)
    run_plan = RatePlan.from_dict(dict(record.plan))
    if plan is not None and (plan.attention_rates, plan.mlp_rates) != (run_plan.attention_rates, run_plan.mlp_rates):
        raise ReportError(f"run {run_id} pruned another plan than {plan_name}: give one of them")
    run_constraints = Constraints.from_dict((record.params or {}).get("constraints"))
    return ReportInputs(plan or run_plan, evaluation_from_run(record), run_constraints, run_story(history.runs(), int(run_id)))
